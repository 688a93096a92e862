"""The coordinator as a Ray actor in a real local Ray session, served over gRPC."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

import pagedserve
from coordinator.actor import CoordinatorActor, config_dict
from coordinator.server_options import ServerOptions
from pagedserve.config import EngineConfig


async def _async_health(port: int) -> bool:
    async with pagedserve.AsyncClient(f"127.0.0.1:{port}", timeout=30) as client:
        return await client.health()


def test_the_async_client_has_every_method_of_the_client():
    public = lambda cls: {name for name in vars(cls) if not name.startswith("_")}  # noqa: E731
    assert public(pagedserve.Client) <= public(pagedserve.AsyncClient)


def test_coordinator_actor_serves_the_same_tokens_as_the_offline_api(ray_session, tiny_llama):
    config = EngineConfig(model=tiny_llama, kv_cache_memory=1 << 24)
    actor = CoordinatorActor.remote()
    try:
        port = ray.get(actor.start.remote(config_dict(config), ServerOptions(port=0)), timeout=120)
        with pagedserve.Client(f"127.0.0.1:{port}", timeout=60) as client:
            assert client.health() and asyncio.run(_async_health(port))
            served = client.generate([11, 12, 13], max_tokens=6, temperature=0.0, ignore_eos=True)
        offline = pagedserve.LLM(tiny_llama, kv_cache_memory=1 << 24).generate(
            {"prompt_token_ids": [11, 12, 13]},
            pagedserve.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
        assert served.token_ids == offline.outputs[0].token_ids
        assert ray.get(actor.stats.remote())["kv_blocks_used"] == 0
    finally:
        ray.get(actor.shutdown.remote(), timeout=30)
        ray.kill(actor)


def test_coordinator_binds_first_and_stays_not_serving_when_the_model_fails_to_load(ray_session, tmp_path):
    import grpc
    import pytest

    config = config_dict(EngineConfig(model=str(tmp_path / "no-such-model"), kv_cache_memory=1 << 24))
    actor = CoordinatorActor.remote()
    try:
        port = ray.get(actor.start.remote(config, ServerOptions(port=0), wait=False), timeout=60)
        with pytest.raises(ValueError, match="no-such-model"):
            ray.get(actor.wait_ready.remote(), timeout=60)
        status = ray.get(actor.status.remote())
        assert status["state"] == "failed" and "failed to load" in status["reason"]
        with pagedserve.Client(f"127.0.0.1:{port}", timeout=30) as client:
            assert not client.health()  # bound, answering, NOT_SERVING
            assert not asyncio.run(_async_health(port))
            with pytest.raises(pagedserve.ServingError) as info:
                client.generate("Hello", max_tokens=2)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE and "no-such-model" in info.value.details
    finally:
        ray.get(actor.shutdown.remote(), timeout=30)
        ray.kill(actor)


def test_shutdown_drains_in_flight_requests_and_ends_the_rest_unavailable(ray_session, tiny_llama):
    import grpc

    from tests.serving import running_coordinator

    config = EngineConfig(model=tiny_llama, distributed_executor_backend="ray", kv_cache_memory=1 << 22)
    with running_coordinator(config, drain_timeout=1.5) as (actor, target):
        with pagedserve.Client(target, timeout=60) as client:
            short = client.stream([5, 6, 7], max_tokens=8, temperature=0.0, ignore_eos=True)
            long = client.stream([5, 6, 8], max_tokens=1000, temperature=0.0, ignore_eos=True)
            next(short), next(long)  # both in flight
            stopping = actor.shutdown.remote()
            deadline = time.monotonic() + 10
            while client.health() and time.monotonic() < deadline:
                time.sleep(0.02)
            with pytest.raises(pagedserve.ServingError) as refused:
                client.generate([1, 2, 3], max_tokens=2)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE  # no new requests
            assert sum(len(c.token_ids) for c in short) + 1 == 8  # finished within the drain
            with pytest.raises(pagedserve.ServingError) as ended:
                for _ in long:
                    pass
            assert ended.value.code == grpc.StatusCode.UNAVAILABLE and "drain" in ended.value.details
            ray.get(stopping, timeout=60)
    assert ServerOptions(drain_timeout=0).drain_timeout == 0


def _worker_actor_pids() -> set[int]:
    import psutil

    pids = set()
    for proc in psutil.process_iter(["cmdline"]):
        if "ray::WorkerActor" in " ".join(proc.info["cmdline"] or []):
            pids.add(proc.pid)
    return pids


def test_a_start_whose_http_port_is_taken_fails_and_leaves_no_worker_behind(ray_session, tiny_llama):
    """The model starts loading before the HTTP server binds: when that bind fails, start()
    raises the bind's error and the workers the load started are stopped once it finishes."""
    import socket

    before = _worker_actor_pids()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = config_dict(EngineConfig(model=tiny_llama, kv_cache_memory=1 << 22))
        actor = CoordinatorActor.remote()
        try:
            with pytest.raises(ray.exceptions.RayTaskError, match="cannot bind"):
                ray.get(actor.start.remote(config, ServerOptions(port=0, http_port=taken.getsockname()[1])),
                        timeout=120)
            ray.get(actor.wait_ready.remote(), timeout=120)  # the load has finished
            assert ray.get(actor.worker_pids.remote()) == []
            deadline = time.monotonic() + 30
            while _worker_actor_pids() - before:  # its group is being shut down
                assert time.monotonic() < deadline, f"workers left running: {_worker_actor_pids() - before}"
                time.sleep(0.5)
        finally:
            ray.get(actor.shutdown.remote(), timeout=60)
            ray.kill(actor)
