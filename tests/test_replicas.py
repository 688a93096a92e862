"""Engine replicas behind one front door (`data_parallel_size`), for real: one coordinator actor
serving gRPC and HTTP over two engines, each with its own worker actor and KV pool, in the test
session's Ray. Outputs equal the offline API's whichever replica serves them; prefix routing keeps
a shared prefix (and a conversation's history) on one replica; a replica's worker fault is
recovered inside it, and a replica that stops for good hands its requests to the other."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request

import pytest
import ray

import pagedserve
from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from tests.serving import offline_greedy, running_coordinator

# One CPU per worker: the module's long-lived server and a test's own one fit the session's 4.
ENGINE = dict(kv_cache_memory=1 << 22, max_num_seqs=64, worker_cpus=1)
BLOCK = 16


@pytest.fixture(scope="module")
def offline(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=1 << 22) as llm:
        yield llm


@pytest.fixture(scope="module")
def two_replicas(ray_session, tiny_llama):
    config = EngineConfig(model=tiny_llama, **ENGINE)
    with running_coordinator(config, data_parallel_size=2, metrics_port=0) as (actor, target):
        yield actor, target


def _routed(stats: dict) -> list[int]:
    return [int(stats[f"replica.{i}.routed"]) for i in range(int(stats["num_replicas"]))]


def _wait_idle(client: pagedserve.Client, seconds: float = 10.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        stats = client.stats()
        if (stats["kv_blocks_used"] == 0 and stats["num_running"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_concurrent_streams_over_two_replicas_give_the_offline_tokens(two_replicas, offline):
    actor, target = two_replicas
    prompts = [[(97 * i + 13 * j) % 4000 + 5 for j in range(10 + 7 * i)] for i in range(12)]
    expected = offline_greedy(offline, prompts, 12)

    async def run():
        async with pagedserve.AsyncClient(target, timeout=120) as client:
            return await asyncio.gather(*(client.generate(p, max_tokens=12, temperature=0.0, ignore_eos=True)
                                          for p in prompts))

    with pagedserve.Client(target, timeout=60) as client:
        before = _routed(client.stats())
        got = asyncio.run(run())
        assert [list(c.token_ids) for c in got] == expected
        stats = _wait_idle(client)
    routed = [a - b for a, b in zip(_routed(stats), before)]
    assert sum(routed) == len(prompts) and min(routed) > 0  # both replicas served
    assert stats["num_replicas"] == 2 and stats["replicas_serving"] == 2
    # the totals are the replicas' sums
    assert stats["kv_blocks_total"] == stats["replica.0.kv_blocks_total"] + stats["replica.1.kv_blocks_total"]
    assert stats["generation_tokens"] == stats["replica.0.generation_tokens"] + stats["replica.1.generation_tokens"]
    assert len(set(ray.get(actor.worker_pids.remote()))) == 2  # a worker per replica


def test_prefix_routing_keeps_a_shared_prefix_and_a_conversation_on_one_replica(two_replicas):
    _, target = two_replicas
    system_a = [300 + (i * 7) % 900 for i in range(6 * BLOCK)]
    system_b = [1300 + (i * 11) % 900 for i in range(6 * BLOCK)]
    with pagedserve.Client(target, timeout=60) as client:
        _wait_idle(client)
        homes = {}
        for turn in range(3):
            for name, system in (("a", system_a), ("b", system_b)):
                before = _routed(client.stats())
                client.generate(system + [7 + turn, 8, 9 + turn], max_tokens=2, temperature=0.0)
                after = _routed(client.stats())
                (replica,) = [i for i, (x, y) in enumerate(zip(before, after)) if y > x]
                homes.setdefault(name, set()).add(replica)
        assert len(homes["a"]) == 1 and len(homes["b"]) == 1  # each prefix stays where it is cached

        # A conversation: each turn's prompt is the last one plus its reply plus a new message.
        history = [2000 + (i * 13) % 700 for i in range(3 * BLOCK)]
        turns = set()
        for turn in range(3):
            before = _routed(client.stats())
            reply = client.generate(history, max_tokens=BLOCK, temperature=0.0, ignore_eos=True)
            after = _routed(client.stats())
            turns.add([i for i, (x, y) in enumerate(zip(before, after)) if y > x][0])
            history = history + list(reply.token_ids) + [40 + turn, 41, 42]
        assert len(turns) == 1
        stats = _wait_idle(client)
        assert stats["prefix_cache_hits"] > 0


def test_reset_prefix_cache_reaches_every_replica(two_replicas):
    import urllib.request

    actor, target = two_replicas
    url = f"http://127.0.0.1:{ray.get(actor.status.remote())['http_port']}/reset_prefix_cache"
    prompts = [[300 + (i * 7 + k) % 900 for i in range(4 * BLOCK)] for k in range(4)]
    with pagedserve.Client(target, timeout=60) as client:
        start = _wait_idle(client)
        for _ in range(2):  # the second pass hits each prompt's cached blocks, wherever they went
            for prompt in prompts:
                client.generate(prompt, max_tokens=1, temperature=0.0)
        cached = _wait_idle(client)
        assert cached["prefix_cache_hits"] >= start["prefix_cache_hits"] + len(prompts) * 3 * BLOCK
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=30) as reply:
            assert reply.status == 200
        for prompt in prompts:
            client.generate(prompt, max_tokens=1, temperature=0.0)
        after = _wait_idle(client)
    assert after["prefix_cache_hits"] == cached["prefix_cache_hits"]  # every prompt computed cold again


def _http(actor, path: str, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON reply) of the cluster's HTTP door: POST `body`, or GET without one."""
    import json
    import urllib.error
    import urllib.request

    url = f"http://127.0.0.1:{ray.get(actor.status.remote())['http_port']}{path}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_request_of_several_prompts_is_checked_whole_through_the_router(two_replicas):
    """The HTTP door checks every prompt on a replica before the router queues any: one refused
    prompt refuses the request, and nothing of it runs on either replica."""
    actor, target = two_replicas
    model = _http(actor, "/v1/models")[1]["data"][0]["id"]
    with pagedserve.Client(target, timeout=60) as client:
        before = _wait_idle(client)
        status, body = _http(actor, "/v1/completions", {"model": model, "prompt": [[300] * 20, [10**9]],
                                                         "max_tokens": 2, "temperature": 0})
        assert status == 400 and "(prompt 1 of 2)" in body["error"]["message"]
        assert _wait_idle(client)["prompt_tokens"] == before["prompt_tokens"]
        status, body = _http(actor, "/v1/completions", {"model": model, "prompt": [[300] * 20, [301] * 20],
                                                         "max_tokens": 2, "temperature": 0})
        assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]


def test_a_background_response_runs_through_the_router(two_replicas):
    """The Responses API's background mode asks the engine whether it accepts before it answers:
    the router answers for the cluster (it had no such method: AttributeError, a 500)."""
    actor, _ = two_replicas
    model = _http(actor, "/v1/models")[1]["data"][0]["id"]
    status, queued = _http(actor, "/v1/responses", {"model": model, "input": "Hello there", "max_output_tokens": 4,
                                                     "background": True, "store": True, "temperature": 0})
    assert status == 200 and queued["background"] is True
    deadline = time.monotonic() + 60
    while (reply := _http(actor, f"/v1/responses/{queued['id']}")[1])["status"] in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert reply["status"] in ("completed", "incomplete") and 1 <= reply["usage"]["output_tokens"] <= 4


def test_metrics_carry_a_replica_label(two_replicas):
    actor, _ = two_replicas
    port = ray.get(actor.status.remote())["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for replica in ("0", "1"):
        assert 'pagedserve_kv_blocks_capacity{model_name=' in text
        assert any(line.startswith("pagedserve_kv_blocks_capacity") and f'replica="{replica}"' in line
                   for line in text.splitlines())


def test_a_cancelled_stream_through_the_router_frees_its_blocks(two_replicas):
    _, target = two_replicas
    with pagedserve.Client(target, timeout=60) as client:
        stream = client.stream(list(range(50, 90)), max_tokens=200, temperature=0.0, ignore_eos=True)
        next(stream)
        stream.close()
        stats = _wait_idle(client)
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_sampling_features_and_deadlines_work_the_same_through_the_router(two_replicas, offline):
    _, target = two_replicas
    prompt = [(5 * j) % 2000 + 3 for j in range(30)]
    params = SamplingParams(n=2, seed=3, temperature=0.8, top_k=50, max_tokens=8, logprobs=2, ignore_eos=True)
    expected = offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs
    with pagedserve.Client(target, timeout=60) as client:
        got = client.generate_all(prompt, n=2, seed=3, temperature=0.8, top_k=50, max_tokens=8, logprobs=2,
                                  ignore_eos=True)
        assert [list(c.token_ids) for c in got] == [list(c.token_ids) for c in expected]
        assert all(len(c.logprobs) == 8 for c in got)
    with pagedserve.Client(target, timeout=0.5) as client:
        with pytest.raises(pagedserve.ServingError) as info:
            client.generate(prompt, max_tokens=900, temperature=0.0, ignore_eos=True)
        assert info.value.code.name == "DEADLINE_EXCEEDED"
    with pagedserve.Client(target, timeout=60) as client:
        stats = _wait_idle(client)
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded"])
def test_round_robin_and_least_loaded_spread_sequential_requests_evenly(ray_session, tiny_llama, policy):
    config = EngineConfig(model=tiny_llama, **ENGINE)
    shared = list(range(100, 100 + 4 * BLOCK))
    with running_coordinator(config, data_parallel_size=2, routing_policy=policy, http=False) as (_, target):
        with pagedserve.Client(target, timeout=60) as client:
            for i in range(6):  # one shared prefix: prefix routing would keep them all on one replica
                client.generate(shared + [i], max_tokens=2, temperature=0.0)
            assert _routed(client.stats()) == [3, 3]


def test_a_worker_fault_in_one_replica_is_recovered_inside_it(ray_session, tiny_llama, offline):
    """SIGKILL of replica 0's worker with streams on both replicas: every stream ends with the
    fault-free tokens, the restart is replica 0's, and the server stays up throughout."""
    prompts = [[(31 * i + 3 * j) % 3000 + 7 for j in range(20 + i)] for i in range(6)]
    expected = offline_greedy(offline, prompts, 40)
    config = EngineConfig(model=tiny_llama, **ENGINE)
    with running_coordinator(config, data_parallel_size=2, routing_policy="round-robin",
                             http=False) as (actor, target):
        victim = ray.get(actor.worker_pids.remote(0))
        spare_of_1 = ray.get(actor.worker_pids.remote(1))

        async def run():
            async with pagedserve.AsyncClient(target, timeout=120) as client:
                flowing = asyncio.Event()

                async def tokens(prompt):
                    out = []
                    async for chunk in client.stream(prompt, max_tokens=40, temperature=0.0, ignore_eos=True):
                        out += chunk.token_ids
                        flowing.set()
                    return out

                streams = [asyncio.create_task(tokens(p)) for p in prompts]
                # Killed once tokens flow, so the kill lands mid-generation however fast the
                # machine is (a fixed sleep let a fast run finish all 40 tokens first).
                await flowing.wait()
                os.kill(victim[0], signal.SIGKILL)
                return await asyncio.gather(*streams)

        got = asyncio.run(run())
        assert got == expected
        with pagedserve.Client(target, timeout=60) as client:
            stats = _wait_idle(client)
            assert client.health()
        assert stats["replica.0.worker_restarts"] == 1 and stats["replica.1.worker_restarts"] == 0
        assert ray.get(actor.worker_pids.remote(1)) == spare_of_1  # replica 1 untouched


def test_a_replica_that_stops_hands_its_requests_to_the_other_and_is_rebuilt(ray_session, tiny_llama, offline):
    """No restarts allowed: replica 0's engine stops when its worker is killed. Its streams move to
    replica 1 and continue from their tokens (the same greedy tokens, none lost or repeated), the
    server never fails, and replica 0 is rebuilt and routed to again."""
    prompts = [[(17 * i + 5 * j) % 3000 + 11 for j in range(24 + i)] for i in range(4)]
    max_tokens = 300  # long enough that replica 0's streams are mid-way when its worker dies
    expected = offline_greedy(offline, prompts, max_tokens)
    config = EngineConfig(model=tiny_llama, max_worker_restarts=0, **ENGINE)
    with running_coordinator(config, data_parallel_size=2, routing_policy="round-robin",
                             http=False) as (actor, target):
        victim = ray.get(actor.worker_pids.remote(0))

        async def run():
            started, all_started = set(), asyncio.Event()
            async with pagedserve.AsyncClient(target, timeout=120) as client:
                async def stream(i, prompt):
                    tokens = []
                    async for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0,
                                                     ignore_eos=True):
                        tokens += chunk.token_ids
                        started.add(i)
                        if len(started) == len(prompts):
                            all_started.set()
                    return tokens

                tasks = [asyncio.create_task(stream(i, p)) for i, p in enumerate(prompts)]
                # The kill lands once every stream has tokens, not after a fixed sleep (by which
                # time a fast machine had finished them all, and nothing failed over).
                await asyncio.wait_for(all_started.wait(), timeout=60)
                os.kill(victim[0], signal.SIGKILL)
                return await asyncio.gather(*tasks)

        assert asyncio.run(run()) == expected
        with pagedserve.Client(target, timeout=60) as client:
            assert client.health()
            stats = client.stats()
            assert stats["requests_failed_over"] >= 1
            deadline = time.monotonic() + 120
            while client.stats()["replicas_serving"] < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            stats = client.stats()
            assert stats["replicas_serving"] == 2 and stats["replica_restarts"] == 1
            assert ray.get(actor.worker_pids.remote(0)) != victim
            before = _routed(stats)
            for i in range(2):
                client.generate([9, 8, 7, i], max_tokens=2, temperature=0.0)
            assert [b - a for a, b in zip(before, _routed(client.stats()))] == [1, 1]


def test_the_queue_bound_holds_for_the_whole_cluster(ray_session, tiny_llama):
    """One sequence at a time per replica and a cluster-wide bound of 2 waiting: of 12 requests
    sent at once, those beyond what runs and waits are refused RESOURCE_EXHAUSTED, the rest finish,
    and nothing is left behind."""
    config = EngineConfig(model=tiny_llama, kv_cache_memory=1 << 22, max_num_seqs=1, worker_cpus=1)
    with running_coordinator(config, data_parallel_size=2, max_queued_requests=2, http=False) as (_, target):
        async def run():
            async with pagedserve.AsyncClient(target, timeout=120) as client:
                async def one(i):
                    try:
                        out = await client.generate([5, 6, 7, i], max_tokens=60, temperature=0.0, ignore_eos=True)
                        return len(out.token_ids)
                    except pagedserve.ServingError as e:
                        return e.code.name
                return await asyncio.gather(*(one(i) for i in range(12)))

        results = asyncio.run(run())
        refused = [r for r in results if r == "RESOURCE_EXHAUSTED"]
        assert refused and all(r == 60 for r in results if r not in refused), results
        assert len(results) - len(refused) >= 2  # at least what the two replicas run at once
        with pagedserve.Client(target, timeout=60) as client:
            stats = _wait_idle(client)
            assert stats["kv_blocks_used"] == 0 and stats["requests_rejected_queue_full"] == len(refused)
