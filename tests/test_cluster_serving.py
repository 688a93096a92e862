"""The whole cluster end to end: the coordinator actor serving gRPC, two tensor-parallel worker
actors over gloo, clients over a real socket. Tokens must equal the offline API's (TP=1)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import grpc
import pytest
import ray

import pagedserve
from coordinator.actor import CoordinatorActor, config_dict
from coordinator.server_options import ServerOptions
from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from tests.serving import running_coordinator
from workers import fault_hook

ENGINE = dict(kv_cache_memory=1 << 22, max_num_seqs=64)


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama):
    config = EngineConfig(model=tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    with running_coordinator(config) as (_, target):
        yield target


@pytest.fixture(scope="module")
def offline(tiny_llama):
    with LLM(tiny_llama, **ENGINE) as llm:
        yield llm


def _wait_for_no_used_blocks(client: pagedserve.Client, seconds: float = 10.0) -> float:
    deadline = time.monotonic() + seconds
    while client.stats()["kv_blocks_used"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return client.stats()["kv_blocks_used"]


def test_32_concurrent_streams_give_the_offline_tokens(cluster, offline):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(2, 70))] for _ in range(32)]
    lengths = [rng.randint(1, 20) for _ in prompts]
    expected = [o.outputs[0].token_ids for o in offline.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False)]

    async def one(client, prompt, n):
        tokens, chunks = [], 0
        async for chunk in client.stream(prompt, max_tokens=n, temperature=0.0, ignore_eos=True):
            tokens += chunk.token_ids
            chunks += 1
        return tokens, chunks

    async def all_streams():
        client = pagedserve.AsyncClient(cluster, timeout=120)
        try:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))
        finally:
            await client.close()

    results = asyncio.run(all_streams())
    assert [tokens for tokens, _ in results] == expected
    assert all(chunks >= 1 for _, chunks in results)
    assert sum(chunks for _, chunks in results) > len(prompts)  # tokens streamed, not sent at the end
    with pagedserve.Client(cluster, timeout=30) as client:
        assert _wait_for_no_used_blocks(client) == 0


def test_stop_string_spanning_tokens_is_never_streamed(cluster, offline):
    prompt = [101, 202, 303, 404, 505]
    full = offline.generate({"prompt_token_ids": prompt},
                            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    tokenizer = offline.get_tokenizer()
    # A stop string made of the end of one token and the start of the next.
    boundary = len(tokenizer.decode(full.token_ids[:6], skip_special_tokens=True))
    stop = full.text[boundary - 2:boundary + 2]
    assert len(stop) == 4
    expected_text = full.text[:full.text.find(stop)]
    with pagedserve.Client(cluster, timeout=60) as client:
        pieces = [c.text for c in client.stream(prompt, max_tokens=24, temperature=0.0, stop=[stop])]
        done = client.generate(prompt, max_tokens=24, temperature=0.0, stop=[stop])
    assert "".join(pieces) == expected_text == done.text
    assert done.finish_reason == "stop"


def test_cancelled_stream_frees_its_blocks_in_the_workers_pool(cluster):
    with pagedserve.Client(cluster, timeout=60) as client:
        stream = client.stream(list(range(100, 300)), max_tokens=500, ignore_eos=True)
        next(stream)  # running now
        assert client.stats()["kv_blocks_used"] > 0
        stream.close()  # the client goes away mid-stream
        assert _wait_for_no_used_blocks(client) == 0
        after = client.generate([7, 8, 9], max_tokens=3, temperature=0.0)
        assert len(after.token_ids) == 3


def test_a_killed_worker_is_replaced_and_its_streams_carry_on(ray_session, tiny_llama, offline):
    """Rank 1 of two SIGKILLed mid-stream: the stream goes on with the fault-free tokens (none lost
    or repeated), health is SERVING again, and the restart is counted. 400 tokens: with 60, a fast
    run had streamed them all before the kill landed, and no step saw the fault."""
    prompt = list(range(100, 200))
    expected = offline.generate({"prompt_token_ids": prompt},
                                SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids
    config = EngineConfig(model=tiny_llama, tensor_parallel_size=2, **ENGINE)
    with running_coordinator(config) as (actor, target):
        pids = ray.get(actor.worker_pids.remote())
        assert len(pids) == 2
        with pagedserve.Client(target, timeout=120) as client:
            stream = client.stream(prompt, max_tokens=400, temperature=0.0, ignore_eos=True)
            tokens = list(next(stream).token_ids)
            os.kill(pids[1], signal.SIGKILL)  # rank 1 dies mid-stream
            for chunk in stream:
                tokens += chunk.token_ids
            assert tokens == list(expected)
            assert client.health()
            stats = client.stats()
            assert stats["worker_restarts_death"] == 1 and stats["requests_resumed"] == 1
            assert set(ray.get(actor.worker_pids.remote())).isdisjoint(pids)
            assert len(client.generate([7, 8, 9], max_tokens=3, temperature=0.0).token_ids) == 3


def test_past_its_restart_budget_a_killed_worker_fails_the_server_cleanly(ray_session, tiny_llama):
    config = EngineConfig(model=tiny_llama, tensor_parallel_size=2, max_worker_restarts=0, **ENGINE)
    actor = CoordinatorActor.remote()
    try:
        port = ray.get(actor.start.remote(config_dict(config), ServerOptions(port=0)), timeout=180)
        pids = ray.get(actor.worker_pids.remote())
        with pagedserve.Client(f"127.0.0.1:{port}", timeout=60) as client:
            assert client.health()
            stream = client.stream(list(range(100, 200)), max_tokens=800, ignore_eos=True)
            next(stream)
            os.kill(pids[1], signal.SIGKILL)
            with pytest.raises(pagedserve.ServingError) as err:
                for _ in stream:
                    pass
            assert err.value.code == grpc.StatusCode.UNAVAILABLE  # a fail-stop, not a bug
            deadline = time.monotonic() + 30
            while client.health() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not client.health()
            with pytest.raises(pagedserve.ServingError) as err:
                client.generate([1, 2, 3], max_tokens=2)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        ray.get(actor.shutdown.remote(), timeout=60)
        ray.kill(actor)


def test_a_poison_request_ends_with_internal_naming_it_while_another_stream_carries_on(
        ray_session, tiny_llama, offline):
    """Workers armed to crash on a token (tests only): the request holding it gets INTERNAL with
    its id (two faulted steps beside the stream, a third alone); a stream in flight beside it ends
    with the fault-free tokens."""
    prompt = list(range(100, 140))
    expected = offline.generate({"prompt_token_ids": prompt},
                                SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids
    token = next(t for t in range(1000, 2000) if t not in expected and t not in prompt)
    config = EngineConfig(model=tiny_llama, **ENGINE)
    with running_coordinator(config, env={fault_hook.CRASH_ON_TOKEN_ENV: str(token)}) as (_, target):
        with pagedserve.Client(target, timeout=120) as client:
            stream = client.stream(prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
            tokens = list(next(stream).token_ids)
            with pytest.raises(pagedserve.ServingError) as err:
                client.generate([5, token, 6], max_tokens=3, request_id="the-poison")
            assert err.value.code == grpc.StatusCode.INTERNAL and "'the-poison'" in str(err.value)
            for chunk in stream:
                tokens += chunk.token_ids
            assert tokens == list(expected)
            stats = client.stats()
            assert stats["requests_finished_poison"] == 1 and stats["worker_restarts_death"] in (2, 3)
            assert _wait_for_no_used_blocks(client) == 0
