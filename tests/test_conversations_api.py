"""OpenAI's Conversations API (/v1/conversations) and `conversation` on the Responses API, on a live
coordinator actor driven by the official `openai` client: a response in a conversation sees the
conversation's items before its input (its reply equals the chat endpoint's over the same
messages), and its input and output items join the conversation when it finishes (whole,
streamed and in the background); items are added, listed a page at a time, read and deleted;
GET /v1/responses/{id}/input_items lists a response's input; refusals name their field and
disturb nothing; no block is left held."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import openai
import pytest
import ray

from coordinator.conversations import ConversationStore, check_metadata
from coordinator.response_items import InvalidField, item_page, stored_items
from pagedserve.config import EngineConfig
from tests.serving import assert_idle, running_coordinator

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(ray_session, tiny_llama):
    config = EngineConfig(model=tiny_llama, kv_cache_memory=1 << 22, distributed_executor_backend="uni")
    with running_coordinator(config) as (actor, _):
        port = ray.get(actor.status.remote())["http_port"]
        yield SimpleNamespace(actor=actor, url=f"http://127.0.0.1:{port}/v1", model=tiny_llama)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)


def _chat_text(client, server, messages, max_tokens: int) -> str:
    chat = client.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens, **GREEDY)
    return chat.choices[0].message.content


def _texts(items) -> list[tuple[str, str]]:
    """(role, text) of each message item."""
    return [(item.role, "".join(part.text for part in item.content)) for item in items if item.type == "message"]


def test_each_response_sees_the_conversation_and_joins_it(client, server):
    conversation = client.conversations.create(
        items=[{"type": "message", "role": "system", "content": "Answer briefly."},
               {"type": "message", "role": "user", "content": "My name is Ada."},
               {"type": "message", "role": "assistant", "content": "Hello Ada."}],
        metadata={"topic": "names"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "names"}
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "My name is Ada."},
                {"role": "assistant", "content": "Hello Ada."}]

    first = client.responses.create(model=server.model, conversation=conversation.id, input="What is my name?",
                                    max_output_tokens=6, **GREEDY)
    messages.append({"role": "user", "content": "What is my name?"})
    assert first.conversation.id == conversation.id
    assert first.output_text == _chat_text(client, server, messages, 6)
    messages.append({"role": "assistant", "content": first.output_text})

    # the second turn, streamed, names the conversation as an object: it sees the first turn
    stream = client.responses.create(model=server.model, conversation={"id": conversation.id}, input="Spell it.",
                                     max_output_tokens=6, stream=True, **GREEDY)
    done = [event for event in stream if event.type in ("response.completed", "response.incomplete")]
    messages.append({"role": "user", "content": "Spell it."})
    assert done[0].response.output_text == _chat_text(client, server, messages, 6)
    messages.append({"role": "assistant", "content": done[0].response.output_text})

    listed = list(client.conversations.items.list(conversation.id, order="asc", limit=3))  # pages of 3, followed
    assert _texts(listed) == [(m["role"], m["content"]) for m in messages]
    assert len({item.id for item in listed}) == len(messages) == 7
    assert listed[-1].id == done[0].response.output[0].id  # the output item joined as it was
    newest = client.conversations.items.list(conversation.id, limit=2)
    assert [item.id for item in newest.data] == [listed[-1].id, listed[-2].id] and newest.has_more
    after = client.conversations.items.list(conversation.id, limit=100, after=newest.last_id)
    assert [item.id for item in after.data] == [item.id for item in reversed(listed[:-2])] and not after.has_more


def test_items_are_added_read_and_deleted_and_the_next_response_follows(client, server):
    conversation = client.conversations.create()
    added = client.conversations.items.create(
        conversation.id, items=[{"type": "message", "role": "user", "content": "Remember: blue."},
                                {"type": "message", "role": "user", "content": "Remember: red."}])
    assert [text for _, text in _texts(added.data)] == ["Remember: blue.", "Remember: red."]
    item = client.conversations.items.retrieve(added.data[1].id, conversation_id=conversation.id)
    assert item.content[0].type == "input_text" and item.content[0].text == "Remember: red."

    client.conversations.items.delete(added.data[1].id, conversation_id=conversation.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.conversations.items.retrieve(added.data[1].id, conversation_id=conversation.id)
    assert info.value.body["param"] == "item_id"
    reply = client.responses.create(model=server.model, conversation=conversation.id, input="Which colour?",
                                    max_output_tokens=5, **GREEDY)
    assert reply.output_text == _chat_text(client, server, [{"role": "user", "content": "Remember: blue."},
                                                            {"role": "user", "content": "Which colour?"}], 5)

    updated = client.conversations.update(conversation.id, metadata={"colour": "blue"})
    assert updated.metadata == {"colour": "blue"} == client.conversations.retrieve(conversation.id).metadata
    assert client.conversations.delete(conversation.id).deleted
    for call in (lambda: client.conversations.retrieve(conversation.id),
                 lambda: client.conversations.items.list(conversation.id),
                 lambda: client.responses.create(model=server.model, conversation=conversation.id, input="x")):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert conversation.id in info.value.body["message"]
    assert info.value.body["param"] == "conversation"


def test_a_background_response_joins_its_conversation_when_it_finishes(client, server):
    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi."}])
    queued = client.responses.create(model=server.model, conversation=conversation.id, input="Tell me more.",
                                     max_output_tokens=8, background=True, **GREEDY)
    deadline = time.monotonic() + 60
    while client.responses.retrieve(queued.id).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
    done = client.responses.retrieve(queued.id)
    items = list(client.conversations.items.list(conversation.id, order="asc"))
    assert _texts(items) == [("user", "Hi."), ("user", "Tell me more."), ("assistant", done.output_text)]


def test_a_responses_input_items_are_listed(client, server):
    response = client.responses.create(
        model=server.model, max_output_tokens=2, **GREEDY,
        input=[{"type": "message", "role": "developer", "content": "Be terse."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "One"},
                                                                {"type": "input_text", "text": "Two"}]}])
    listed = client.responses.input_items.list(response.id)  # newest first
    assert [(item.role, [part.text for part in item.content]) for item in listed.data] == \
        [("user", ["One", "Two"]), ("developer", ["Be terse."])]
    oldest = client.responses.input_items.list(response.id, order="asc", limit=1)
    assert oldest.data[0].role == "developer" and oldest.has_more


def _refused(server, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data, {"Content-Type": "application/json"}, method=method)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    return info.value.code, json.loads(info.value.read())["error"]


@pytest.mark.parametrize("method,path,body,param", [
    ("POST", "/conversations", {"items": [{"type": "message", "role": "robot", "content": "x"}]}, "items"),
    ("POST", "/conversations", {"items": [{"type": "reasoning", "content": None, "summary": "not a list"}]}, "items"),
    ("POST", "/conversations", {"items": [{"type": "reasoning", "content": [3]}]}, "items"),
    ("POST", "/responses", {"model": None}, "input"),
    ("POST", "/conversations", {"items": [{"type": "message", "role": "user", "content": "x"}] * 21}, "items"),
    ("POST", "/conversations", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("POST", "/conversations", {"metadata": {"k": 1}}, "metadata"),
    ("POST", "/conversations", {"itemz": []}, "itemz"),
    ("GET", "/conversations/conv_missing", None, "conversation_id"),
    ("POST", "/responses", {"input": "x", "conversation": "conv_missing"}, "conversation"),
    ("POST", "/responses", {"input": "x", "conversation": {"name": "c"}}, "conversation"),
    ("POST", "/responses", {"input": "x", "conversation": "conv_x", "previous_response_id": "resp_x"},
     "conversation"),
])
def test_refusals_name_their_field_and_change_nothing(client, server, method, path, body, param):
    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Kept."}])
    code, error = _refused(server, method, path, body)
    assert code in (400, 404) and error["param"] == param and param in error["message"], error
    items = client.conversations.items.list(conversation.id)
    assert _texts(items.data) == [("user", "Kept.")]
    code, error = _refused(server, "POST", f"/conversations/{conversation.id}/items",
                           {"items": [{"type": "message", "role": "user", "content": "ok"},
                                      {"type": "function_call", "name": "f"}]})
    assert (code, error["param"]) == (400, "items") and "items[1].call_id" in error["message"]
    code, error = _refused(server, "GET", f"/conversations/{conversation.id}/items?limit=0")
    assert (code, error["param"]) == (400, "limit")
    code, error = _refused(server, "POST", f"/conversations/{conversation.id}/items", {"items": []})
    assert (code, error["param"]) == (400, "items")
    assert _texts(client.conversations.items.list(conversation.id).data) == [("user", "Kept.")]  # the valid one too


def test_reasoning_and_function_call_items_round_trip_and_input_may_be_left_out(client, server):
    conversation = client.conversations.create(items=[
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "call the tool"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    listed = list(client.conversations.items.list(conversation.id, order="asc"))
    assert [item.type for item in listed] == ["message", "reasoning", "function_call", "function_call_output"]
    assert listed[1].summary[0].text == "call the tool" and listed[3].output == "sunny"
    # no input: the conversation's items are the whole prompt (the tool's result is the last turn)
    reply = client.responses.create(model=server.model, conversation=conversation.id, max_output_tokens=4, **GREEDY)
    assert reply.status == "incomplete" and reply.output_text
    items = list(client.conversations.items.list(conversation.id, order="asc"))
    assert len(items) == 5 and items[-1].role == "assistant"


def test_one_response_at_a_time_runs_in_a_conversation(client, server):
    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi"}])
    running = client.responses.create(model=server.model, conversation=conversation.id, input="Go on",
                                      max_output_tokens=500, background=True, **GREEDY)
    with pytest.raises(openai.BadRequestError) as info:  # its history would be the turn before this one
        client.responses.create(model=server.model, conversation=conversation.id, input="And?", max_output_tokens=2)
    assert info.value.body["param"] == "conversation" and "locked" in info.value.body["message"]
    assert client.responses.cancel(running.id).status == "cancelled"
    after = client.responses.create(model=server.model, conversation=conversation.id, input="And?",
                                    max_output_tokens=2, **GREEDY)  # free again once it ended
    items = list(client.conversations.items.list(conversation.id, order="asc"))
    assert _texts(items) == [("user", "Hi"), ("user", "And?"), ("assistant", after.output_text)]  # no cancelled turn
    # a client that leaves a stream frees the conversation too
    stream = client.responses.create(model=server.model, conversation=conversation.id, input="More",
                                     max_output_tokens=300, stream=True, **GREEDY)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            client.responses.create(model=server.model, conversation=conversation.id, input="Last",
                                    max_output_tokens=1, **GREEDY)
            break
        except openai.BadRequestError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_truncation_auto_drops_the_oldest_turns_to_fit(client, server):
    max_len = client.models.list().data[0].max_model_len
    long_text = "lorem ipsum dolor sit amet " * (max_len // 20)  # ~1/4 of the context per message
    turns = [{"type": "message", "role": "system", "content": "Be brief."}]
    for k in range(3):
        turns += [{"type": "message", "role": "user", "content": f"{k}: {long_text}"},
                  {"type": "message", "role": "assistant", "content": f"{k}: {long_text}"}]
    conversation = client.conversations.create(items=turns)
    with pytest.raises(openai.BadRequestError) as info:  # too long for the model: refused, as by default
        client.responses.create(model=server.model, conversation=conversation.id, input="Sum up.",
                                max_output_tokens=8)
    assert info.value.body["param"] == "input" and "max_model_len" in info.value.body["message"]
    cut = client.responses.create(model=server.model, conversation=conversation.id, input="Sum up.",
                                  max_output_tokens=8, truncation="auto", **GREEDY)
    assert cut.truncation == "auto" and cut.usage.input_tokens + 8 <= max_len
    # the oldest whole turns went, the system message stayed: the reply is chat's over what is left
    kept = [{"role": "system", "content": "Be brief."}]
    for k in range(3):
        kept += [{"role": "user", "content": f"{k}: {long_text}"},
                 {"role": "assistant", "content": f"{k}: {long_text}"}]
    kept.append({"role": "user", "content": "Sum up."})
    while True:
        try:
            expected = _chat_text(client, server, kept, 8)
            break
        except openai.BadRequestError:
            kept = kept[:1] + kept[3:]  # a whole turn: its user and assistant messages
    assert cut.output_text == expected and len(kept) < 8
    queued = client.responses.create(model=server.model, conversation=conversation.id, input="Again.",
                                     max_output_tokens=8, truncation="auto", background=True, **GREEDY)
    deadline = time.monotonic() + 60  # truncated in the background too (untruncated, the POST is a 400)
    while client.responses.retrieve(queued.id).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.responses.retrieve(queued.id).status == "incomplete"
    capped = client.responses.create(model=server.model, input="x", max_tool_calls=3, max_output_tokens=1)
    assert capped.max_tool_calls == 3


def test_the_response_echoes_the_sampling_it_used(client, server):
    response = client.responses.create(model=server.model, input="Hi", max_output_tokens=1, top_p=0.5,
                                       temperature=0.25)
    assert (response.temperature, response.top_p) == (0.25, 0.5)


def test_nothing_is_left_holding_a_block(server):
    assert_idle(server.actor)


# The parts alone, without a server


def test_stored_items_get_ids_and_typed_parts():
    items = stored_items([{"type": "message", "role": "assistant", "content": "Hi"},
                          {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                          {"type": "function_call_output", "call_id": "c1", "output": "42"}], "items")
    assert [item["id"].split("_")[0] for item in items] == ["msg", "fc", "fco"]
    assert items[0]["content"] == [{"type": "output_text", "text": "Hi", "annotations": []}]
    assert stored_items("Hello", "input")[0]["content"] == [{"type": "input_text", "text": "Hello"}]
    with pytest.raises(InvalidField) as info:
        stored_items([{"type": "image"}], "items")
    assert info.value.param == "items" and "items[0].type" in str(info.value)


def test_pages_walk_every_item_once_in_either_order():
    items = [{"id": f"i{k}"} for k in range(7)]
    for order, expected in (("asc", [f"i{k}" for k in range(7)]), ("desc", [f"i{k}" for k in reversed(range(7))])):
        seen, after = [], None
        while True:
            page = item_page(items, after, 3, order)
            seen += [item["id"] for item in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert seen == expected
    assert item_page([], None, 20, "desc") == {"object": "list", "data": [], "first_id": None, "last_id": None,
                                               "has_more": False}
    for bad, param in (({"limit": 101}, "limit"), ({"order": "up"}, "order"), ({"after": "nope"}, "after")):
        with pytest.raises(InvalidField) as info:
            item_page(items, **{"after": None, "limit": 3, "order": "asc", **bad})
        assert info.value.param == param


def test_the_least_recently_used_conversation_goes_first(monkeypatch):
    monkeypatch.setattr(ConversationStore, "capacity", 2)
    store = ConversationStore()
    a, b = store.create(None, None), store.create(None, None)
    store.get(a.id)  # a is used again: b is now the oldest
    c = store.create(None, None)
    assert store.get(b.id) is None and store.get(a.id) is a and store.get(c.id) is c
    assert check_metadata({"k" * 64: "v" * 512}) == {"k" * 64: "v" * 512}
    with pytest.raises(InvalidField):
        check_metadata({"k" * 65: "v"})
