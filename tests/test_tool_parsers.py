"""The tool-call parsers of tool_choice "auto" (coordinator/tool_parsers.py), one model family's
format each: whole replies become calls (or stay content when they do not parse whole), and
while a reply is written only what is surely content may stream. The served path (a live server
with `--tool-call-parser hermes`) is tests/test_structured_outputs.py's; every parser goes
through the same ToolCallPlan."""

from __future__ import annotations

import json

import pytest

from coordinator.openai_protocol import ChatCompletionRequest
from coordinator.openai_tools import tool_call_plan
from coordinator.server_options import TOOL_CALL_PARSERS
from coordinator.tool_parsers import PARSERS

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "add")]
WEATHER = ("get_weather", {"city": "Paris", "days": 2})
ADD = ("add", {"a": 1.5, "b": [1, "x"]})


def parsed(parser: str, text: str):
    """(content, [(name, arguments as a dict)]) through the plan a request would get."""
    content, calls = tool_call_plan(TOOLS, "auto", None, auto_parser=parser).parse(text)
    if calls is not None:
        assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    return content, calls


def test_every_parser_the_server_names_exists():
    assert tuple(PARSERS) == TOOL_CALL_PARSERS


@pytest.mark.parametrize("parser, text, content", [
    ("hermes", 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
               '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1.5, "b": [1, "x"]}}</tool_call>',
     "Let me check."),
    ("hermes", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
               '{"name": "add", "arguments": {"a": 1.5, "b": [1, "x"]}}]</tool_call>', None),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "add", "arguments": {"a": 1.5, "b": [1, "x"]}}]', "Sure."),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]add[ARGS]'
                '{"a": 1.5, "b": [1, "x"]}', None),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                    '{"name": "add", "parameters": {"a": 1.5, "b": [1, "x"]}}', None),
    ("llama3_json", ' {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
                    '{"name": "add", "parameters": {"a": 1.5, "b": [1, "x"]}}\n', None),
    ("pythonic", '[get_weather(city="Paris", days=2), add(a=1.5, b=[1, \'x\'])]', None),
])
def test_calls_are_found_in_each_format(parser, text, content):
    assert parsed(parser, text) == (content, [WEATHER, ADD])


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'The weather is fine.'),
    ("hermes", '<tool_call>{"name": "get_weather", "argum'),  # cut short by max_tokens
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci'),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}'),  # no [ARGS]
    ("llama3_json", 'Paris is sunny; {"name": "add"}'),  # text first: a reply, not a call
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and more'),
    ("llama3_json", '{"city": "Paris"}'),  # JSON, but no call
    ("pythonic", '[1, 2, 3] are numbers'),
    ("pythonic", '[get_weather("Paris")]'),  # a positional argument has no name to go under
    ("pythonic", '[get_weather(city=input())]'),  # not a literal: never evaluated
    ("pythonic", '[os.system(cmd="ls")]'),
    ("pythonic", '[]'),
    ("pythonic", "[" * 5000 + "]" * 5000),  # nesting too deep for the parser: still just text
    ("llama3_json", '{"name": "add", "parameters": ' + "[" * 50000 + "]" * 50000 + "}"),
])
def test_what_does_not_parse_whole_is_content(parser, text):
    assert parsed(parser, text) == (text, None)


@pytest.mark.parametrize("parser, partial, streamable", [
    ("hermes", "Hello <tool", "Hello "),
    ("hermes", "Hello <tool_call>{", "Hello "),
    ("hermes", "a < b", "a < b"),
    ("mistral", "Sure.[TOOL_", "Sure."),
    ("mistral", "a [b] c", "a [b] c"),
    ("llama3_json", "  ", ""),
    ("llama3_json", "<|python", ""),
    ("llama3_json", '{"name": "get', ""),
    ("llama3_json", "Paris is", "Paris is"),
    ("pythonic", "[get_weather(", ""),
    ("pythonic", "It is sunny", "It is sunny"),
])
def test_only_what_is_surely_content_streams(parser, partial, streamable):
    assert tool_call_plan(TOOLS, "auto", None, auto_parser=parser).streamable(partial) == streamable


def test_mistral_replies_keep_their_special_tokens():
    """[TOOL_CALLS] is a special token: skipped in the text, the parser would never see it."""
    def params(parser, **fields):
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, **fields)
        return body.sampling_params(body.tool_call_plan(parser))

    assert params("mistral").skip_special_tokens is False
    assert params("mistral", skip_special_tokens=True).skip_special_tokens is True  # the client's word stands
    assert params("hermes").skip_special_tokens is True


def test_streamed_content_before_a_call_is_all_there():
    """What streams before a call plus the last delta is the whole reply's content: stripping the
    content's leading whitespace at the end once cut the characters streamed after it."""
    from coordinator.openai_responses import ChatFormat
    from tests.test_reasoning_parsers import stream_deltas

    plan = tool_call_plan(TOOLS, "auto", None, auto_parser="hermes")
    pieces = ["\n Let", " me <", "see <tool_call>", '{"name": "add", "arguments": {"a": 1}}</tool_call>']
    streamed = "".join(d.get("content") or "" for d in stream_deltas(ChatFormat(1, None, plan), pieces))
    content = ChatFormat(1, None, plan)._message("".join(pieces), "stop")[0]["content"]
    assert content == "\n Let me <see" and streamed.rstrip() == content


def test_required_calls_stream_as_they_are_written():
    """tool_choice "required": each call's first delta carries its index, id and name, the next
    ones pieces of its arguments, which add up to the unstreamed reply's calls."""
    from coordinator.openai_responses import ChatFormat
    from tests.test_reasoning_parsers import stream_deltas

    plan = tool_call_plan(TOOLS, "required", None)
    text = '[{"name":"get_weather","parameters":{"city":"Pa\\"ris","days":2}},{"name":"add","parameters":{"a":1}}]'
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    whole, finish = ChatFormat(1, None, plan)._message(text, "stop")
    assert finish == "tool_calls" and whole["content"] is None
    calls = [tc for d in stream_deltas(ChatFormat(1, None, plan), pieces) for tc in d.get("tool_calls", [])]
    heads = [tc for tc in calls if "id" in tc]
    assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "get_weather"), (1, "add")]
    assert all(h["id"].startswith("chatcmpl-tool-") and h["type"] == "function" for h in heads)
    for k, call in enumerate(whole["tool_calls"]):
        assert "".join(tc["function"]["arguments"] for tc in calls if tc["index"] == k) == call["function"]["arguments"]
    assert len(calls) > 6  # pieces, not whole calls at the end
    assert json.loads(whole["tool_calls"][0]["function"]["arguments"]) == {"city": 'Pa"ris', "days": 2}
    # Cut short before the array closes: the unstreamed reply is content, and so is the stream's end.
    cut = pieces[:5]
    assert ChatFormat(1, None, plan)._message("".join(cut), "length")[0] == {"content": "".join(cut)}
    assert stream_deltas(ChatFormat(1, None, plan), cut, "length")[-1] == {"content": "".join(cut)}


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "days": 2}}'
               '</tool_call>\n<tool_call>{"name":"add","arguments":{"a":1.5,"b":[1,"x"]}}</tool_call>'),
    ("hermes", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "days": 2}}, '
               '{"name": "add", "arguments": {"a": 1.5, "b": [1, "x"]}}]</tool_call>'),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "days": 2}}, '
                '{"name": "add", "arguments": {"a": 1.5,  "b": [1, "x"]}}]'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa\\"ris", "days": 2} [TOOL_CALLS]add[ARGS]'
                '{"a": 1.5, "b": [1, "x"]}'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa\\"ris", "days": 2}}; '
                    '{"name": "add", "parameters": {"a":1.5, "b":[1, "x"]}}'),
])
def test_auto_calls_stream_as_they_are_written(parser, text):
    """tool_choice "auto" with a JSON format: each call's first delta carries its index, id and
    name, the next ones pieces of its arguments, which add up to the unstreamed reply's calls (the
    arguments as the model wrote them); the text before the calls streams as content."""
    from coordinator.openai_responses import ChatFormat
    from tests.test_reasoning_parsers import stream_deltas

    plan = tool_call_plan(TOOLS, "auto", None, auto_parser=parser)
    whole, finish = ChatFormat(1, None, plan)._message(text, "stop")
    assert finish == "tool_calls" and [json.loads(c["function"]["arguments"]) for c in whole["tool_calls"]] == \
        [{"city": 'Pa"ris', "days": 2}, ADD[1]]
    for width in (1, 5):
        deltas = stream_deltas(ChatFormat(1, None, plan), [text[i:i + width] for i in range(0, len(text), width)])
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        heads = [tc for tc in calls if "id" in tc]
        assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "get_weather"), (1, "add")]
        for k, call in enumerate(whole["tool_calls"]):
            pieces = [tc["function"]["arguments"] for tc in calls if tc["index"] == k]
            assert "".join(pieces) == call["function"]["arguments"] and len(pieces) > 2  # pieces, not whole
        assert "".join(d.get("content") or "" for d in deltas).rstrip() == (whole["content"] or "")


def test_pythonic_calls_come_whole_once_the_reply_parses():
    from coordinator.openai_responses import ChatFormat
    from tests.test_reasoning_parsers import stream_deltas

    plan = tool_call_plan(TOOLS, "auto", None, auto_parser="pythonic")
    text = '[get_weather(city="Paris", days=2), add(a=1.5, b=[1, \'x\'])]'
    deltas = stream_deltas(ChatFormat(1, None, plan), [text[i:i + 4] for i in range(0, len(text), 4)])
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in calls] == [WEATHER, ADD]
    assert all("tool_calls" not in d for d in deltas[:-1])  # nothing before the end
