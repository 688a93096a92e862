"""gRPC end to end over a real socket: the server in a background event loop, sync clients."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from coordinator.async_engine import AsyncEngine
from coordinator.grpc_server import GRPC_CODES, start_server
from coordinator.server_state import KINDS
from pagedserve import LLM, SamplingParams
from pagedserve.v1 import serving_pb2 as pb
from pagedserve.v1 import serving_pb2_grpc


class _Server:
    def __init__(self, llm: LLM, max_queued_requests: int = 1024, request_timeout: float | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def boot():
            self.engine = AsyncEngine(llm.engine, max_queued_requests)
            self.engine.start()
            self.server, self.port = await start_server(self.engine, port=0, request_timeout=request_timeout)

        asyncio.run_coroutine_threadsafe(boot(), self.loop).result(timeout=30)

    def close(self):
        async def down():
            await self.server.stop(grace=None)
            await self.engine.stop()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, kv_cache_memory=1 << 24)


@pytest.fixture(scope="module")
def server(llm):
    s = _Server(llm)
    yield s
    s.close()


@pytest.fixture()
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield serving_pb2_grpc.ServingStub(channel)


def _collect(stub, request, timeout=60):
    tokens, text, last = [], "", None
    for resp in stub.Generate(request, timeout=timeout):
        tokens += resp.token_ids
        text += resp.text
        last = resp
    return tokens, text, last


def _used_blocks(stub) -> float:
    return stub.GetStats(pb.GetStatsRequest()).stats["kv_blocks_used"]


def _wait_for_no_used_blocks(stub, seconds=10.0):
    deadline = time.monotonic() + seconds
    while _used_blocks(stub) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return _used_blocks(stub)


def test_concurrent_streams_equal_the_offline_api(llm, stub):
    prompts = [[(31 * i + j) % 40000 + 100 for j in range(5 + 3 * i)] for i in range(12)]
    offline = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)]
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda p: _collect(stub, pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=p), sampling=sampling)), prompts))
    assert [tokens for tokens, _, _ in results] == offline
    for tokens, text, last in results:
        assert last.finish_reason == "length" and last.usage.completion_tokens == 10
        assert last.timing.total_s >= last.timing.time_to_first_token_s > 0
    assert _wait_for_no_used_blocks(stub) == 0


def test_final_only_sends_each_sample_once_with_all_of_it_and_the_stream_adds_up_to_the_same(stub):
    sampling = pb.SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=9, ignore_eos=True, logprobs=1)
    streamed, final = ([list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[4, 5, 6, 7]),
                                                              sampling=sampling, final_only=final_only),
                                           timeout=60)) for final_only in (False, True)])
    assert len(streamed) > 2 and [r.index for r in final] == [0, 1]
    for resp in final:
        same = [r for r in streamed if r.index == resp.index]
        assert list(resp.token_ids) == [t for r in same for t in r.token_ids] and len(resp.token_ids) == 9
        assert resp.text == "".join(r.text for r in same)
        assert len(resp.logprobs) == 9 and resp.finish_reason == "length"
    assert final[-1].usage.completion_tokens == 18 and final[-1].timing.total_s > 0


def test_a_stream_interval_sends_concurrent_streams_tokens_in_groups_and_each_adds_up(llm, tiny_llama):
    """A server started with stream_interval 3 sends each stream's first token alone, then three
    at a time (each with their logprobs), the rest with the end; every stream's tokens and text
    are the offline API's."""
    prompts = [[(17 * i + j) % 40000 + 100 for j in range(4 + 2 * i)] for i in range(6)]
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    server = _Server(LLM(tiny_llama, kv_cache_memory=1 << 24, stream_interval=3))
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = serving_pb2_grpc.ServingStub(channel)
            with ThreadPoolExecutor(len(prompts)) as pool:
                streams = list(pool.map(lambda p: list(stub.Generate(pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=p), sampling=sampling), timeout=60)), prompts))
            assert _wait_for_no_used_blocks(stub) == 0
    finally:
        server.close()
    for responses, want in zip(streams, offline):
        assert [len(r.token_ids) for r in responses] == [1, 3, 3, 3, 2]
        assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
        assert [t for r in responses for t in r.token_ids] == want.outputs[0].token_ids
        assert "".join(r.text for r in responses) == want.outputs[0].text
        assert responses[-1].finish_reason == "length" and responses[-1].usage.completion_tokens == 12


def test_text_and_chat_prompts_stream_text(llm, stub):
    tokens, text, last = _collect(stub, pb.GenerateRequest(
        text="Hello there", sampling=pb.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
    assert len(tokens) == 6 and text == llm.get_tokenizer().decode(tokens, skip_special_tokens=True)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi!")])
    tokens, _, last = _collect(stub, pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_tokens=4)))
    assert last.usage.prompt_tokens > 5  # the chat template wraps the message


@pytest.mark.parametrize("request_kwargs,words", [
    ({}, "prompt: set one of text, chat or token_ids"),
    ({"text": ""}, "prompt must not be empty"),
    ({"token_ids": pb.TokenIds(ids=[10 ** 6])}, "prompt_token_ids must lie in"),
    ({"text": "x", "sampling": pb.SamplingParams(temperature=-1)}, "temperature must be >= 0"),
    ({"text": "x", "sampling": pb.SamplingParams(top_p=2)}, "top_p must be in (0, 1]"),
    ({"text": "x", "sampling": pb.SamplingParams(max_tokens=0)}, "max_tokens must be an integer >= 1"),
    ({"token_ids": pb.TokenIds(ids=[5] * 5000)}, "max_model_len"),
    ({"text": "x", "sampling": pb.SamplingParams(logprobs=21)}, "logprobs must be <= 20"),
    ({"text": "x", "sampling": pb.SamplingParams(n=3, best_of=2)}, "best_of (2) must be >= n (3)"),
    ({"text": "x", "sampling": pb.SamplingParams(logit_bias={10 ** 6: 1.0})}, "logit_bias must lie in [0, 49152)"),
    ({"text": "x", "sampling": pb.SamplingParams(presence_penalty=3)}, "presence_penalty must be in [-2, 2]"),
])
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(stub, request_kwargs, words):
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub, pb.GenerateRequest(**request_kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()
    tokens, _, _ = _collect(stub, pb.GenerateRequest(text="still fine", sampling=pb.SamplingParams(max_tokens=2)))
    assert len(tokens) >= 1
    assert _wait_for_no_used_blocks(stub) == 0


def test_cancelled_stream_and_expired_deadline_free_their_blocks(stub):
    long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(100, 400))),
                              sampling=pb.SamplingParams(max_tokens=600, ignore_eos=True))
    call = stub.Generate(long)
    next(call)  # running now
    assert _used_blocks(stub) > 0
    call.cancel()
    assert _wait_for_no_used_blocks(stub) == 0
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub, long, timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait_for_no_used_blocks(stub) == 0


def test_the_servers_default_deadline_ends_a_request_that_brings_none(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=1 << 22) as own:  # its own engine: one server per engine
        timed = _Server(own, request_timeout=0.5)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{timed.port}") as channel:
                stub = serving_pb2_grpc.ServingStub(channel)
                long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(100, 400))),
                                          sampling=pb.SamplingParams(max_tokens=600, ignore_eos=True))
                with pytest.raises(grpc.RpcError) as err:
                    _collect(stub, long, timeout=None)  # no deadline of its own
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline" in err.value.details()
                assert _wait_for_no_used_blocks(stub) == 0
                assert stub.GetStats(pb.GetStatsRequest()).stats["requests_finished_deadline"] == 1
                short = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                           sampling=pb.SamplingParams(max_tokens=2))
                assert len(_collect(stub, short, timeout=None)[0]) == 2  # within the deadline: served
        finally:
            timed.close()


def test_health_is_serving_and_stats_have_the_engine_fields(server, stub):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pagedserve.v1.Serving")).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    stats = stub.GetStats(pb.GetStatsRequest()).stats
    assert {"kv_blocks_total", "kv_usage", "prefix_cache_hits", "num_waiting", "num_queued"} <= set(stats)
    assert {"swap_out_blocks", "swap_in_blocks", "swap_out_bytes", "swap_in_bytes", "cpu_blocks_total",
            "cpu_blocks_used", "cpu_blocks_cached", "cpu_prefix_cache_hits", "kv_store_restarts"} <= set(stats)


def test_every_status_kind_has_one_grpc_code():
    assert set(GRPC_CODES) == set(KINDS)
    assert GRPC_CODES["queue_full"] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_full_queue_is_resource_exhausted(llm):
    s = _Server(llm, max_queued_requests=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{s.port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                _collect(serving_pb2_grpc.ServingStub(channel), pb.GenerateRequest(text="x"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        s.close()


def test_client_sdk_generate_stream_stats_health_and_errors(llm, server):
    import pagedserve

    with pagedserve.Client(f"127.0.0.1:{server.port}") as client:
        done = client.generate([5, 6, 7], max_tokens=5, temperature=0.0, ignore_eos=True)
        offline = llm.generate({"prompt_token_ids": [5, 6, 7]},
                               SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
        assert done.token_ids == offline.token_ids and done.text == offline.text
        assert done.finish_reason == "length" and done.usage["completion_tokens"] == 5
        chunks = list(client.stream("Hello", max_tokens=4, temperature=0.0, ignore_eos=True))
        assert sum(len(c.token_ids) for c in chunks) == 4
        assert client.stats()["kv_blocks_total"] > 0 and client.health()
        with pytest.raises(pagedserve.ServingError) as err:
            client.generate("x", top_p=5.0)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details

    async def use_async():
        async with pagedserve.AsyncClient(f"127.0.0.1:{server.port}") as client:
            done = await client.generate([5, 6, 7], max_tokens=5, temperature=0.0, ignore_eos=True)
        assert client._channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN  # closed on the way out
        return done

    assert asyncio.run(use_async()).token_ids == offline.token_ids


def test_cli_generate_and_stats_talk_to_a_running_server(llm, server, capsys):
    from pagedserve import cli

    target = f"127.0.0.1:{server.port}"
    assert cli.main(["generate", "Hello", "--target", target, "--max-tokens", "4", "--temperature", "0"]) == 0
    plain = capsys.readouterr().out
    assert cli.main(["generate", "Hello", "--target", target, "--max-tokens", "4", "--temperature", "0",
                     "--stream"]) == 0
    assert capsys.readouterr().out == plain  # greedy: the same text, streamed
    assert cli.main(["stats", "--target", target]) == 0
    assert "kv_blocks_total" in capsys.readouterr().out
    assert cli.main(["generate", "x", "--target", target, "--max-tokens", "0"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert cli.main(["generate", "Hello", "--target", target, "--max-tokens", "3", "--n", "2", "--seed", "3",
                     "--temperature", "1", "--logprobs", "2", "--presence-penalty", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "--- sample 0 ---" in out and "--- sample 1 ---" in out
    assert out.count("(rank ") == 6 and out.count("top: ") == 6
    assert cli.main(["generate", "Hello", "--target", target, "--max-tokens", "4", "--beam-search",
                     "--beam-width", "3", "--n", "2"]) == 0
    assert capsys.readouterr().out.count("--- sample") == 2


def test_parallel_samples_logprobs_and_penalties_over_grpc_equal_the_offline_api(llm, server):
    import pagedserve

    sampling = dict(n=3, temperature=0.9, seed=4, max_tokens=6, ignore_eos=True, logprobs=2,
                    presence_penalty=0.5, repetition_penalty=1.2, logit_bias={100: 2.0})
    offline = llm.generate({"prompt_token_ids": [9, 8, 7, 6]}, SamplingParams(**sampling), use_tqdm=False)[0]
    with pagedserve.Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        served = client.generate_all([9, 8, 7, 6], **sampling)
        chunks = list(client.stream([9, 8, 7, 6], **sampling))
    assert [c.index for c in served] == [0, 1, 2]
    assert [c.token_ids for c in served] == [o.token_ids for o in offline.outputs]
    assert {c.index for c in chunks} == {0, 1, 2}
    for got, want in zip(served, offline.outputs):
        assert got.finish_reason == "length" and got.usage["completion_tokens"] == 18
        assert len(got.logprobs) == 6
        for step, token, expected in zip(got.logprobs, got.token_ids, want.logprobs):
            assert step["token_id"] == token
            assert abs(step["logprob"] - expected[token].logprob) < 1e-5
            assert [t["token_id"] for t in step["top"]] == sorted(
                (t for t in expected if expected[t].rank <= 2), key=lambda t: expected[t].rank)
        assert abs(got.cumulative_logprob - want.cumulative_logprob) < 1e-4


def test_prompt_logprobs_over_grpc_equal_the_offline_api(llm, server):
    import pagedserve

    prompt = [21, 22, 23, 24, 25, 26]
    offline = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=2),
                           use_tqdm=False)[0].prompt_logprobs
    with pagedserve.Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        served = client.generate(prompt, max_tokens=2, prompt_logprobs=2).prompt_logprobs
    assert [p["token_id"] for p in served] == prompt[1:]
    for got, want, token in zip(served, offline[1:], prompt[1:]):
        assert abs(got["logprob"] - want[token].logprob) < 1e-5 and got["rank"] == want[token].rank
        assert len(got["top"]) == 2


def test_beam_search_over_grpc_equals_the_offline_api(llm, server):
    import pagedserve

    offline = llm.generate({"prompt_token_ids": [3, 1, 4, 1, 5]},
                           SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=8,
                                          early_stopping="never"), use_tqdm=False)[0]
    with pagedserve.Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        served = client.generate_all([3, 1, 4, 1, 5], use_beam_search=True, beam_width=3, n=2, max_tokens=8,
                                     early_stopping="never")
        with pytest.raises(pagedserve.ServingError) as err:
            client.generate("x", use_beam_search=True, early_stopping="maybe")
    assert [c.token_ids for c in served] == [o.token_ids for o in offline.outputs]
    assert served[0].usage["completion_tokens"] == 16
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "early_stopping" in err.value.details
