"""The coordinator's own process dies under a detached deployment (what `serve --detach` and
cluster.yaml run): Ray restarts the actor, which serves again on the same port with a fresh
engine. Its in-flight requests are lost: their streams end with UNAVAILABLE at once, never hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
import ray

import pagedserve
from coordinator.actor import ACTOR_NAME, NAMESPACE
from coordinator.server_options import ServerOptions
from pagedserve.config import EngineConfig
from pagedserve.serve_command import create_coordinator
from tests.test_cpu_binding import thread_nices
from tests.test_serve_cli import _cli, _env, _kill_named_actor

GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)

# A store's process that ends the way Ray ends it after its owner died: no close(), and no
# resource tracker left to unlink the segment.
_CREATE_AND_DIE = """
import os
from multiprocessing import resource_tracker
from kvstore.store import KVStore
store = KVStore(num_blocks=2, tp_size=1, block_bytes=64)
resource_tracker.unregister("/" + store.layout.segment, "shared_memory")
print(store.layout.segment, flush=True)
os._exit(0)
"""


def _store_segments() -> dict[str, int]:
    """KV-store segments made by this test session's Ray (other sessions may run beside it), by
    name: the creating store's pid (the name is pagedserve-kv-<pid namespace>-<pid>-<random>)."""
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    segments = {}
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if name.startswith("pagedserve-kv-") and len(parts) == 5 and int(parts[3], 16) in ours:
            segments[name] = int(parts[3], 16)
    return segments


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_until(condition, timeout: float, what: str) -> float:
    """Seconds until `condition()` held (polled every 50 ms); fails after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def _serving(target: str) -> bool:
    with pagedserve.Client(target, timeout=2) as client:  # a new channel: no reconnect backoff
        return client.health()


def test_sigkilled_detached_coordinator_is_restarted_and_serves_again_on_its_port(ray_session, tiny_llama):
    # A KV store too (swap_space), to see that its segment does not outlive the dead coordinator.
    config = EngineConfig(model=tiny_llama, kv_cache_memory=1 << 22, swap_space=0.01)
    before = set(_store_segments())
    actor = create_coordinator(config, ServerOptions(port=0, metrics_port=0), detach=True)
    try:
        port = ray.get(actor.launch.remote(), timeout=180)  # port 0: the restart must rebind this one
        target = f"127.0.0.1:{port}"
        first = ray.get(actor.status.remote())
        coordinator_pid = ray.get(actor.pid.remote())
        worker_pids = ray.get(actor.worker_pids.remote())
        if os.geteuid() == 0:  # raising a priority needs root or CAP_SYS_NICE
            # The session's Ray starts them at nice 15; they raise themselves to 0.
            assert all(thread_nices(pid) == {0} for pid in [coordinator_pid, *worker_pids])
        store_segments = set(_store_segments()) - before
        assert len(store_segments) == 1 and worker_pids
        store_segment = store_segments.pop()
        store_pid = _store_segments()[store_segment]

        with pagedserve.Client(target, timeout=60) as client:
            expected = client.generate([11, 12, 13], **GREEDY).token_ids
            in_flight = client.stream([5, 6, 8], max_tokens=1000, temperature=0.0, ignore_eos=True)
            next(in_flight)
            os.kill(coordinator_pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(pagedserve.ServingError) as lost:
                for _ in in_flight:
                    pass
            ended_after = time.monotonic() - killed
        assert lost.value.code == grpc.StatusCode.UNAVAILABLE
        assert ended_after < 5, ended_after  # the dead process's socket closed: no hang

        # Ray ended what the dead process owned: its worker actors and KV store.
        _wait_until(lambda: all(_gone(p) for p in [*worker_pids, store_pid]), 60, "the old workers and store end")
        serving_after = _wait_until(lambda: _serving(target), 180, f"serving again on {target}")
        print(f"stream ended {ended_after:.2f} s after the kill; serving again on the same port "
              f"{ended_after + serving_after:.1f} s after it")

        status = ray.get(actor.status.remote(), timeout=30)
        assert status["state"] == "serving" and status["port"] == port
        assert (status["metrics_port"], status.get("http_port")) == (first["metrics_port"], first.get("http_port"))
        assert ray.get(actor.pid.remote()) != coordinator_pid
        new_workers = ray.get(actor.worker_pids.remote())
        assert new_workers and not set(new_workers) & set(worker_pids)
        new_segments = set(_store_segments()) - before
        assert store_segment not in new_segments and len(new_segments) == 1  # the new store's only
        with pagedserve.Client(target, timeout=60) as client:
            assert client.generate([11, 12, 13], **GREEDY).token_ids == expected
            assert client.stats()["kv_blocks_used"] == 0

        # `pagedserve stop` finds the restarted server by its name and ends it for good.
        stopped = _cli("stop", "--address", ray.get_runtime_context().gcs_address, env=_env(RAY_AUTH_MODE=None))
        assert stopped.returncode == 0, stopped.stderr
        assert f"stopped the pagedserve server ({tiny_llama} on 127.0.0.1:{port})" in stopped.stdout
        with pytest.raises(ValueError):
            ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
        assert not _serving(target)
        _wait_until(lambda: all(_gone(p) for p in new_workers), 60, "the new workers end")
        assert set(_store_segments()) <= before
    finally:
        _kill_named_actor()


def test_a_new_store_removes_the_segments_of_dead_stores_only():
    """Ray ends a dead coordinator's KV store without a chance to unlink its segment: the next store
    on the node does, judging by the creator's pid in the name, and leaves a live store's alone."""
    from kvstore.store import KVStore, unlink_orphaned_segments

    live = KVStore(num_blocks=2, tp_size=1, block_bytes=64)
    repo = str(Path(__file__).resolve().parent.parent)
    dead = subprocess.run([sys.executable, "-c", _CREATE_AND_DIE], capture_output=True, text=True, timeout=60,
                          check=True, cwd=repo, env={**os.environ, "PYTHONPATH": repo}).stdout.strip()
    try:
        assert os.path.exists(f"/dev/shm/{dead}") and dead.rsplit("-", 2)[0] == live.layout.segment.rsplit("-", 2)[0]
        assert dead in unlink_orphaned_segments()
        assert not os.path.exists(f"/dev/shm/{dead}") and os.path.exists(f"/dev/shm/{live.layout.segment}")
    finally:
        live.close()
