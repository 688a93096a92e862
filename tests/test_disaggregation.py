"""Prefill/decode disaggregation served for real: one coordinator actor over a prefill replica and
a decode replica (each its own worker actor) sharing one KV store, in the test session's Ray,
clients over gRPC. Streams equal the offline API's tokens; a decode replica without room waits
with the prompt's KV leased in the store; an expired lease, a prefill replica that dies
mid-transfer, a worker held by SIGSTOP on either side and a store that dies end with the right
tokens and every block back: on both replicas and in the store.
(Leases that expire and aborts during the handoff are pinned down step by step in
tests/test_kv_handoff.py.)"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request

import pytest
import ray

import pagedserve
from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from tests.serving import offline_greedy, running_coordinator

BLOCK = 16
BLOCK_BYTES = 8192  # a whole block of the tiny Llama: 2 layers x K,V x 16 tokens x 2 KV heads x 16 dims x fp32
ENGINE = dict(kv_cache_memory=1 << 22, max_num_seqs=64, worker_cpus=1)
# The decode replica's pool: 20 blocks (320 tokens), so that one long request can fill it.
PD = dict(prefill_replicas=1, decode_replicas=1, decode_config={"kv_cache_memory": 20 * BLOCK_BYTES})


@pytest.fixture(scope="module")
def offline(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=1 << 22) as llm:
        yield llm


@pytest.fixture(scope="module")
def pd_server(ray_session, tiny_llama):
    config = EngineConfig(model=tiny_llama, **ENGINE)
    with running_coordinator(config, metrics_port=0, **PD) as (actor, target):
        yield actor, target


def _prompt(length: int, salt: int) -> list[int]:
    return [(37 * i + 11 * salt) % 4000 + 5 for i in range(length)]


def _wait_idle(client: pagedserve.Client, seconds: float = 15.0) -> dict:
    """Stats once nothing is in flight and no lease is held (or the time is up)."""
    deadline = time.monotonic() + seconds
    while True:
        stats = client.stats()
        idle = stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["pd_leases"] == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _assert_all_free(stats: dict) -> None:
    assert stats["replica.0.kv_blocks_used"] == 0 and stats["replica.1.kv_blocks_used"] == 0
    assert stats["pd_store_blocks_used"] == 0 and stats["pd_leases"] == 0  # cached blocks are free


def test_streams_through_prefill_and_decode_give_the_offline_tokens(pd_server, offline):
    actor, target = pd_server
    # Shorter than a block, exactly 1 and 2 blocks, 2 blocks + 1, and longer.
    prompts = [_prompt(n, i) for i, n in enumerate([5, 16, 32, 33, 47, 80])]
    expected = offline_greedy(offline, prompts, 10)

    async def run():
        async with pagedserve.AsyncClient(target, timeout=120) as client:
            return await asyncio.gather(*(client.generate(p, max_tokens=10, temperature=0.0, ignore_eos=True)
                                          for p in prompts))

    with pagedserve.Client(target, timeout=60) as client:
        before = client.stats()
        assert [list(c.token_ids) for c in asyncio.run(run())] == expected
        stats = _wait_idle(client)
    # Every prompt with a full block before its last token took the hop: 33, 47 and 80 tokens
    # (and 32: one block; 16 tokens has none before the block holding its last token).
    assert stats["pd_handoffs"] - before["pd_handoffs"] == 4
    assert stats["pd_fallback_recomputes"] == before["pd_fallback_recomputes"]
    published = stats["pd_transfer_blocks_published"] - before["pd_transfer_blocks_published"]
    loaded = stats["pd_transfer_blocks_loaded"] - before["pd_transfer_blocks_loaded"]
    assert published == 1 + 2 + 2 + 4 and loaded == published
    assert stats["pd_transfer_bytes_loaded"] == stats["pd_transfer_blocks_loaded"] * BLOCK_BYTES
    _assert_all_free(stats)

    port = ray.get(actor.status.remote())["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'pagedserve_replica_role{model_name=' in text
    assert 'replica="0",role="prefill"} 1.0' in text and 'replica="1",role="decode"} 1.0' in text
    assert 'pagedserve_pd_transfer_blocks_total{direction="publish"' in text
    assert 'pagedserve_pd_transfer_seconds_count{direction="load"' in text
    assert "pagedserve_pd_fallback_recomputes_total" in text and "pagedserve_pd_handoffs_total" in text


def test_parallel_samples_beams_and_seeded_sampling_through_prefill_and_decode(pd_server, offline):
    _, target = pd_server
    prompt = _prompt(45, 9)
    cases = [dict(n=2, temperature=0.9, seed=5, max_tokens=8), dict(use_beam_search=True, n=2, beam_width=2,
                                                                     max_tokens=6),
             dict(temperature=1.0, top_k=20, seed=77, max_tokens=8)]
    with pagedserve.Client(target, timeout=60) as client:
        for case in cases:
            expected = offline.generate([{"prompt_token_ids": prompt}], SamplingParams(ignore_eos=True, **case),
                                        use_tqdm=False)[0]
            got = client.generate_all(prompt, ignore_eos=True, **case)
            assert [list(c.token_ids) for c in got] == [list(c.token_ids) for c in expected.outputs]
        _assert_all_free(_wait_idle(client))


def test_a_decode_replica_without_free_blocks_serves_the_next_request_from_its_lease(pd_server, offline):
    """A long request holds 19 of the decode replica's 20 blocks; the next request (3 blocks) is
    prefilled and published meanwhile, cannot be admitted until the long one ends, and is then
    served from its leased blocks: loaded, not recomputed. (The wait itself is pinned down step by
    step in tests/test_kv_handoff.py.)"""
    _, target = pd_server
    runner, waiter = _prompt(300, 3), _prompt(40, 4)  # 19 of the 20 blocks at once, all 20 at the end
    expected = offline_greedy(offline, [runner, waiter], 20)

    async def main():
        async with pagedserve.AsyncClient(target, timeout=120) as client:
            long_one = asyncio.create_task(client.generate(runner, max_tokens=20, temperature=0.0, ignore_eos=True))
            while (await client.stats())["replica.1.num_running"] == 0:
                await asyncio.sleep(0.005)
            second = asyncio.create_task(client.generate(waiter, max_tokens=20, temperature=0.0, ignore_eos=True))
            return [list((await t).token_ids) for t in (long_one, second)]

    with pagedserve.Client(target, timeout=60) as client:
        before = client.stats()
        got = asyncio.run(main())
        stats = _wait_idle(client)
    assert got == expected
    assert stats["pd_fallback_recomputes"] == before["pd_fallback_recomputes"]  # loaded, not recomputed
    assert stats["pd_transfer_blocks_loaded"] - before["pd_transfer_blocks_loaded"] >= 2  # the waiter's at least
    _assert_all_free(stats)


def test_a_prefill_replica_that_dies_mid_transfer_is_never_read_and_the_decode_side_recomputes(
        ray_session, tiny_llama, offline):
    """The prefill worker SIGKILLs itself halfway through writing the prompt's blocks (a test hook),
    and its replica may not rebuild (max_worker_restarts 0): nothing it wrote becomes visible, the
    decode replica computes the prompt and gives the same tokens, and the server keeps serving."""
    config = EngineConfig(model=tiny_llama, **ENGINE)
    prompts = [_prompt(70, 41), _prompt(36, 42)]
    expected = offline_greedy(offline, prompts, 10)
    pd = {**PD, "prefill_config": {"max_worker_restarts": 0}}
    with running_coordinator(config, env={"PAGEDSERVE_FAULT_CRASH_IN_PUBLISH": "1"}, http=False, **pd) as (_, target):
        with pagedserve.Client(target, timeout=120) as client:
            got = [list(client.generate(p, max_tokens=10, temperature=0.0, ignore_eos=True).token_ids) for p in prompts]
            assert got == expected
            stats = _wait_idle(client)
            assert stats["pd_fallback_recomputes"] >= 1
            assert stats["pd_transfer_blocks_loaded"] == 0 and stats["pd_store_blocks_cached"] == 0
            assert stats["replica.1.kv_blocks_used"] == 0 and stats["pd_store_blocks_used"] == 0
            assert client.health()


def test_a_shared_store_that_dies_is_replaced_and_prompts_are_handed_over_through_the_new_one(
        ray_session, tiny_llama, offline):
    """SIGKILL of the KV store's process: requests still end with the offline tokens (the decode
    side recomputes what the dead store held), a new store takes its place, both replicas attach
    it, and the next prompt is handed over through it; every block comes back."""
    from tests.test_coordinator_restart import _gone, _store_segments, _wait_until

    config = EngineConfig(model=tiny_llama, **ENGINE)
    prompts = [_prompt(70, 51), _prompt(66, 52), _prompt(75, 53)]
    expected = offline_greedy(offline, prompts, 10)
    before = set(_store_segments())
    with running_coordinator(config, http=False, metrics_port=0, **PD) as (actor, target):
        with pagedserve.Client(target, timeout=120) as client:
            def generate(prompt):
                return list(client.generate(prompt, max_tokens=10, temperature=0.0, ignore_eos=True).token_ids)

            assert generate(prompts[0]) == expected[0]
            first = _wait_idle(client)
            assert first["pd_transfer_blocks_loaded"] > 0 and first["pd_store_restarts"] == 0
            (segment,) = set(_store_segments()) - before
            store_pid = _store_segments()[segment]
            os.kill(store_pid, signal.SIGKILL)
            _wait_until(lambda: _gone(store_pid), 20, "the store's process ends")

            assert generate(prompts[1]) == expected[1]  # served while the store is replaced
            _wait_until(lambda: client.stats()["pd_store_restarts"] == 1, 30, "a new store")
            loaded = _wait_idle(client)["pd_transfer_blocks_loaded"]
            # Both replicas attach the new store at their next step; the first request after
            # the restart may still find one of them without it (and recompute).
            for salt in range(60, 64):
                prompt = _prompt(70, salt)
                assert generate(prompt) == offline_greedy(offline, [prompt], 10)[0]
                stats = _wait_idle(client)
                if stats["pd_transfer_blocks_loaded"] > loaded:
                    break
            assert stats["pd_transfer_blocks_loaded"] > loaded, "no prompt went through the new store"
            assert generate(prompts[2]) == expected[2]
            stats = _wait_idle(client)
            _assert_all_free(stats)
            assert stats["pd_store_restarts"] == 1
            metrics = urllib.request.urlopen(
                f"http://127.0.0.1:{ray.get(actor.status.remote())['metrics_port']}/metrics").read().decode()
            assert re.search(r"^pagedserve_pd_store_restarts_total(\{[^}]*\})? 1\.0$", metrics, re.M)
    assert segment not in _store_segments()  # the dead store's segment was removed


@pytest.mark.parametrize("side, replica", [("prefill", 0), ("decode", 1)])
def test_a_hung_worker_on_either_side_is_replaced_and_requests_end_with_the_offline_tokens(
        ray_session, tiny_llama, offline, side, replica):
    """SIGSTOP of one side's worker process: that replica's step timeout catches the hang, a warm
    spare takes over, and requests sent meanwhile end with the offline tokens; every block on both
    replicas and in the store comes back."""
    import psutil

    config = EngineConfig(model=tiny_llama, step_timeout=3.0, **ENGINE)
    prompts = [_prompt(70, 71 + replica), _prompt(40, 73 + replica)]
    expected = offline_greedy(offline, prompts, 10)
    stopped = []
    with running_coordinator(config, http=False, **PD) as (actor, target):
        try:
            with pagedserve.Client(target, timeout=120) as client:
                (pid,) = ray.get(actor.worker_pids.remote(replica))
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
                got = [list(client.generate(p, max_tokens=10, temperature=0.0, ignore_eos=True).token_ids)
                       for p in prompts]
                assert got == expected
                stats = _wait_idle(client)
                assert stats["worker_restarts_hang"] == 1 and stats[f"replica.{replica}.worker_restarts"] == 1
                assert stats[f"replica.{1 - replica}.worker_restarts"] == 0
                assert ray.get(actor.worker_pids.remote(replica)) != [pid]
                _assert_all_free(stats)
                assert client.health()
        finally:
            for pid in stopped:  # never leave a stopped process behind, whatever happened
                if psutil.pid_exists(pid):
                    os.kill(pid, signal.SIGKILL)
