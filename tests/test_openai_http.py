"""The OpenAI-compatible HTTP API of a live coordinator actor, driven by the official `openai`
client: greedy outputs equal transformers', streaming with usage, n > 1, logprobs, seeds, every
error class as the SDK's exception, a full queue, a client that leaves mid-stream, and the open
endpoints. One server for the module (the coordinator actor, TP=1), beside its gRPC door."""

from __future__ import annotations

import asyncio
import json
import math
import ssl
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import openai
import pytest
import ray

from coordinator.http_server import HttpServer
from coordinator.openai_errors import HTTP_ERRORS
from coordinator.server_state import KINDS, ServerState
from pagedserve.config import EngineConfig
from tests.certs import self_signed_cert
from tests.reference import hf_greedy
from tests.serving import running_coordinator

API_KEY = "test-key"
ALLOWED_ORIGIN = "https://app.example"
MAX_QUEUED = 3
MAX_NUM_SEQS = 4
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(ray_session, tiny_llama):
    # "uni": the model inside the coordinator's process; a worker actor would add seconds of start-up.
    config = EngineConfig(model=tiny_llama, kv_cache_memory=1 << 22, max_num_seqs=MAX_NUM_SEQS,
                          distributed_executor_backend="uni")
    with running_coordinator(config, api_key=API_KEY, max_queued_requests=MAX_QUEUED,
                             allowed_origins=(ALLOWED_ORIGIN,)) as (actor, _):
        port = ray.get(actor.status.remote())["http_port"]
        yield SimpleNamespace(actor=actor, url=f"http://127.0.0.1:{port}", model=tiny_llama)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _request(url: str, body: dict | None = None, key: str | None = API_KEY, *, raw: bytes | None = None,
             content_type: str = "application/json", method: str | None = None) -> tuple[int, bytes]:
    """`body` as JSON, or `raw` bytes as they are (with `content_type`)."""
    headers = {"Content-Type": content_type}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _stats(server) -> dict:
    return ray.get(server.actor.stats.remote(), timeout=30)


def _wait_for(server, done, seconds: float = 10.0) -> dict:
    deadline = time.monotonic() + seconds
    while not done(stats := _stats(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats


def test_greedy_completions_and_chat_equal_transformers_tokens(client, server, hf_model, bundled_tokenizer):
    prompts = [[101, 202, 303, 404, 505], [7, 8, 9]]
    r = client.completions.create(model=server.model, prompt=prompts, max_tokens=8, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    for prompt, choice in zip(prompts, r.choices):
        assert choice.text == bundled_tokenizer.decode(hf_greedy(hf_model, prompt, 8), skip_special_tokens=True)
        assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (8, 16, 24)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.system_fingerprint and r.created > 0

    messages = [{"role": "user", "content": "What is paged attention?"}]
    prompt_ids = bundled_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                       return_dict=False)
    chat = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=8, **GREEDY)
    expected = bundled_tokenizer.decode(hf_greedy(hf_model, list(prompt_ids), 8), skip_special_tokens=True)
    assert chat.choices[0].message.content == expected and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(prompt_ids) and chat.usage.completion_tokens == 8
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"


def test_stream_ends_with_the_usage_chunk_then_done(client, server):
    kwargs = dict(model=server.model, prompt="The capital of France is", max_tokens=12, **GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert sum(1 for c in chunks if c.choices) > 1  # streamed as tokens came, not sent at the end
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])

    status, body = _request(server.url + "/v1/chat/completions", {
        "model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "n": 2,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    events = [line.removeprefix("data: ") for line in body.decode().split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    first = chunks[0]["choices"]
    assert [c["index"] for c in first] == [0, 1] and first[0]["delta"]["role"] == "assistant"
    finished = [c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert sorted(finished) == [0, 1]

    # vLLM's continuous_usage_stats: every chunk carries the usage so far
    streamed = list(client.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kwargs))
    counts = [c.usage.completion_tokens for c in streamed]
    assert counts == sorted(counts) and counts[-1] == 12 and len(set(counts)) > 2
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in streamed)


def test_n_samples_of_each_prompt_are_numbered_in_order(client, server):
    prompts = ["Once upon a time", "In a galaxy far away"]
    singles = [client.completions.create(model=server.model, prompt=p, max_tokens=6, **GREEDY).choices[0].text
               for p in prompts]
    r = client.completions.create(model=server.model, prompt=prompts, n=2, max_tokens=6, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert r.usage.completion_tokens == 24
    sampled = client.completions.create(model=server.model, prompt=prompts[0], n=3, max_tokens=8, temperature=1.0,
                                        seed=7)
    assert [c.index for c in sampled.choices] == [0, 1, 2] and len({c.text for c in sampled.choices}) > 1


def test_logprobs_in_each_endpoints_format(client, server, bundled_tokenizer):
    prompt = [5, 6, 7, 8]
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=4, logprobs=3, echo=True, **GREEDY)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text.startswith(bundled_tokenizer.decode(prompt))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert lp.text_offset == sorted(lp.text_offset)
    for value, top in zip(lp.token_logprobs[len(prompt):], lp.top_logprobs[len(prompt):]):
        assert value <= 0 and math.isclose(value, max(top.values()), abs_tol=1e-5)  # greedy: the top token

    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob)
        assert entry.top_logprobs[1].logprob <= entry.logprob
        assert bytes(entry.bytes).decode() == entry.token
    # tokens that are pieces of a character (😀 is 3 tokens here) report their own bytes, not U+FFFD's
    emoji = bundled_tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji) == 3
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Go on"}],
                                          max_tokens=12, logprobs=True,
                                          extra_body={"allowed_token_ids": emoji, "ignore_eos": True}, temperature=0)
    pieces = {bytes(piece) for piece in (b"\xf0\x9f", b"\x98", b"\x80")}  # 😀's UTF-8, as its tokens split it
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 12 and {bytes(entry.bytes) for entry in entries} <= pieces
    raw = bytes(b for entry in entries for b in entry.bytes)  # the text holds back a last, unfinished character
    assert chat.choices[0].message.content and raw.decode(errors="replace").startswith(chat.choices[0].message.content)


def test_a_seed_makes_sampling_reproducible(client, server):
    kwargs = dict(model=server.model, prompt="Tell me a story", max_tokens=12, temperature=1.0,
                  extra_body={"ignore_eos": True})
    first, again = (client.completions.create(seed=1234, **kwargs).choices[0].text for _ in range(2))
    other = client.completions.create(seed=4321, **kwargs).choices[0].text
    assert first == again and other != first


def test_each_error_class_is_openais_envelope_and_the_sdks_exception(client, server):
    def refused(exception, **kwargs):
        with pytest.raises(exception) as info:
            client.completions.create(**{"model": server.model, "prompt": "hi", "max_tokens": 4, **kwargs})
        return info.value.body

    body = refused(openai.BadRequestError, temperature=-1)
    assert body["param"] == "temperature" and ">= 0" in body["message"] and body["type"] == "invalid_request_error"
    assert refused(openai.BadRequestError, top_p=1.5)["message"] == "top_p must be in (0, 1]; got 1.5"
    assert "max_model_len (1024)" in refused(openai.BadRequestError, prompt=[11] * 1100)["message"]
    assert refused(openai.BadRequestError, suffix="!")["param"] == "suffix"  # would change the output
    assert refused(openai.BadRequestError, extra_body={"frobnicate": 1})["param"] == "frobnicate"
    moved = refused(openai.BadRequestError, extra_body={"guided_choice": ["yes", "no"]})  # vLLM's name before 0.12
    assert moved["param"] == "guided_choice" and 'send structured_outputs: {"choice": ...}' in moved["message"]
    assert refused(openai.BadRequestError, max_tokens="many")["param"] == "max_tokens"
    refused(openai.BadRequestError, prompt=["a", "b", "c", "d"])  # more prompts than the queue holds
    assert refused(openai.NotFoundError, model="gpt-4")["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:  # legacy function calling: not implemented
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                       functions=[{"name": "f"}])
    assert info.value.body["param"] == "functions"
    with pytest.raises(openai.BadRequestError) as info:  # "auto", tools' default, needs a parser this server lacks
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert info.value.body["param"] == "tool_choice" and "--tool-call-parser" in info.value.body["message"]
    client.completions.create(model=server.model, prompt="hi", max_tokens=2, user="u-1")  # harmless: accepted

    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model=server.model, prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "invalid_api_key"
    status, body = _request(server.url + "/v1/models", key=None)
    assert status == 401 and "Authorization: Bearer" in json.loads(body)["error"]["message"]
    assert _stats(server)["requests_rejected_unauthenticated"] >= 2


def test_a_body_that_is_absent_or_not_json_and_too_many_chat_samples_say_what_to_send(client, server):
    url = server.url + "/v1/completions"
    status, reply = _request(url, method="POST")
    error = json.loads(reply)["error"]
    assert status == 400 and error["message"] == "the request has no body: send a JSON object of the request's fields"
    body = json.dumps({"model": server.model, "prompt": "hi", "max_tokens": 2}).encode()
    status, reply = _request(url, raw=body, content_type="text/plain")
    error = json.loads(reply)["error"]
    assert status == 400 and "'text/plain'" in error["message"] and "Content-Type: application/json" in error["message"]
    assert _request(url, raw=body)[0] == 200  # the same body as JSON is served
    with pytest.raises(openai.BadRequestError) as info:  # chat has no best_of: the field it names is n
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}], n=100000,
                                       max_tokens=2)
    assert info.value.body["param"] == "n" and info.value.body["message"] == "n must be <= 64; got 100000"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="hi", max_tokens=2, n=2, extra_body={"best_of": 65})
    assert info.value.body["param"] == "best_of"


def test_a_max_tokens_the_context_cannot_hold_is_a_400_naming_the_field_and_the_room(client, server):
    """As vLLM's and OpenAI's servers answer: a prompt plus the max_tokens asked for must fit in
    max_model_len (1024 here). Left unset, the reply may run to max_model_len instead."""
    prompt = [11] * 1000
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt=prompt, max_tokens=25, **GREEDY)
    body = info.value.body
    assert body["param"] == "max_tokens"
    assert "25" in body["message"] and "1000" in body["message"] and "1024" in body["message"]
    assert "at most 24 new tokens" in body["message"]
    fits = client.completions.create(model=server.model, prompt=prompt, max_tokens=24, **GREEDY)
    assert fits.usage.completion_tokens == 24 and fits.choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=10**6)
    assert info.value.body["param"] == "max_completion_tokens" and "max_model_len is 1024" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=messages, max_tokens=1024)
    assert info.value.body["param"] == "max_tokens"
    # Unset: the reply runs until the context is full (or EOS), as before.
    chat = client.chat.completions.create(model=server.model, messages=messages, **GREEDY)
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 1024
    assert chat.choices[0].finish_reason == "length"
    stats = _wait_for(server, lambda s: s["num_running"] == 0)
    assert stats["kv_blocks_used"] == 0  # nothing was admitted for the refused ones


def test_a_request_with_one_bad_prompt_runs_none_of_them(client, server):
    """Every prompt of a request is checked before any is queued: the refusal names the prompt,
    and the good prompts beside it were never computed."""
    before = _wait_for(server, lambda s: s["num_running"] == 0)
    for prompts, param in (([[5] * 40, [999999]], "prompt"),  # a token id out of the vocabulary
                           (["a short one", "word " * 1100], "prompt"),  # longer than max_model_len
                           ([[5] * 40, [11] * 1000], "max_tokens")):  # leaves no room for max_tokens
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=server.model, prompt=prompts, max_tokens=30, **GREEDY)
        assert info.value.body["param"] == param and "(prompt 1 of 2)" in info.value.body["message"]
    after = _stats(server)
    assert after["prompt_tokens"] == before["prompt_tokens"]  # nothing was prefilled
    assert after["requests_finished_abort"] == before["requests_finished_abort"]
    assert after["kv_blocks_used"] == 0

    messages = [{"role": "user", "content": "word " * 1100}]  # a chat has no prompt field: its messages are at fault
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    assert info.value.body["param"] == "messages" and "max_model_len (1024)" in info.value.body["message"]


def test_a_full_queue_is_rate_limited(client, server):
    """Every sequence slot busy with one long request: MAX_QUEUED more wait, the next is refused."""
    busy = client.completions.create(model=server.model, prompt="busy", n=MAX_NUM_SEQS, max_tokens=900, stream=True,
                                     **GREEDY)
    try:
        next(iter(busy))  # running: all MAX_NUM_SEQS slots taken
        with ThreadPoolExecutor(MAX_QUEUED) as pool:
            waiting = [pool.submit(client.completions.create, model=server.model, prompt=f"wait {i}", max_tokens=2,
                                   stream=True) for i in range(MAX_QUEUED)]
            assert _wait_for(server, lambda s: s["num_queued"] >= MAX_QUEUED)["num_queued"] == MAX_QUEUED
            with pytest.raises(openai.RateLimitError) as info:
                client.completions.create(model=server.model, prompt="one too many", max_tokens=2)
            assert info.value.body["type"] == "rate_limit_error" and "queue is full" in info.value.body["message"]
            busy.close()  # frees the slots: the waiting ones run
            for future in waiting:
                assert [c.choices[0].finish_reason for c in future.result(timeout=60)][-1] == "length"
    finally:
        busy.close()
    assert _stats(server)["requests_rejected_queue_full"] >= 1


def test_a_client_leaving_mid_stream_aborts_its_request(client, server):
    before = _stats(server)["requests_finished_abort"]
    stream = client.completions.create(model=server.model, prompt="a long story", max_tokens=900, stream=True,
                                       **GREEDY)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert _stats(server)["num_requests_running"] == 1
    stream.close()
    stats = _wait_for(server, lambda s: s["num_requests_running"] == 0 and s["kv_blocks_used"] == 0)
    assert stats["num_requests_running"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["requests_finished_abort"] == before + 1

    impatient = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):  # not streamed: the server notices the hang-up all the same
        impatient.completions.create(model=server.model, prompt="a long story", max_tokens=1000, **GREEDY)
    stats = _wait_for(server, lambda s: s["requests_finished_abort"] == before + 2 and s["kv_blocks_used"] == 0)
    assert stats["requests_finished_abort"] == before + 2 and stats["kv_blocks_used"] == 0


def test_health_version_and_metrics_are_open(server):
    status, body = _request(server.url + "/health", key=None)
    assert status == 200
    assert _request(server.url + "/ping", key=None)[0] == 200  # vLLM's (SageMaker's) name, GET and POST
    assert _request(server.url + "/ping", {}, key=None)[0] == 200
    status, body = _request(server.url + "/version", key=None)
    assert status == 200 and json.loads(body)["version"]
    status, body = _request(server.url + "/metrics", key=None)
    text = body.decode()
    assert status == 200 and "pagedserve_requests_rejected_total{" in text and "pagedserve_num_requests{" in text


def test_browser_pages_of_an_allowed_origin_may_call_it_with_the_key(server):
    def call(method: str, origin: str, headers: dict) -> tuple[int, dict]:
        request = urllib.request.Request(server.url + "/v1/models", method=method,
                                         headers={"Origin": origin, **headers})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, dict(resp.headers)
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers)

    preflight = {"Access-Control-Request-Method": "GET", "Access-Control-Request-Headers": "authorization"}
    status, headers = call("OPTIONS", ALLOWED_ORIGIN, preflight)  # a browser sends no key with it
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    status, headers = call("GET", ALLOWED_ORIGIN, {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    status, headers = call("GET", ALLOWED_ORIGIN, {})
    assert status == 401  # CORS lets the page ask; the key still decides
    status, headers = call("OPTIONS", "https://elsewhere.example", preflight)
    assert status == 400 and "access-control-allow-origin" not in headers


def test_models_and_tokenize_detokenize_round_trip(client, server, bundled_tokenizer):
    assert [m.id for m in client.models.list().data] == [server.model]
    card = client.models.retrieve(server.model)  # the id is the model's path: slashes and all
    assert card.id == server.model and card.max_model_len == client.models.list().data[0].max_model_len
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["param"] == "model" and "no-such-model" in info.value.body["message"]
    text = "Paged attention, like virtual memory."
    status, body = _request(server.url + "/tokenize", {"model": server.model, "prompt": text})
    tokens = json.loads(body)
    assert status == 200 and tokens["tokens"] == bundled_tokenizer.encode(text)
    assert tokens["count"] == len(tokens["tokens"])
    status, body = _request(server.url + "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and json.loads(body)["prompt"] == text

    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    status, body = _request(server.url + "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                                       "continue_final_message": True})
    expected = bundled_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False,
                                                     continue_final_message=True, return_dict=False)
    assert status == 200 and json.loads(body)["tokens"] == list(expected)
    chat = client.chat.completions.create(model=server.model, messages=messages, max_tokens=3, temperature=0,
                                          extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert chat.usage.prompt_tokens == len(expected)
    # vLLM's truncate_prompt_tokens: the prompt's last k tokens only
    cut = client.completions.create(model=server.model, prompt=text, max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt=text, extra_body={"truncate_prompt_tokens": 0})
    assert info.value.body["param"] == "truncate_prompt_tokens"
    status, body = _request(server.url + "/detokenize", {"tokens": [10**9]})
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"


def test_reset_prefix_cache_makes_the_next_prompt_cold(client, server):
    prompt = "A prompt long enough to fill a few KV blocks of the prefix cache, " * 3
    hits = lambda: _stats(server)["prefix_cache_hits"]  # noqa: E731
    client.completions.create(model=server.model, prompt=prompt, max_tokens=1, **GREEDY)
    before = hits()
    client.completions.create(model=server.model, prompt=prompt, max_tokens=1, **GREEDY)
    assert hits() > before  # cached: the second prefill hit it
    assert _request(server.url + "/reset_prefix_cache", {}, key=None)[0] == 401  # guarded like the API
    assert _request(server.url + "/reset_prefix_cache", {})[0] == 200
    before = hits()
    client.completions.create(model=server.model, prompt=prompt, max_tokens=1, **GREEDY)
    assert hits() == before  # forgotten: computed cold

    # refused (409) while a request holds blocks, and nothing is forgotten then
    stream = client.completions.create(model=server.model, prompt=prompt, max_tokens=500, stream=True, **GREEDY)
    next(iter(stream))
    status, body = _request(server.url + "/reset_prefix_cache", {})
    assert status == 409 and "idle" in json.loads(body)["error"]["message"]
    stream.close()
    _wait_for(server, lambda s: s["kv_blocks_used"] == 0)
    before = hits()
    client.completions.create(model=server.model, prompt=prompt, max_tokens=1, **GREEDY)
    assert hits() > before

    _wait_for(server, lambda s: s["kv_blocks_used"] == 0)
    assert _stats(server)["kv_blocks_cached"] > 0
    assert _request(server.url + "/reset_prefix_cache", {})[0] == 200
    assert _stats(server)["kv_blocks_cached"] == 0  # shown at once, though an idle engine takes no step


def test_every_status_kind_has_an_http_status():
    assert set(KINDS) <= set(HTTP_ERRORS)  # one table, as GRPC_CODES is for gRPC


def test_a_server_still_loading_answers_503_and_tls_works():
    """No engine yet: /health and every request say 503 with the state's reason; with TLS, over
    https only; a taken port is an OSError."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)

    cert, key = self_signed_cert()
    http, https = HttpServer(ServerState(), "m"), HttpServer(ServerState(), "m", tls=(cert, key))
    port, tls_port = run(http.start("127.0.0.1", 0)), run(https.start("127.0.0.1", 0))
    try:
        status, body = _request(f"http://127.0.0.1:{port}/health", key=None)
        assert status == 503 and json.loads(body)["error"]["message"] == "the model is still loading"
        assert _request(f"http://127.0.0.1:{port}/ping", key=None)[0] == 503
        loading = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="any", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            loading.completions.create(model="m", prompt="hi")
        assert info.value.status_code == 503

        trusted = ssl.create_default_context(cadata=cert.decode())
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"https://localhost:{tls_port}/health", context=trusted, timeout=10)
        assert info.value.code == 503
        with pytest.raises(OSError, match="cannot bind"):
            run(HttpServer(ServerState(), "m").start("127.0.0.1", port))
    finally:
        run(http.stop())
        run(https.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_token_ids_come_back_when_asked_as_vllm_returns_them(client, server):
    ids = {"return_token_ids": True, "ignore_eos": True}
    whole = client.completions.create(model=server.model, prompt="Tell me a story", max_tokens=6, temperature=0,
                                      logprobs=2, extra_body={**ids, "return_tokens_as_token_ids": True})
    choice = whole.choices[0]
    assert len(choice.prompt_token_ids) == whole.usage.prompt_tokens and len(choice.token_ids) == 6
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs for key in top)
    stream = client.completions.create(model=server.model, prompt="Tell me a story", max_tokens=6, temperature=0,
                                       stream=True, extra_body=ids)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].prompt_token_ids == choice.prompt_token_ids
    assert [t for c in chunks for t in c.token_ids] == choice.token_ids

    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=server.model, messages=messages, max_tokens=5, temperature=0,
                                          logprobs=True, extra_body={**ids, "return_tokens_as_token_ids": True})
    assert len(chat.prompt_token_ids) == chat.usage.prompt_tokens and len(chat.choices[0].token_ids) == 5
    assert [e.token for e in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    stream = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, extra_body=ids))
    assert stream[0].prompt_token_ids == chat.prompt_token_ids
    streamed = [t for c in stream for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])]
    assert streamed == chat.choices[0].token_ids
    plain = client.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_extra and "prompt_token_ids" not in plain.model_extra
