"""Worker faults for real: the worker actor's process is SIGKILLed or SIGSTOPped mid-generation;
the engine rebuilds the group and every request finishes with the tokens of a fault-free run."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import jsonschema
import psutil
import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from workers import fault_hook
from workers.executor import WorkerFailedError
from workers.ray_executor import STEP_CHANNEL_ENV

PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + 20 + 9 * i)) for i in range(4)]
MAX_TOKENS = 24
ENGINE = dict(kv_cache_memory=1 << 22, max_num_batched_tokens=64)


def _params() -> list[SamplingParams]:
    greedy = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True) for _ in PROMPTS[:3]]
    seeded = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=MAX_TOKENS, ignore_eos=True)
    return greedy + [seeded]


def _tokens(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def fault_free(tiny_llama) -> list[list[list[int]]]:
    with LLM(tiny_llama, **ENGINE) as llm:
        return _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False))


def _run_with_fault(llm: LLM, fault, after_steps: int = 6, rank: int = 0) -> list[list[list[int]]]:
    """Queue every request, step a while, apply `fault` to a rank's process, run to the end."""
    engine = llm.engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params())):
        engine.add_request(str(i), None, prompt, params)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == after_steps:
            fault(engine.executor.worker_pids()[rank])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
    return _tokens([finished[str(i)] for i in range(len(PROMPTS))])


def _assert_all_free(llm: LLM) -> None:
    llm.engine.refresh_stats()
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and not llm.engine.scheduler.groups


@pytest.mark.parametrize("tp, rank, after_steps, channel", [(1, 0, 6, True), (1, 0, 1, True), (2, 1, 6, True),
                                                         (2, 1, 6, False)],
                         ids=["tp1-mid-decode", "tp1-mid-prefill", "tp2-rank1-mid-decode",
                              "tp2-rank1-mid-decode-ray-calls"])
def test_sigkilled_worker_is_replaced_and_every_request_resumes_with_the_same_tokens(
        ray_session, tiny_llama, fault_free, monkeypatch, tp, rank, after_steps, channel):
    """`channel`: steps go over the step channel (workers/step_channel.py), as by default, or as
    Ray actor calls (PAGEDSERVE_STEP_CHANNEL=0)."""
    if not channel:
        monkeypatch.setenv(STEP_CHANNEL_ENV, "0")
    with LLM(tiny_llama, distributed_executor_backend="ray", tensor_parallel_size=tp, **ENGINE) as llm:
        assert (llm.engine.executor.channel is not None) == channel
        old, spares = llm.engine.executor.worker_pids(), llm.engine.executor.spare_pids()
        got = _run_with_fault(llm, lambda pid: os.kill(pid, signal.SIGKILL), after_steps, rank)
        assert got == fault_free  # greedy and seeded n=2: no token lost, repeated or changed
        assert llm.engine.executor.worker_pids() == spares  # the warm spares took over
        stats = llm.stats()
        assert stats["worker_restarts_death"] == 1 and stats["requests_resumed"] == len(PROMPTS)
        assert stats["recovery_seconds_count"] == 1
        assert llm.engine.executor.worker_pids() != old
        _assert_all_free(llm)


def test_hung_worker_is_caught_by_the_step_timeout_and_replaced(ray_session, tiny_llama, fault_free):
    stopped = []

    def hang(pid):
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    with LLM(tiny_llama, distributed_executor_backend="ray", step_timeout=3.0, **ENGINE) as llm:
        try:
            got = _run_with_fault(llm, hang)
        finally:
            for pid in stopped:  # never leave a stopped process behind, whatever happened
                if psutil.pid_exists(pid):
                    os.kill(pid, signal.SIGKILL)
        assert got == fault_free
        assert llm.stats()["worker_restarts_hang"] == 1
        _assert_all_free(llm)


def test_a_rank_ray_holds_dead_is_replaced_though_its_channel_still_answers(ray_session, tiny_llama, fault_free):
    """A worker on a node Ray lost (its raylet gone) may run on and answer the step channel; Ray's
    word wins, as it did when steps were Ray calls: the group is rebuilt and every request resumes."""
    import ray

    with LLM(tiny_llama, distributed_executor_backend="ray", **ENGINE) as llm:
        def ray_reports_it_gone(pid):
            executor = llm.engine.executor
            executor._serving = [ray.put("ended")]  # the rank's serving task, as Ray ends a lost worker's
            executor._liveness_checked = 0.0  # asked at the next step, not up to a second later

        got = _run_with_fault(llm, ray_reports_it_gone)
        assert got == fault_free
        assert llm.stats()["worker_restarts_death"] == 1
        _assert_all_free(llm)


def test_a_step_channel_that_cannot_be_reached_fails_the_start_as_a_worker_death(ray_session, tiny_llama,
                                                                                 monkeypatch):
    import ray

    import workers.ray_executor as ray_executor

    def unreachable(*args, **kwargs):
        raise ConnectionRefusedError("refused")

    monkeypatch.setattr(ray_executor, "StepChannel", unreachable)
    free_cpus = _settled_free_cpus()  # an earlier test's groups may still be letting theirs go
    with pytest.raises(WorkerFailedError, match="step channel could not be reached") as info:
        LLM(tiny_llama, distributed_executor_backend="ray", **ENGINE)
    assert info.value.cause == "death"  # as a worker dying while the group starts: a rebuild may retry it
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < free_cpus and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) >= free_cpus  # the group's placement let go


def _settled_free_cpus(quiet_s: float = 1.0, timeout_s: float = 15.0) -> float:
    """The cluster's free CPUs once the count has held still for `quiet_s`: a group shut down by
    the test before this one gives its placement back asynchronously."""
    import ray

    deadline = time.monotonic() + timeout_s
    free, since = ray.available_resources().get("CPU", 0), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.1)
        now = ray.available_resources().get("CPU", 0)
        if now != free:
            free, since = now, time.monotonic()
    return free


def test_a_crash_loop_ends_in_a_clean_fail_stop(ray_session, tiny_llama):
    with LLM(tiny_llama, distributed_executor_backend="ray", max_worker_restarts=1, **ENGINE) as llm:
        engine = llm.engine
        engine.add_request("a", None, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(engine.executor.worker_pids()[0], signal.SIGKILL)
        engine.step()  # the one restart allowed
        assert llm.stats()["worker_restarts"] == 1
        os.kill(engine.executor.worker_pids()[0], signal.SIGKILL)
        with pytest.raises(WorkerFailedError) as info:
            for _ in range(5):
                engine.step()
        assert info.value.cause == "death"


def _crash_token(*token_lists) -> int:
    """A token id in none of these lists: a poison prompt holds it, no other step ever does."""
    seen = {t for tokens in token_lists for t in tokens}
    return next(t for t in range(1000, 2000) if t not in seen)


def test_a_poison_request_is_ended_after_two_faulted_steps_and_the_others_resume(
        ray_session, tiny_llama, fault_free, monkeypatch):
    """The armed fault hook kills every worker whose step holds the poison token: its request
    ends with an error naming it (the only request of a faulted batch in its second consecutive
    faulted batch); every other request finishes with the fault-free tokens."""
    token = _crash_token(*PROMPTS, *(t for request in fault_free for t in request))
    monkeypatch.setenv(fault_hook.CRASH_ON_TOKEN_ENV, str(token))
    with LLM(tiny_llama, distributed_executor_backend="ray", **ENGINE) as llm:
        engine = llm.engine
        for i, (prompt, params) in enumerate(zip(PROMPTS, _params())):
            engine.add_request(str(i), None, prompt, params)
        engine.add_request("poison", None, [5, 6, token, 7],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert _tokens([finished[str(i)] for i in range(len(PROMPTS))]) == fault_free
        assert "'poison'" in finished["poison"].error
        assert all(finished[str(i)].error is None for i in range(len(PROMPTS)))
        stats = llm.stats()
        # Two faults: the second batch's only twice-faulted request is the poison; or three, when
        # others shared both batches and ran one per step first, the third naming it alone.
        assert stats["worker_restarts_death"] in (2, 3)
        assert stats["requests_finished_poison"] == 1
        assert not engine.scheduler.fault_suspects
        _assert_all_free(llm)


SWAP_ENGINE = dict(kv_cache_memory=8 * 2 * 2 * 16 * 2 * 16 * 4, swap_space=0.01, preemption_mode="swap",
                   max_num_batched_tokens=64)  # 8 blocks of the tiny model: groups must swap


def test_a_swapped_group_keeps_its_kv_through_a_worker_fault(ray_session, tiny_llama, fault_free):
    """A worker is killed while a group sits in the CPU store: the store outlives the group, and
    the swapped group swaps back in (no recompute) with the fault-free tokens."""
    with LLM(tiny_llama, distributed_executor_backend="ray", **SWAP_ENGINE) as llm:
        engine = llm.engine
        for i, (prompt, params) in enumerate(zip(PROMPTS, _params())):
            engine.add_request(str(i), None, prompt, params)
        finished, survivors = {}, None
        while engine.has_unfinished_requests():
            if survivors is None and engine.scheduler.swapped:
                os.kill(engine.executor.worker_pids()[0], signal.SIGKILL)
                swapped = [seq for group in engine.scheduler.swapped for seq in group]
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if survivors is None and llm.stats()["worker_restarts"] == 1:
                survivors = [seq for seq in swapped
                             if any(seq in group for group in engine.scheduler.swapped)]
                assert survivors and all(seq.cpu_block_table for seq in survivors)
                swap_ins = engine.scheduler.swap_in_blocks
        assert _tokens([finished[str(i)] for i in range(len(PROMPTS))]) == fault_free
        assert engine.scheduler.swap_in_blocks > swap_ins  # they came back from the store
        assert all(seq.num_preemptions == 1 for seq in survivors)  # swapped once, never recomputed
        assert engine.kv_store_restarts == 0
        _assert_all_free(llm)
        assert llm.stats()["cpu_blocks_used"] == 0


def test_beam_search_resumes_after_a_worker_fault_with_the_fault_free_beams(ray_session, tiny_llama):
    """Every beam's tokens live in the coordinator: a SIGKILL mid-search changes no hypothesis."""
    params = SamplingParams(use_beam_search=True, beam_width=3, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    with LLM(tiny_llama, **ENGINE) as llm:
        expected = llm.generate(prompt, params, use_tqdm=False)[0]
    with LLM(tiny_llama, distributed_executor_backend="ray", **ENGINE) as llm:
        engine = llm.engine
        engine.add_request("beams", None, PROMPTS[1], params)
        steps, finished = 0, None
        while engine.has_unfinished_requests():
            if steps == 5:
                os.kill(engine.executor.worker_pids()[0], signal.SIGKILL)
            for out in engine.step():
                finished = out if out.finished else finished
            steps += 1
        assert llm.stats()["worker_restarts_death"] == 1
        assert [c.token_ids for c in finished.outputs] == [c.token_ids for c in expected.outputs]
        _assert_all_free(llm)


def test_structured_outputs_survive_a_worker_fault_with_the_fault_free_tokens(ray_session, tiny_llama):
    """A SIGKILL mid-decode while constrained sequences (a JSON schema, n=2 seeded samples, a regex)
    run: the matchers live on the coordinator with their sequences' tokens, so the resumed outputs
    are the fault-free ones, token for token, and still follow their grammars."""
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    regex = r"[a-z]{4,9}-[0-9]{2,5}"

    def run(fault) -> list[list[str]]:
        with LLM(tiny_llama, distributed_executor_backend="ray", **ENGINE) as llm:
            engine = llm.engine
            params = [SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=60, structured_outputs=
                                     StructuredOutputsParams(json=schema, disable_any_whitespace=True)),
                      SamplingParams(temperature=0.0, max_tokens=30,
                                     structured_outputs=StructuredOutputsParams(regex=regex))]
            for i, p in enumerate(params):
                engine.input_processor.process(None, PROMPTS[i], p)  # compiles the grammar, as a door does
                engine.add_request(str(i), None, PROMPTS[i], p)
            finished, steps = {}, 0
            while engine.has_unfinished_requests():
                if steps == 4 and fault is not None:
                    fault(engine.executor.worker_pids()[0])
                finished.update({out.request_id: out for out in engine.step() if out.finished})
                steps += 1
            if fault is not None:
                assert llm.stats()["worker_restarts_death"] == 1
            _assert_all_free(llm)
            return [[c.text for c in finished[str(i)].outputs] for i in range(len(params))]

    fault_free = run(None)
    got = run(lambda pid: os.kill(pid, signal.SIGKILL))
    assert got == fault_free
    for text in got[0]:
        jsonschema.validate(json.loads(text), schema)
    assert re.fullmatch(regex, got[1][0])
