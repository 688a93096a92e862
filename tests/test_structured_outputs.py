"""Structured outputs: with a random model every constrained output still parses (JSON schemas
validate, regexes fullmatch, choices are chosen, Lark grammars derive), each of n samples has its
own matcher, preemption by recompute or swap changes no token, a bad grammar is refused at
admission with nothing left behind, and the gRPC and HTTP doors carry them (one live server)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from types import SimpleNamespace

import jsonschema
import numpy as np
import openai
import pytest
import ray
import torch

from coordinator.async_engine import AsyncEngine
from coordinator.openai_tools import tool_call_plan
from coordinator.sampling_params import SamplingParams, StructuredOutputsParams
from coordinator.server_options import ServerOptions
from coordinator.structured_output import GrammarCompiler, fill_bitmasks
from pagedserve import LLM
from pagedserve.client import Client
from pagedserve.config import EngineConfig
from tests.serving import running_coordinator
from tests.test_kv_swap import TIGHT
from tests.test_model_correctness import _prompts
from workers.sampler import apply_token_bitmask, unpack_disallowed_numpy, unpack_disallowed_torch
from workers.step_plan import SeqSampling

# Small schemas whose every string and number is bounded: a random model cannot run past max_tokens.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "items", "paid"],
         "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                        "items": {"type": "array", "minItems": 1, "maxItems": 2,
                                  "items": {"type": "object", "additionalProperties": False,
                                            "required": ["sku", "qty"],
                                            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
                        "paid": {"type": "boolean"}}}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
LARK = 'start: "(" item ("," item){0,2} ")"\nitem: NAME\nNAME: /[a-z]{1,5}/'
LARK_LANGUAGE = re.compile(r"\([a-z]{1,5}(,[a-z]{1,5}){0,2}\)")


def json_params(schema: dict, **kwargs) -> SamplingParams:
    # Compact JSON: free whitespace lets a random model pad forever.
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return SamplingParams(structured_outputs=so, **{"max_tokens": 120, **kwargs})


def _assert_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_swapped"] == 0 and not llm.engine.has_unfinished_requests()
    assert all(c == 0 for c in llm.engine.scheduler.kv.pool.ref_counts)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=1 << 24) as llm:
        yield llm


def test_json_schema_outputs_parse_and_validate(llm):
    prompts = ["Hello", "Write a person", "Order:", "x"]
    params = [json_params(PERSON, temperature=0.9, seed=s) for s in range(2)] + \
             [json_params(ORDER, temperature=0.9, seed=s) for s in range(2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params):
        (c,) = out.outputs
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), p.structured_outputs.json)
    greedy = llm.generate("Hello", json_params(ORDER, temperature=0.0), use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(greedy.text), ORDER)
    # json_object: any object; flexible whitespace, so only a bounded check of the start
    anything = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True), max_tokens=8,
                              temperature=0.0)
    assert llm.generate("Hello", anything, use_tqdm=False)[0].outputs[0].text.startswith("{")
    _assert_all_free(llm)


def test_regex_choice_and_lark_outputs_follow_their_grammar(llm):
    kinds = [StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=["yes", "no", "not sure"]),
             StructuredOutputsParams(grammar=LARK)]
    for seed in range(3):
        params = [SamplingParams(structured_outputs=so, temperature=1.0, seed=seed, max_tokens=60) for so in kinds]
        regex, choice, lark = (o.outputs[0] for o in llm.generate(["Hi", "Pick", "List"], params, use_tqdm=False))
        assert re.fullmatch(REGEX, regex.text) and regex.finish_reason == "stop"
        assert choice.text in ("yes", "no", "not sure") and choice.finish_reason == "stop"
        assert LARK_LANGUAGE.fullmatch(lark.text) and lark.finish_reason == "stop"
    _assert_all_free(llm)


def test_each_of_n_samples_has_its_own_matcher(llm):
    params = json_params(PERSON, n=2, temperature=1.0, seed=7)
    (out,) = llm.generate("People:", params, use_tqdm=False)
    texts = [c.text for c in out.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert texts[0] != texts[1]  # different tokens through separate matchers, both valid
    # best_of > n: every generated sample is constrained, the best n come back
    (out,) = llm.generate("People:", SamplingParams(structured_outputs=StructuredOutputsParams(regex=REGEX),
                                                    n=2, best_of=4, temperature=1.0, seed=3, max_tokens=30),
                          use_tqdm=False)
    assert len(out.outputs) == 2 and all(re.fullmatch(REGEX, c.text) for c in out.outputs)
    _assert_all_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_structured_outputs_equal_the_unpreempted_run(tiny_llama, llm, mode):
    prompts = [{"prompt_token_ids": p} for p in _prompts(8, seed=5, low=40, high=70)]
    params = json_params(ORDER, temperature=0.0)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(tiny_llama, kv_cache_memory=TIGHT, swap_space=0.01, preemption_mode=mode,
             max_num_batched_tokens=64) as tight:
        outs = tight.generate(prompts, params, use_tqdm=False)
        stats = tight.stats()
        assert stats["num_preemptions"] > 0 and (stats["swap_out_blocks"] > 0) == (mode == "swap")
        assert [o.outputs[0].token_ids for o in outs] == want
        for o in outs:
            jsonschema.validate(json.loads(o.outputs[0].text), ORDER)
        _assert_all_free(tight)


def test_an_invalid_schema_is_refused_at_admission_and_leaves_nothing(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "strng"}))
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: invalid or unsupported JSON schema"):
        llm.generate("Hello", bad, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex"):  # the second prompt's: the first is undone
        llm.generate(["Hello", "Hi"], [json_params(PERSON), SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a(b"))], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^structured_outputs\.grammar"):
        llm.generate("Hello", SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: nothing")),
                     use_tqdm=False)
    _assert_all_free(llm)
    assert llm.engine.output_processor.requests == {}
    # and the engine goes on
    assert re.fullmatch(REGEX, llm.generate("Hi", SamplingParams(
        structured_outputs=StructuredOutputsParams(regex=REGEX), max_tokens=30), use_tqdm=False)[0].outputs[0].text)


def test_a_grammar_that_compiles_slowly_holds_up_no_other_request(llm, monkeypatch):
    """A server compiles grammars in a pool of their own: while one request's schema compiles
    (held here until released), a plain request is tokenized, served and finished."""
    grammars = llm.engine.input_processor.grammars
    compiling, release = threading.Event(), threading.Event()
    real_build = grammars._build

    def held_build(so):
        compiling.set()
        release.wait(60)
        return real_build(so)

    monkeypatch.setattr(grammars, "_build", held_build)
    unseen = {**PERSON, "properties": {**PERSON["properties"], "name": {"type": "string", "maxLength": 5}}}

    async def last(outputs):
        out = None
        async for out in outputs:
            pass
        return out

    async def scenario():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            constrained = asyncio.create_task(last(engine.generate("Who", None, json_params(unseen, temperature=0.0))))
            assert await asyncio.get_running_loop().run_in_executor(None, compiling.wait, 30)
            plain = await asyncio.wait_for(last(engine.generate("Hi", None, SamplingParams(max_tokens=4))), 60)
            assert plain.finished and len(plain.outputs[0].token_ids) == 4
            assert not constrained.done()  # still compiling
            release.set()
            done = await asyncio.wait_for(constrained, 60)
            jsonschema.validate(json.loads(done.outputs[0].text), unseen)
        finally:
            release.set()
            await engine.stop()

    asyncio.run(scenario())
    _assert_all_free(llm)


def test_a_grammar_waits_out_the_reasoning_block_its_reply_starts_inside(llm):
    """A reasoning parser's tags (here two arbitrary token ids): while the reply is inside the think
    block every token is allowed; from the token after the end tag the grammar applies; a prompt
    whose last tag closes the block starts the grammar at once."""
    think, end = 300, 301
    choices = ["yes", "no"]
    tokenizer = llm.engine.tokenizer
    banned = tokenizer.encode("zebra", add_special_tokens=False)[0]  # no choice starts with it
    so = StructuredOutputsParams(choice=choices, reasoning=(think, end, True))

    def run(prompt, bias, max_tokens=8):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, logit_bias=bias,
                                ignore_eos=False)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return out.outputs[0].token_ids

    # inside the block (the prompt opened it): the banned token, pushed up, is sampled freely
    assert run([11, 12, think, 13], {banned: 50.0}) == [banned] * 8
    # the end tag comes first (pushed harder): after it the grammar decides, and the reply ends complete
    tokens = run([11, 12, think, 13], {banned: 50.0, end: 80.0}, max_tokens=20)
    assert tokens[0] == end and tokenizer.decode(tokens[1:], skip_special_tokens=True) in choices
    # the prompt closed the block: the grammar applies from the first token, the bias cannot win
    tokens = run([11, think, 12, end, 13], {banned: 50.0}, max_tokens=20)
    assert banned not in tokens and tokenizer.decode(tokens, skip_special_tokens=True) in choices
    # no tag in the prompt: the parser's default (True here: deepseek_r1's reading) holds
    assert run([11, 12, 13], {banned: 50.0}, max_tokens=3) == [banned] * 3
    _assert_all_free(llm)


def test_a_waiting_grammar_has_no_mask_row_and_drafts_stop_before_the_end_tag(bundled_tokenizer):
    compiler = GrammarCompiler(bundled_tokenizer, len(bundled_tokenizer))
    so = StructuredOutputsParams(choice=["yes", "no"], reasoning=(300, 301, False))
    waiting = compiler.start(so, [5, 300, 6])
    assert not waiting.active and waiting.waiting_for == 301
    assert waiting.valid_prefix([7, 8, 301, 9]) == [7, 8]  # the token after the end tag needs a mask
    assert waiting.valid_prefix([7, 8]) == [7, 8]
    fork = waiting.copy()
    assert not waiting.accept(7) and not waiting.active  # any token while inside
    assert not waiting.accept(301) and waiting.active  # the end tag: the grammar starts
    assert not fork.active  # a fork keeps its own state
    yes = bundled_tokenizer.encode("yes", add_special_tokens=False)
    assert waiting.valid_prefix(yes) == yes and waiting.valid_prefix([7]) == []
    assert compiler.start(so, [5, 6]).active  # no tag, and the default is False: qwen3's reading
    assert compiler.start(so, [300, 5, 301]).active  # the prompt closed the block


def test_shapes_are_checked_at_construction_and_beam_search_is_refused():
    for kwargs, message in [({}, "exactly one of"), ({"json": PERSON, "regex": "a"}, "exactly one of"),
                            ({"json": "{oops"}, "structured_outputs.json is not valid JSON"),
                            ({"choice": []}, "structured_outputs.choice"), ({"regex": ""}, "structured_outputs.regex")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs has no field 'jsn'"):
        SamplingParams(structured_outputs={"jsn": PERSON})
    with pytest.raises(ValueError, match="structured_outputs is not supported with use_beam_search"):
        SamplingParams(use_beam_search=True, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a"))


def test_masks_clear_the_padded_vocabulary_and_grammars_are_cached(bundled_tokenizer):
    padded = len(bundled_tokenizer) + 40
    compiler = GrammarCompiler(bundled_tokenizer, padded, frozenset({2}), cache_size=2)
    first = compiler.compile(StructuredOutputsParams(json=PERSON))
    assert compiler.compile(StructuredOutputsParams(json=dict(reversed(PERSON.items())))) is first  # same text
    matcher = compiler.start(StructuredOutputsParams(json=PERSON))
    (mask,) = fill_bitmasks([(matcher, ())])
    assert mask.shape == ((padded + 31) // 32,)
    allowed = np.flatnonzero(~unpack_disallowed_numpy(mask[None], padded).numpy()[0])
    assert len(allowed) > 0 and allowed.max() < len(bundled_tokenizer)
    assert all(bundled_tokenizer.decode([t]).startswith("{") for t in allowed)
    for regex in ("a", "b", "c"):  # LRU of 2: PERSON falls out
        compiler.compile(StructuredOutputsParams(regex=regex))
    assert compiler.compile(StructuredOutputsParams(json=PERSON)) is not first


def test_the_bitmask_masks_only_its_rows_and_both_unpacks_agree():
    rng = np.random.default_rng(0)
    masks = rng.integers(-2**31, 2**31 - 1, size=(2, 3), dtype=np.int64).astype(np.int32)
    assert torch.equal(unpack_disallowed_numpy(masks, 90), unpack_disallowed_torch(masks, 90, torch.device("cpu")))
    params = [SeqSampling(i, 1.0, 1.0, -1, 0.0, None) for i in range(3)]
    params[0].bitmask_index, params[2].bitmask_index = 1, 0
    logits = torch.zeros(3, 100)  # 100 logits, 96 mask bits: the last 4 are padding
    apply_token_bitmask(logits, masks, params)
    for row, mask in ((0, masks[1]), (2, masks[0])):
        bits = [t for t in range(96) if (int(mask[t // 32]) >> (t % 32)) & 1]
        assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == bits
    assert torch.isfinite(logits[1]).all()


@pytest.fixture(scope="module")
def server(ray_session, tiny_llama):
    config = EngineConfig(model=tiny_llama, kv_cache_memory=1 << 22, distributed_executor_backend="uni")
    with running_coordinator(config, enable_auto_tool_choice=True, tool_call_parser="hermes",
                             reasoning_parser="qwen3") as (actor, target):
        port = ray.get(actor.status.remote())["http_port"]
        yield SimpleNamespace(target=target, url=f"http://127.0.0.1:{port}/v1", model=tiny_llama)


def test_grpc_request_with_a_json_schema(server):
    with Client(server.target) as client:
        done = client.generate("Hello", json_schema=PERSON, disable_any_whitespace=True, max_tokens=80,
                               temperature=0.8, seed=2)
        assert done.finish_reason == "stop"
        jsonschema.validate(json.loads(done.text), PERSON)
        assert client.generate("Hi", choice=["left", "right"], temperature=1.0).text in ("left", "right")
        with pytest.raises(Exception) as info:
            client.generate("Hello", json_schema={"type": "strng"})
        assert info.value.code.name == "INVALID_ARGUMENT" and "structured_outputs.json" in info.value.details


def test_http_response_format_and_structured_outputs(server):
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    # OpenAI's field has no whitespace switch; llguidance reads one from the schema's "x-guidance".
    compact = {**PERSON, "x-guidance": {"whitespace_flexible": False}}
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": compact, "strict": True}}
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Who?"}],
                                          response_format=schema_format, max_tokens=80, temperature=0.8, seed=1)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    completion = client.completions.create(model=server.model, prompt="Pick", max_tokens=20, temperature=1.0,
                                           extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, completion.choices[0].text)
    vllm_style = {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}
    strict = client.completions.create(model=server.model, prompt="Who", max_tokens=80, temperature=0.0,
                                       extra_body=vllm_style)
    jsonschema.validate(json.loads(strict.choices[0].text), PERSON)
    for body, param in [({"response_format": {"type": "xml"}}, "response_format"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
                        ({"structured_outputs": {"json": {"type": "strng"}}}, "structured_outputs"),
                        # a schema that fails to compile is named by the field it came in
                        ({"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
                         "response_format"),
                        ({"structured_outputs": {"backend": "xgrammar", "regex": "a"}}, "structured_outputs")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=server.model, prompt="x", max_tokens=4, extra_body=body)
        assert info.value.body["param"] == param, info.value.body
        assert info.value.body["message"].startswith(param), info.value.body


# ---- tool calling over HTTP (coordinator/openai_tools.py) -----------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city"],
                                                           "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": PERSON}}]


def _chat(client, server, **kwargs):
    return client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Weather?"}],
                                          max_tokens=120, **kwargs)


def test_http_named_and_required_tool_choice_return_valid_tool_calls(server):
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):  # sampled: each reply is still a valid call
        choice = _chat(client, server, tools=TOOLS, tool_choice=named, temperature=1.0, seed=seed).choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    for seed in range(4):
        choice = _chat(client, server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                       parallel_tool_calls=False).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls  # parallel_tool_calls false: exactly one
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    # A named call streams as it is written: the id and name first, then pieces of the arguments.
    chunks = [c for c in _chat(client, server, tools=TOOLS, tool_choice=named, temperature=0.0, stream=True)
              if c.choices]
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    greedy = _chat(client, server, tools=TOOLS, tool_choice=named, temperature=0.0).choices[0].message.tool_calls[0]
    assert pieces[0].id.startswith("chatcmpl-tool-") and pieces[0].function.name == "get_weather"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:]) and len(pieces) > 2
    assert "".join(p.function.arguments for p in pieces) == greedy.function.arguments
    assert not any(c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    # "required" calls stream too: each call's index, id and name first, then pieces of its arguments.
    chunks = [c for c in _chat(client, server, tools=TOOLS, tool_choice="required", temperature=0.0, stream=True)
              if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    whole = _chat(client, server, tools=TOOLS, tool_choice="required", temperature=0.0).choices[0].message.tool_calls
    heads = [tc for tc in calls if tc.id is not None]
    assert [(h.index, h.function.name) for h in heads] == [(i, tc.function.name) for i, tc in enumerate(whole)]
    assert all(h.id.startswith("chatcmpl-tool-") for h in heads) and len(calls) > len(heads)
    assert ["".join(tc.function.arguments for tc in calls if tc.index == i) for i in range(len(whole))] == \
        [tc.function.arguments for tc in whole]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice "none": plain text, as without tools (greedy, so the same tokens)
    plain = _chat(client, server, temperature=0.0, max_completion_tokens=8, extra_body={"ignore_eos": True})
    none = _chat(client, server, tools=TOOLS, tool_choice="none", temperature=0.0, max_completion_tokens=8,
                 extra_body={"ignore_eos": True})
    assert none.choices[0].message.content == plain.choices[0].message.content and not none.choices[0].message.tool_calls
    # The second turn: the assistant's call and the tool's answer go back into the conversation.
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": greedy.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": greedy.function.arguments}}]},
               {"role": "tool", "tool_call_id": greedy.id, "content": "Sunny, 21 C"}]
    reply = client.chat.completions.create(model=server.model, messages=history, max_tokens=6, temperature=0.0)
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content
    # The conversation the model saw holds the call's arguments (SmolLM2-style templates drop tool_calls).
    assert reply.usage.prompt_tokens > client.chat.completions.create(
        model=server.model, messages=[history[0], {**history[1], "tool_calls": None, "content": ""}, history[2]],
        max_tokens=1).usage.prompt_tokens


def test_http_tool_choices_the_server_cannot_honour_are_400s_naming_the_field(server):
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    cases = [({"tool_choice": "required"}, "tool_choice", "needs tools"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
              "'nope'"),
             ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "required"},
              "tools", "tools[0].function.name"),
             ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "names two tools"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}],
               "tool_choice": "required"}, "tools", "tools"),
             ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
              "cannot both")]
    for body, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            _chat(client, server, **body)
        assert info.value.body["param"] == param and words in info.value.body["message"], (body, info.value.body)
    with Client(server.target) as grpc_client:  # nothing was left behind by the refusals
        stats = grpc_client.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_http_auto_tool_choice_finds_hermes_calls_in_the_text_and_streams_the_text_before_them(server):
    """The server runs with --enable-auto-tool-choice --tool-call-parser hermes. A random model
    writes no tags of its own, so a regex (structured outputs, which "auto" leaves free) makes it
    write text and then a call in Hermes' tags."""
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    hermes = r'[a-z]{3,6} <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}</tool_call>'
    body = {"tools": TOOLS, "temperature": 1.0, "seed": 3, "extra_body": {"structured_outputs": {"regex": hermes}}}
    choice = _chat(client, server, **body).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert re.fullmatch("[a-z]{3,6}", choice.message.content)  # the text before the call, stripped
    chunks = [c for c in _chat(client, server, stream=True, **body) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert text.strip() == choice.message.content and "<" not in text  # no piece of a tag leaks as content
    assert [tc.function.name for tc in calls if tc.id] == ["get_weather"] and len(calls) > 1  # streamed in pieces
    assert "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Text with no call is the reply's content, streamed as it comes.
    plain = _chat(client, server, tools=TOOLS, temperature=0.0, max_completion_tokens=6,
                  extra_body={"ignore_eos": True}).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "length" and plain.message.content
    streamed = [c for c in _chat(client, server, tools=TOOLS, temperature=0.0, max_completion_tokens=6, stream=True,
                                 extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == plain.message.content


def test_hermes_parsing_and_what_may_stream_before_a_call():
    plan = tool_call_plan(TOOLS, "auto", None, auto_parser="hermes")
    assert plan.structured_outputs() is None  # the model writes freely
    content, calls = plan.parse('Sure. <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
                                '<tool_call>{"name": "b", "arguments": "{}"}</tool_call>')
    assert content == "Sure." and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("a", '{"x": 1}'), ("b", "{}")]
    assert plan.parse('<tool_call>{"name": "a", "argum') == ('<tool_call>{"name": "a", "argum', None)  # cut short
    assert plan.parse("no call") == ("no call", None)
    assert plan.streamable("Hello <tool") == "Hello " and plan.streamable("Hello <tool_call>{") == "Hello "
    assert plan.streamable("a < b") == "a < b" and plan.streamable("x<") == "x"
    with pytest.raises(ValueError, match='tool_choice "auto"'):
        tool_call_plan(TOOLS, None, None)  # no parser: "auto", the default with tools, is refused
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, mistral, llama3_json, pythonic"):
        ServerOptions(tool_call_parser="granite")
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs tool_call_parser"):
        ServerOptions(enable_auto_tool_choice=True)


def test_http_reasoning_comes_apart_from_the_content(server):
    """The server runs with --reasoning-parser qwen3. A regex makes the random model think in
    <think> tags, then answer and call a tool; replies without the tags are all content."""
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    shape = (r'<think>[a-z]{3,8} [a-z]{3,8}</think>[a-z]{2,6} <tool_call>\{"name": "get_weather", '
             r'"arguments": \{"city": "Oslo"\}\}</tool_call>')
    body = {"tools": TOOLS, "temperature": 1.0, "seed": 5, "extra_body": {"structured_outputs": {"regex": shape}}}
    message = _chat(client, server, **body).choices[0].message
    assert re.fullmatch("[a-z]{3,8} [a-z]{3,8}", message.reasoning_content)
    assert re.fullmatch("[a-z]{2,6}", message.content)
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    chunks = [c for c in _chat(client, server, stream=True, **body) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas).strip() == message.content
    assert "".join(tc.function.arguments or "" for d in deltas for tc in (d.tool_calls or [])) == '{"city": "Oslo"}'
    plain = _chat(client, server, temperature=0.0, max_completion_tokens=6, extra_body={"ignore_eos": True})
    assert plain.choices[0].message.content and plain.choices[0].message.reasoning_content is None
