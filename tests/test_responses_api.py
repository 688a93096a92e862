"""OpenAI's Responses API (/v1/responses) of a live coordinator actor, driven by the official
`openai` client: replies equal the chat endpoint's for the same conversation, whole and as typed
stream events; conversations continue by `previous_response_id`; stored responses are read and
deleted; function tools, reasoning items and text.format; refusals name their field; nothing
is left holding a block. One server for the module, with a hermes tool parser and the qwen3
reasoning parser."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import jsonschema
import openai
import pytest
import ray

from pagedserve.config import EngineConfig
from tests.serving import assert_idle, running_coordinator

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}}


@pytest.fixture(scope="module")
def server(ray_session, tiny_llama):
    config = EngineConfig(model=tiny_llama, kv_cache_memory=1 << 22, distributed_executor_backend="uni")
    with running_coordinator(config, enable_auto_tool_choice=True, tool_call_parser="hermes",
                             reasoning_parser="qwen3") as (actor, _):
        port = ray.get(actor.status.remote())["http_port"]
        yield SimpleNamespace(actor=actor, url=f"http://127.0.0.1:{port}/v1", model=tiny_llama)
    # every test's requests finished or were aborted: no block is held
    # (checked in test_nothing_is_left_holding_a_block, the module's last test)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)


def _chat_text(client, server, messages, max_tokens):
    chat = client.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens, **GREEDY)
    return chat.choices[0].message.content, chat.usage


def test_a_reply_equals_the_chat_endpoints_for_the_same_conversation(client, server):
    response = client.responses.create(model=server.model, input="Hello there", max_output_tokens=8, **GREEDY)
    text, usage = _chat_text(client, server, [{"role": "user", "content": "Hello there"}], 8)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == text
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert message.status == "incomplete"  # cut short, as the response is
    # cut by max_output_tokens: incomplete, as OpenAI reports it
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 8 and response.usage.input_tokens == usage.prompt_tokens
    assert response.usage.total_tokens == usage.prompt_tokens + 8
    assert response.max_output_tokens == 8 and response.temperature == 0
    # instructions are a system message; items with text parts, developer read as system
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                              {"type": "input_text", "text": "there"}]}]
    response = client.responses.create(model=server.model, instructions="You help.", input=items,
                                       max_output_tokens=6, **GREEDY)
    text, usage = _chat_text(client, server, [{"role": "system", "content": "You help."},
                                              {"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hi\nthere"}], 6)
    assert response.output_text == text and response.usage.input_tokens == usage.prompt_tokens
    assert response.instructions == "You help."


def test_streamed_events_build_the_same_reply_in_order(client, server):
    whole = client.responses.create(model=server.model, input="Tell me", max_output_tokens=10, **GREEDY)
    events = list(client.responses.create(model=server.model, input="Tell me", max_output_tokens=10, stream=True,
                                          **GREEDY))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 10
    assert final.output[0].id == events[2].item.id == events[3].item_id  # one item throughout
    assert events[0].response.status == "in_progress" and final.status == "incomplete"


def test_a_conversation_continues_from_a_stored_response(client, server):
    first = client.responses.create(model=server.model, input="My name is Ada.", max_output_tokens=5, **GREEDY)
    second = client.responses.create(model=server.model, input="What is my name?", max_output_tokens=5,
                                     previous_response_id=first.id, **GREEDY)
    conversation = [{"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    text, usage = _chat_text(client, server, conversation, 5)
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    assert second.previous_response_id == first.id
    # GET returns the stored response; DELETE forgets it
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id),
                 lambda: client.responses.create(model=server.model, input="x", previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
    assert info.value.body["param"] == "previous_response_id" and first.id in info.value.body["message"]
    unstored = client.responses.create(model=server.model, input="x", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_tools_become_function_call_items_whole_and_streamed(client, server):
    body = {"tools": [WEATHER], "tool_choice": "required", "temperature": 1.0, "max_output_tokens": 60,
            "extra_body": {"seed": 4}}
    response = client.responses.create(model=server.model, input="Weather?", **body)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    named = client.responses.create(model=server.model, input="Weather?", tools=[WEATHER], max_output_tokens=40,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (call,) = named.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    events = list(client.responses.create(model=server.model, input="Weather?", stream=True, **body))
    streamed = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    for item in streamed:
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == item.id]
        done = [e for e in events if e.type == "response.function_call_arguments.done" and e.item_id == item.id]
        assert "".join(pieces) == item.arguments == done[0].arguments
    # the next turn sends the call and its result back as items
    follow = client.responses.create(
        model=server.model, tools=[WEATHER], tool_choice="none", max_output_tokens=4, **GREEDY,
        input=[{"role": "user", "content": "Weather?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert follow.output[0].type == "message" and follow.usage.output_tokens == 4


def test_reasoning_comes_as_its_own_item(client, server):
    """qwen3's parser: a regex makes the random model think in <think> tags, then answer."""
    shape = r"<think>[a-z]{3,8} [a-z]{3,8}</think>[a-z]{2,6}"
    body = {"input": "Think", "temperature": 1.0, "max_output_tokens": 60,
            "extra_body": {"seed": 5, "structured_outputs": {"regex": shape}}}
    response = client.responses.create(model=server.model, **body)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and re.fullmatch("[a-z]{3,8} [a-z]{3,8}", reasoning.content[0].text)
    assert re.fullmatch("[a-z]{2,6}", response.output_text)
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(model=server.model, stream=True, **body))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert thought == reasoning.content[0].text and said.strip() == response.output_text.strip()
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["reasoning", "message"]


def test_text_format_json_schema_and_logprobs(client, server):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": {**PERSON, "x-guidance":
                                                                          {"whitespace_flexible": False}}}}
    response = client.responses.create(model=server.model, input="Who?", text=fmt, max_output_tokens=80,
                                       temperature=0.8, extra_body={"seed": 1})
    jsonschema.validate(json.loads(response.output_text), PERSON)
    scored = client.responses.create(model=server.model, input="Hi", max_output_tokens=4, top_logprobs=2, **GREEDY)
    logprobs = scored.output[0].content[0].logprobs
    assert len(logprobs) == 4 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == scored.output_text


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "truncation": "middle"}, "truncation"),
    ({"input": "x", "max_tool_calls": -1}, "max_tool_calls"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
])
def test_refusals_name_their_field(server, body, param):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(server.url + "/responses", json.dumps({"model": server.model, **body}).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(info.value.read())["error"]
    assert info.value.code in (400, 404) and error["param"] == param, error
    assert param in error["message"]


@pytest.mark.parametrize("background", [False, True])
def test_an_input_too_long_once_rendered_is_refused_naming_input(client, server, background):
    """The engine's check of the rendered prompt, under this API's field name (not `messages`)."""
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=server.model, input="word " * 1100, background=background)  # > 1,024 tokens
    assert info.value.body["param"] == "input"
    assert info.value.body["message"].startswith("input, as the chat template renders it: prompt has "), info.value.body


def _settled(client, response_id: str, timeout: float = 60.0):
    """The stored response once it has left `queued` and `in_progress`."""
    deadline = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_a_background_response_runs_on_and_is_read_back(client, server):
    foreground = client.responses.create(model=server.model, input="Hello there", max_output_tokens=8, **GREEDY)
    queued = client.responses.create(model=server.model, input="Hello there", max_output_tokens=8, background=True,
                                     **GREEDY)
    assert queued.background is True and queued.status in ("queued", "in_progress") and queued.output == []
    done = _settled(client, queued.id)
    assert done.id == queued.id and done.status == "incomplete"  # cut by max_output_tokens, as in the foreground
    assert done.output_text == foreground.output_text and done.usage.output_tokens == 8
    # it continues a conversation like any stored response; cancelling a finished one changes nothing
    follow = client.responses.create(model=server.model, input="And?", previous_response_id=done.id,
                                     max_output_tokens=2, **GREEDY)
    assert follow.usage.input_tokens > done.usage.input_tokens
    assert client.responses.cancel(done.id).status == "incomplete"


def test_a_polled_background_response_shows_in_progress_while_it_runs(client, server):
    running = client.responses.create(model=server.model, input="Go on", max_output_tokens=900, background=True,
                                      **GREEDY)
    seen = [running.status]
    deadline = time.monotonic() + 60
    while seen[-1] == "queued" and time.monotonic() < deadline:
        time.sleep(0.02)
        seen.append(client.responses.retrieve(running.id).status)
    assert seen[-1] == "in_progress", seen  # not queued until it is done
    assert client.responses.cancel(running.id).status == "cancelled"


def test_a_background_response_is_cancelled_and_frees_its_blocks(client, server):
    generated = ray.get(server.actor.stats.remote(), timeout=30)["generation_tokens"]
    running = client.responses.create(model=server.model, input="Go on", max_output_tokens=900, background=True,
                                      **GREEDY)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.usage is None
    assert client.responses.cancel(running.id).status == "cancelled"  # the same final object every time
    assert client.responses.retrieve(running.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="cancelled"):
        client.responses.create(model=server.model, input="x", previous_response_id=running.id)
    # DELETE stops one still running too
    doomed = client.responses.create(model=server.model, input="Go on", max_output_tokens=900, background=True,
                                     **GREEDY)
    assert client.responses.delete(doomed.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(doomed.id)
    # only a background response may be cancelled
    plain = client.responses.create(model=server.model, input="x", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError, match="background") as info:
        client.responses.cancel(plain.id)
    assert info.value.body["param"] == "response_id"
    assert_idle(server.actor)
    # both stopped mid-reply: either alone would have generated 900 tokens
    assert ray.get(server.actor.stats.remote(), timeout=30)["generation_tokens"] - generated < 900


def test_a_background_request_is_checked_before_it_is_queued(client, server):
    with pytest.raises(openai.BadRequestError, match="max_output_tokens") as info:
        client.responses.create(model=server.model, input="x", max_output_tokens=5000, background=True)
    assert info.value.body["param"] == "max_output_tokens"


def test_a_streamed_background_response_survives_its_client_and_streams_again(client, server):
    foreground = client.responses.create(model=server.model, input="Hello there", max_output_tokens=8, **GREEDY)
    events = list(client.responses.create(model=server.model, input="Hello there", max_output_tokens=8,
                                          background=True, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert events[0].response.status == "queued" and events[2].response.status == "in_progress"
    assert kinds[-1] == "response.incomplete" and events[-1].response.output_text == foreground.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    response_id = events[0].response.id
    assert client.responses.retrieve(response_id).output_text == foreground.output_text
    # streamed again from any point: the same events, from the one after starting_after
    again = list(client.responses.retrieve(response_id, stream=True, starting_after=4))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[5:]]
    assert len(list(client.responses.retrieve(response_id, stream=True))) == len(events)

    # the client leaves after the first words: the reply runs on to its end, and a new stream
    # picks it up where the client left
    stream = client.responses.create(model=server.model, input="Go on", max_output_tokens=120, background=True,
                                     stream=True, **GREEDY)
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    stream.close()
    rest = list(client.responses.retrieve(seen[0].response.id, stream=True, starting_after=seen[-1].sequence_number))
    assert rest[-1].type == "response.incomplete" and rest[-1].response.usage.output_tokens == 120
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text == _settled(client, seen[0].response.id).output_text


def test_only_a_streamed_background_response_streams_again(client, server):
    import urllib.error
    import urllib.request

    plain = client.responses.create(model=server.model, input="x", max_output_tokens=2, **GREEDY)
    for query, param in [("stream=true", "stream"), ("starting_after=3", "starting_after")]:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{server.url}/responses/{plain.id}?{query}", timeout=30)
        assert info.value.code == 400 and json.loads(info.value.read())["error"]["param"] == param
    # a cancelled one's stream ends where it was cut; its events stay readable
    running = client.responses.create(model=server.model, input="Go on", max_output_tokens=900, background=True,
                                      stream=True, **GREEDY)
    first = next(iter(running))
    running.close()
    assert client.responses.cancel(first.response.id).status == "cancelled"
    replayed = list(client.responses.retrieve(first.response.id, stream=True))
    assert replayed[0].type == "response.created" and replayed[-1].type not in ("response.completed",
                                                                               "response.incomplete")
    with pytest.raises(openai.BadRequestError, match="starting_after") as info:
        list(client.responses.retrieve(first.response.id, stream=True, starting_after=-2))
    assert info.value.body["param"] == "starting_after"
    assert_idle(server.actor)


def test_nothing_is_left_holding_a_block(client, server):
    stream = client.responses.create(model=server.model, input="Go", max_output_tokens=200, stream=True, **GREEDY)
    for event in stream:
        if event.type == "response.output_text.delta":
            break
    stream.close()  # the client leaves mid-reply: the request is aborted
    assert_idle(server.actor)
