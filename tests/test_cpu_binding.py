"""`cpu_threads_bind`: the spec's parsing, the node-wide core registry, and real Ray workers whose
torch threads end up pinned to cores of their own (read back from the kernel, per thread)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
import ray

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig, threads_bind_cores
from workers import cpu_binding
from workers.priority import lower_this_threads_priority, return_idle_threads_to_normal_policy
from workers.ray_executor import WorkerActor

two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")


def test_the_spec_is_parsed_and_bad_ones_are_refused_naming_the_field():
    assert threads_bind_cores("auto") is None and threads_bind_cores("nobind") is None
    assert threads_bind_cores("0-2|3,5") == [[0, 1, 2], [3, 5]]
    for bad in ("", "x", "2-1", "0,0", "1|", "-1"):
        with pytest.raises(ValueError, match="cpu_threads_bind must be 'auto', 'nobind' or cores per rank"):
            threads_bind_cores(bad)
    with pytest.raises(ValueError, match=r"cpu_threads_bind names cores for 2 rank\(s\); tensor_parallel_size is 1"):
        EngineConfig(cpu_threads_bind="0|1")


@two_cores
def test_cores_are_claimed_once_and_come_back_when_their_process_ends(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CORE_REGISTRY", str(tmp_path / "cores.json"))
    first, second = sorted(os.sched_getaffinity(0))[:2]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert cpu_binding.claim_cores(1) == [first]
        assert cpu_binding.claim_cores(1, pid=other.pid) == [second]
        everything = len(os.sched_getaffinity(0))
        assert cpu_binding.claim_cores(everything, pid=other.pid) is None  # too few free: nothing taken
        assert cpu_binding.claim_cores(1) == [first]  # a process's new claim replaces its old one
    finally:
        other.kill()
        other.wait()
    # The dead process's core is free again.
    assert cpu_binding.claim_cores(2) == [first, second]


def _pinned_cores(pid: int) -> set[int]:
    """The cores of the threads of `pid` that are pinned to exactly one core."""
    out = set()
    for thread in psutil.Process(pid).threads():
        try:
            cores = os.sched_getaffinity(thread.id)
        except OSError:  # the thread ended meanwhile
            continue
        if len(cores) == 1:
            out |= cores
    return out


def _greedy(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": [5 + i, 9, 11, 3 * i + 2]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _holders_gone(timeout: float = 20.0) -> None:
    """Wait for earlier tests' workers (ended, maybe still exiting) to leave the registry's cores."""
    deadline = time.monotonic() + timeout
    while cpu_binding.live_claims() and time.monotonic() < deadline:
        time.sleep(0.2)


@two_cores
def test_ray_workers_pin_their_threads_to_cores_of_their_own(ray_session, tiny_llama):
    with LLM(tiny_llama, tensor_parallel_size=2, worker_cpus=1, cpu_threads_bind="nobind",
             kv_cache_memory=1 << 22) as llm:
        expected = _greedy(llm)
        workers = llm.engine.executor.workers
        assert ray.get([w.bound_cores.remote() for w in workers]) == [None, None]
    for spec in ("auto", "1|0"):
        _holders_gone()
        with LLM(tiny_llama, tensor_parallel_size=2, worker_cpus=1, cpu_threads_bind=spec,
                 kv_cache_memory=1 << 22) as llm:
            workers = llm.engine.executor.workers
            cores = ray.get([w.bound_cores.remote() for w in workers])
            pids = ray.get([w.pid.remote() for w in workers])
            if spec == "1|0":
                assert cores == [[1], [0]]
            else:  # claimed in rank order from the node's first free cores
                assert sorted(cores) == [[c] for c in sorted(os.sched_getaffinity(0))[:2]]
            assert _greedy(llm) == expected
            # The thread that ran the model (torch's one thread here) is pinned, and to its own core.
            for pid, own in zip(pids, cores):
                assert _pinned_cores(pid) == set(own), (spec, pid, own)


@two_cores
def test_the_offline_engine_pins_only_named_cores_and_refuses_cores_it_cannot_take(tiny_llama):
    """In a process of its own: pinning the caller's thread would outlive the test."""
    script = (f"import os; from pagedserve import LLM; "
              f"llm = LLM({tiny_llama!r}, cpu_threads_bind='1', kv_cache_memory=1 << 22); "
              f"print(sorted(os.sched_getaffinity(0)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[1]"
    refused = subprocess.run([sys.executable, "-c", script.replace("'1'", "'4095'")], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0 and "cpu_threads_bind: cannot pin this process's threads to cores [4095]" in refused.stderr


def test_lowering_a_threads_priority_leaves_the_rest_of_its_process_alone():
    seen = {}

    def body():
        lower_this_threads_priority()
        seen["policy"] = os.sched_getscheduler(0)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen["policy"] == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_threads_a_lowered_thread_started_are_raised_again():
    """A thread started by a lowered one takes its policy (importing torch starts an OpenMP pool
    that way) and outlives it: it must not stay at SCHED_IDLE once the lowered work is done."""
    started, release, child = threading.Event(), threading.Event(), {}

    def child_body():
        child["tid"] = threading.get_native_id()
        started.set()
        release.wait()

    def lowered_body():
        lower_this_threads_priority()
        threading.Thread(target=child_body, daemon=True).start()
        started.wait()

    lowered = threading.Thread(target=lowered_body)
    lowered.start()
    lowered.join()
    try:
        assert os.sched_getscheduler(child["tid"]) == os.SCHED_IDLE
        return_idle_threads_to_normal_policy()
        assert os.sched_getscheduler(child["tid"]) == os.SCHED_OTHER
    finally:
        release.set()


def _torch_mapped(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch_cpu" in f.read()


def test_a_spare_warms_up_on_a_lowest_priority_thread_and_serves_at_normal_priority(ray_session):
    """A spare's imports run at the lowest priority beside a serving group; none of its threads
    stays there once they are done (it may take over the group's work at any time)."""
    spare = WorkerActor.options(num_cpus=0).remote()
    try:
        pid = ray.get(spare.pid.remote())
        assert not _torch_mapped(pid)
        ray.get(spare.warm.remote())
        assert _torch_mapped(pid)  # torch is imported
        policies = {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}
        assert os.SCHED_IDLE not in policies and os.SCHED_OTHER in policies
    finally:
        ray.kill(spare)


def test_a_group_worker_imports_torch_before_setup_is_called(ray_session):
    """A worker made for a group starts its imports when it is created (they overlap the calls
    leading up to setup); a spare does not (it warms up later, at the lowest priority)."""
    worker = WorkerActor.options(num_cpus=0).remote(preload=True)
    spare = WorkerActor.options(num_cpus=0).remote()
    try:
        worker_pid, spare_pid = ray.get([worker.pid.remote(), spare.pid.remote()])
        deadline = time.monotonic() + 60
        while not _torch_mapped(worker_pid):
            assert time.monotonic() < deadline, "the preloading worker never imported torch"
            time.sleep(0.1)
        assert not _torch_mapped(spare_pid)
    finally:
        ray.kill(worker)
        ray.kill(spare)


def test_a_preloading_worker_whose_imports_fail_says_so_at_setup(ray_session, tmp_path):
    """A worker whose imports fail on the preload thread reports it at setup: the group's start
    fails with the import's own message, not a hang or a worker that looks ready."""
    broken = tmp_path / "torch"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    worker = WorkerActor.options(num_cpus=0, runtime_env={"env_vars": {"PYTHONPATH": str(tmp_path)}}).remote(
        preload=True)
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="this torch is broken on purpose"):
            ray.get(worker.setup.remote({}, None, 0, 0, 1, ("127.0.0.1", 0)), timeout=120)
    finally:
        ray.kill(worker)


def thread_nices(pid: int) -> set[int]:
    nices = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            nices.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except OSError:  # the thread ended meanwhile
            pass
    return nices


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a process's priority needs root or CAP_SYS_NICE")
def test_a_ray_worker_computes_at_nice_0_though_ray_starts_it_lower(ray_session, tiny_llama):
    """The session's Ray starts its workers at its default worker_niceness (15), as a cluster
    started without pagedserve's setting does: a worker raises all its threads to 0 at setup."""
    with LLM(tiny_llama, distributed_executor_backend="ray", kv_cache_memory=1 << 22) as llm:
        _greedy(llm)
        (worker,), (spare,) = llm.engine.executor.worker_pids(), llm.engine.executor.spare_pids()
        assert 15 in thread_nices(spare)  # as Ray started it: a spare is raised when it takes over
        assert thread_nices(worker) == {0}
