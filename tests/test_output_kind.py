"""output_kind FINAL_ONLY: a request that waits for its whole result gets one output, once it has
finished, holding every token, the same as a streamed request's last; and the callers that wait
(LLM.generate, non-streaming HTTP) ask for it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from coordinator.async_engine import AsyncEngine
from coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest
from coordinator.openai_serving import OpenAIServing
from pagedserve import LLM, RequestOutputKind, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, kv_cache_memory=1 << 24)


@pytest.fixture(scope="module")
def grouped_llm(tiny_llama):
    """The same model streaming under stream_interval 4."""
    return LLM(tiny_llama, kv_cache_memory=1 << 24, stream_interval=4)


def _run_side_by_side(llm, params: SamplingParams) -> tuple[list, list]:
    """The same request twice in one batch, streamed and final-only: each one's outputs."""
    engine = llm.engine
    kinds = {"streamed": RequestOutputKind.CUMULATIVE, "final": RequestOutputKind.FINAL_ONLY}
    seen = {rid: [] for rid in kinds}
    for rid, kind in kinds.items():
        engine.add_request(rid, None, PROMPT, dataclasses.replace(params, output_kind=kind))
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen["streamed"], seen["final"]


def _stop_string(llm) -> str:
    """Three characters from the middle of this model's greedy text, which then end it there."""
    text = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=24, **GREEDY),
                        use_tqdm=False)[0].outputs[0].text
    return text[len(text) // 2:len(text) // 2 + 3]


@pytest.mark.parametrize("case", ["greedy_stop_string", "parallel_samples"])
def test_a_final_only_request_gets_one_output_equal_to_the_streamed_ones_last(llm, case):
    if case == "greedy_stop_string":
        params = SamplingParams(max_tokens=24, logprobs=1, stop=[_stop_string(llm)], **GREEDY)
    else:
        params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=10, ignore_eos=True, logprobs=2)
    streamed, final = _run_side_by_side(llm, params)
    assert len(final) == 1 and final[0].finished
    assert len(streamed) > 1 and not streamed[0].finished
    last = streamed[-1]
    if case == "greedy_stop_string":
        assert last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == params.stop[0]
    assert len(final[0].outputs) == len(last.outputs) == params.n
    for got, want in zip(final[0].outputs, last.outputs):
        # Nothing was sent before, so the one output's delta is the whole completion.
        assert got.delta_token_ids == got.token_ids == want.token_ids
        assert got.delta_text == got.text == want.text
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
        assert len(got.logprobs) == len(got.token_ids)
        assert [max(step, key=lambda t: step[t].logprob) for step in got.logprobs] == \
               [max(step, key=lambda t: step[t].logprob) for step in want.logprobs]
    # The streamed deltas add up to the same completion.
    for index, want in enumerate(last.outputs):
        assert [t for out in streamed for t in out.outputs[index].delta_token_ids] == want.token_ids
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("case", ["greedy_stop_string", "parallel_samples"])
def test_a_stream_interval_sends_the_first_token_then_every_n_and_the_rest_at_the_end(llm, grouped_llm, case):
    """vLLM's --stream-interval: with 4, a streamed request's outputs carry its first token, then
    4 tokens each, then what is left with its end; they add up to the same completion as every
    step's outputs, and a final-only request beside it is unchanged."""
    if case == "greedy_stop_string":
        params = SamplingParams(max_tokens=24, logprobs=1, stop=[_stop_string(llm)], **GREEDY)
    else:
        params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=11, ignore_eos=True, logprobs=2)
    every_step, _ = _run_side_by_side(llm, params)
    grouped, final = _run_side_by_side(grouped_llm, params)
    want = every_step[-1]
    total = len(want.outputs[0].token_ids)
    assert total > 5  # enough tokens for a group in the middle
    assert [len(out.outputs[0].delta_token_ids) for out in grouped] == \
           [1] + [4] * ((total - 2) // 4) + [(total - 2) % 4 + 1]
    assert [out.finished for out in grouped] == [False] * (len(grouped) - 1) + [True]
    for index, sample in enumerate(want.outputs):
        assert [t for out in grouped for t in out.outputs[index].delta_token_ids] == sample.token_ids
        assert "".join(out.outputs[index].delta_text for out in grouped) == sample.text
        got = grouped[-1].outputs[index]
        assert (got.text, got.finish_reason, got.stop_reason) == (sample.text, sample.finish_reason, sample.stop_reason)
        assert len(got.logprobs) == len(got.token_ids)
    assert final[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert grouped_llm.stats()["kv_blocks_used"] == 0


def test_a_stream_interval_streams_http_chunks_of_several_tokens_each_with_its_logprobs(grouped_llm):
    """OpenAIServing over an engine with stream_interval 4: a streamed completion's chunks carry
    1, 4, 4, 1 tokens (by their logprobs' entries), and add up to the response sent whole."""
    body = dict(prompt=PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)

    async def serve():
        engine = AsyncEngine(grouped_llm.engine)
        engine.start()
        serving = OpenAIServing("tiny", None, "fp")
        try:
            stream = await serving.completions(engine, CompletionRequest(stream=True, **body))
            chunks = [chunk async for chunk in stream]
            whole = await serving.completions(engine, CompletionRequest(**body))
        finally:
            await engine.stop()
        return chunks, whole

    chunks, whole = asyncio.run(serve())
    pieces = [c["choices"][0] for c in chunks if c.get("choices") and c["choices"][0].get("logprobs")]
    assert [len(p["logprobs"]["tokens"]) for p in pieces] == [1, 4, 4, 1]
    want = whole["choices"][0]
    assert "".join(p["text"] for p in pieces) == want["text"]
    assert [lp for p in pieces for lp in p["logprobs"]["token_logprobs"]] == want["logprobs"]["token_logprobs"]
    assert pieces[-1]["finish_reason"] == want["finish_reason"] == "length"
    assert grouped_llm.stats()["kv_blocks_used"] == 0


def test_generate_makes_final_outputs_only_and_leaves_the_callers_params_as_they_were(llm):
    made = []
    step = llm.engine.step

    def counting_step():
        outs = step()
        made.extend(outs)
        return outs

    params = SamplingParams(max_tokens=6, **GREEDY)
    llm.engine.step = counting_step
    try:
        outs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:3]}], params, use_tqdm=False)
    finally:
        del llm.engine.step
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert len(made) == 2 and all(out.finished for out in made)
    assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_non_streaming_http_requests_make_final_outputs_only(llm):
    """OpenAIServing over the engine in this process, each make_outputs call's outputs recorded:
    a response sent whole takes the request's last output only, a streamed one every step's."""
    processor = llm.engine.output_processor
    make_outputs = processor.make_outputs
    made = []

    def recording(updates, stats):
        outs = make_outputs(updates, stats)
        made.extend((out.request_id, out.finished) for out in outs)
        return outs

    async def serve() -> dict:
        engine = AsyncEngine(llm.engine)
        engine.start()
        serving = OpenAIServing("tiny", None, "fp")
        texts = {}
        try:
            for stream in (False, True):
                common = dict(max_tokens=8, n=2, temperature=0.8, seed=3, ignore_eos=True, stream=stream)
                completion = await serving.completions(engine, CompletionRequest(prompt=PROMPT, **common))
                chat = await serving.chat(engine, ChatCompletionRequest(
                    messages=[{"role": "user", "content": "hi"}], **common))
                texts[stream] = (await _texts(completion, "text"), await _texts(chat, "content"))
        finally:
            await engine.stop()
        return texts

    processor.make_outputs = recording
    try:
        texts = asyncio.run(serve())
    finally:
        del processor.make_outputs
    assert texts[False] == texts[True]  # the same seeded samples, whole or streamed
    by_request: dict[str, list[bool]] = {}
    for request_id, finished in made:
        by_request.setdefault(request_id, []).append(finished)
    whole, streamed = list(by_request.values())[:2], list(by_request.values())[2:]
    assert len(by_request) == 4
    assert all(flags == [True] for flags in whole)
    assert all(len(flags) > 1 and flags[-1] and not any(flags[:-1]) for flags in streamed)


async def _texts(response, field: str) -> list[str]:
    """Each choice's text (or message content) by index, from a whole response or its chunks."""
    if isinstance(response, dict):
        return [c.get("text", c.get("message", {}).get(field)) for c in sorted(response["choices"],
                                                                              key=lambda c: c["index"])]
    texts: dict[int, str] = {}
    async for chunk in response:
        for choice in chunk.get("choices", []):
            piece = choice.get("text") if field == "text" else (choice.get("delta") or {}).get("content")
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    await response.aclose()
    return [texts[i] for i in sorted(texts)]


def test_through_the_router_a_final_only_request_gets_one_whole_output_and_frees_its_load_at_its_first_token(llm):
    """The router's replica streams every step to a FINAL_ONLY request: its routing load (the
    prompt tokens awaiting a first token) is released at the first token, not at the end; the
    client gets the last output alone, its deltas the whole completion."""
    from coordinator.router import Router

    engine = llm.engine
    pending_after_steps = []

    async def serve() -> tuple[list, list]:
        router = Router([AsyncEngine(engine)])
        router.start()
        step = engine.step

        def recording_step():
            outs = step()
            pending_after_steps.append(router.replicas[0].pending_tokens)
            return outs

        engine.step = recording_step
        try:
            got = {}
            for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
                params = SamplingParams(max_tokens=10, output_kind=kind, **GREEDY)
                got[kind] = [out async for out in router.generate(None, PROMPT, params)]
        finally:
            del engine.step
            await router.stop()
        return got[RequestOutputKind.CUMULATIVE], got[RequestOutputKind.FINAL_ONLY]

    streamed, final = asyncio.run(serve())
    assert len(streamed) == 10 and len(final) == 1 and final[0].finished
    whole = final[0].outputs[0]
    assert whole.delta_token_ids == whole.token_ids == streamed[-1].outputs[0].token_ids
    assert whole.delta_text == whole.text == streamed[-1].outputs[0].text
    assert pending_after_steps[-3:] == [0, 0, 0]  # released long before the final request ended


def test_a_failing_prompt_of_a_final_only_group_aborts_the_others_at_once(llm):
    """Several prompts in one non-streaming request: a prompt that fails ends the group at once,
    without its siblings running to their end first (each one's first output is its last)."""
    from coordinator.openai_serving import RequestGroup

    class FailingSecond:
        """An AsyncEngine whose second request fails at once; every request made is recorded."""

        def __init__(self, engine: AsyncEngine):
            self.engine, self.started = engine, []

        def __getattr__(self, name):  # the queue's figures and the input checks: the engine's
            return getattr(self.engine, name)

        def generate(self, text, ids, params, request_id, priority, **kwargs):
            self.started.append(request_id)
            if request_id.endswith("-1"):
                return _fails()
            return self.engine.generate(text, ids, params, request_id, priority, **kwargs)

    async def _fails():
        raise ValueError("prompt 1 is refused")
        yield  # an async generator

    async def run() -> tuple[str, float]:
        engine = AsyncEngine(llm.engine)
        engine.start()
        failing = FailingSecond(engine)
        params = SamplingParams(max_tokens=400, output_kind=RequestOutputKind.FINAL_ONLY, **GREEDY)
        try:
            with pytest.raises(ValueError, match="prompt 1 is refused"):
                await RequestGroup.admit(failing, [(None, PROMPT, None)] * 3, params, "grp", 0, None)
            for _ in range(100):  # the aborts are applied between steps
                if not llm.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.02)
            return failing.started, llm.stats()["num_steps"]
        finally:
            await engine.stop()

    steps_before = llm.stats()["num_steps"]
    started, steps_after = asyncio.run(run())
    assert started == ["grp-0", "grp-1", "grp-2"]
    assert steps_after - steps_before < 100  # the siblings' 400 tokens each were never all made
    assert not llm.engine.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0
