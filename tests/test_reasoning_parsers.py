"""Reasoning parsers (`--reasoning-parser`, coordinator/reasoning_parsers.py): a thinking model's
<think> block comes back as `reasoning_content`, apart from `content`, whole and streamed, and
what streams adds up to the whole reply's fields (the served path is tested live in
tests/test_structured_outputs.py, whose server runs with the qwen3 parser)."""

from __future__ import annotations

import copy

import pytest

from coordinator.openai_responses import ChatFormat
from coordinator.openai_tools import tool_call_plan
from coordinator.outputs import CompletionOutput, RequestOutput
from coordinator.openai_serving import ReasoningTags
from coordinator.reasoning_parsers import PARSERS, reply_starts_inside
from coordinator.sampling_params import SamplingParams, StructuredOutputsParams
from coordinator.server_options import REASONING_PARSERS, ServerOptions

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_every_parser_the_server_names_exists():
    assert tuple(PARSERS) == REASONING_PARSERS
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        ServerOptions(reasoning_parser="granite")


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("deepseek_r1", "Let me think.\n</think>\n\nParis.", "Let me think.\n", "Paris."),
    ("deepseek_r1", "<think>Hmm.</think>Paris.", "Hmm.", "Paris."),
    ("deepseek_r1", "Still thinking when max_tokens came", "Still thinking when max_tokens came", ""),
    ("qwen3", "<think>\nHmm.\n</think>\n\nParis.", "\nHmm.\n", "Paris."),
    ("qwen3", "Paris, without thinking.", None, "Paris, without thinking."),
    ("qwen3", "<think>cut short", "cut short", ""),
    ("qwen3", "<thi", None, "<thi"),
])
def test_a_whole_reply_splits_into_reasoning_and_content(parser, text, reasoning, content):
    assert PARSERS[parser].split(text) == (reasoning, content)


def test_a_reply_that_starts_outside_the_block_opens_none_unless_it_writes_one():
    assert PARSERS["deepseek_r1"].split('{"a": 1}', starts_inside=False) == (None, '{"a": 1}')
    assert PARSERS["deepseek_r1"].split('<think>x</think>{"a": 1}', starts_inside=False) == ("x", '{"a": 1}')
    assert PARSERS["qwen3"].split("x</think>y", starts_inside=True) == ("x", "y")  # its template opened it


def test_the_prompts_last_tag_says_where_a_reply_starts():
    assert reply_starts_inside([1, 7, 2], 7, 8, False)  # an open <think> (a template that starts it)
    assert not reply_starts_inside([7, 3, 8, 2], 7, 8, True)  # closed (thinking turned off)
    assert reply_starts_inside([1, 2], 7, 8, True) and not reply_starts_inside([], 7, 8, False)  # the default


def test_reasoning_tags_set_the_grammar_and_the_reading(bundled_tokenizer):
    """With a tokenizer whose think tags are tokens, a constrained request's grammar learns them
    (the engine then waits out a block the reply starts inside), and the reply is read as the
    engine decides; without such tokens a constrained reply starts outside any block."""
    tokenizer = copy.deepcopy(bundled_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    tags = ReasoningTags(PARSERS["deepseek_r1"], tokenizer)
    assert tags.ids == (think, end)
    assert tags.constrain_after(constrained).structured_outputs.reasoning == (think, end, True)
    assert tags.constrain_after(SamplingParams()) == SamplingParams()  # unconstrained: unchanged
    assert tags.starts_inside(constrained, [5, think, 6]) and not tags.starts_inside(constrained, [think, end])
    plain = ReasoningTags(PARSERS["deepseek_r1"], bundled_tokenizer)  # SmolLM2: no think tokens
    assert plain.ids is None and plain.constrain_after(constrained) is constrained
    assert plain.starts_inside(constrained, [1]) is False and plain.starts_inside(SamplingParams(), [1]) is None
    assert ReasoningTags(None, tokenizer).starts_inside(constrained, [think]) is None


def stream_deltas(fmt: ChatFormat, pieces: list[str], finish: str = "stop") -> list[dict]:
    """The deltas of a reply that arrives in `pieces` (as the engine's outputs would)."""
    deltas, text = [], ""
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        out = RequestOutput("r", None, [1], [CompletionOutput(0, text, list(range(len(text))),
                                                              finish if last else None, delta_text=piece,
                                                              delta_token_ids=[0])], last)
        deltas += [c["delta"] for c in fmt.deltas(out)]
    return deltas


@pytest.mark.parametrize("parser, pieces", [
    ("deepseek_r1", ["Let", " me </", "thin", "k>\n", "\nPar", "is."]),
    ("deepseek_r1", ["<th", "ink>Hm", "m.</think>", "Paris."]),
    ("deepseek_r1", ["All", " reasoning <", "/thi"]),
    ("qwen3", ["<", "think>", "Hmm", "</th", "ink>\n\nParis", "."]),
    ("qwen3", ["<", "p>Paris", "</p>"]),
    ("qwen3", ["<thi"]),
])
def test_streamed_reasoning_and_content_add_up_to_the_whole_reply(parser, pieces):
    fmt = ChatFormat(1, None, reasoning=PARSERS[parser])
    whole = fmt._message("".join(pieces), "stop")[0]
    deltas = stream_deltas(ChatFormat(1, None, reasoning=PARSERS[parser]), pieces)
    streamed_reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    streamed_content = "".join(d.get("content") or "" for d in deltas)
    assert streamed_reasoning == (whole["reasoning_content"] or "")
    assert streamed_content == (whole["content"] or "")
    assert not any("<" in d.get("content", "") and "think" in d.get("content", "") for d in deltas)


def test_tool_calls_are_found_in_the_content_after_the_reasoning():
    plan = tool_call_plan(TOOLS, "auto", None, auto_parser="hermes")
    pieces = ["I should call it.</think>", "<tool_call>", '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
              "</tool_call>"]
    whole, finish = ChatFormat(1, None, plan, PARSERS["deepseek_r1"])._message("".join(pieces), "stop")
    assert whole["reasoning_content"] == "I should call it." and whole["content"] is None and finish == "tool_calls"
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["get_weather"]
    deltas = stream_deltas(ChatFormat(1, None, plan, PARSERS["deepseek_r1"]), pieces)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should call it."
    assert [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", [])] == ['{"city": "Oslo"}']
