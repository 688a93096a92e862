"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) over the chat
path, as vLLM serves it: a request's `instructions` and `input` items become chat messages, the
reply is formatted by the chat formatter (content, reasoning, tool calls), and its parts become
the Responses output items (`reasoning`, `message`, `function_call`), whole or as the Responses
stream's typed events. No I/O here beyond the engine; http_server writes the bytes.

- `input`: a string, or items: messages (roles user, system, developer, assistant; content a
  string or input_text / output_text parts), `function_call` and `function_call_output` items
  (a tool call and its result, for the next turn), `reasoning` items (dropped from the prompt,
  as the chat path drops earlier reasoning).
- `previous_response_id`: the conversation so far (its input and its output) comes first; a
  response is kept for this (and for GET) unless the request says `store: false`, in memory,
  the most recent `ResponseStore.capacity` of them. `instructions` apply to one response only.
- `conversation`: a conversation's items come first instead, and the response's input and output
  items join it when the reply finishes (conversations).
- `tools` (function tools), `tool_choice`, `text.format` (json_object, json_schema) and
  `reasoning.effort` (the chat template's `reasoning_effort` variable, as vLLM passes it) map to
  their chat counterparts; options this server cannot honour are refused, naming the field.
- `background`: POST answers with the response queued and the reply runs on; GET reads it, POST
  /v1/responses/{id}/cancel stops it; with `stream` too, POST streams its events and GET
  ?stream=true&starting_after=N streams them again from there (responses_background).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from coordinator.async_engine import AsyncEngine
from coordinator.conversations import Conversation, ConversationStore
from coordinator.input_processor import PromptError
from coordinator.openai_protocol import ChatCompletionRequest, _Body
from coordinator.openai_responses import ChatFormat, usage
from coordinator.openai_serving import ChunkStream, ReasoningTags, RequestGroup, final_only_unless
from coordinator.outputs import RequestOutput
from coordinator.response_items import copy_item, input_messages, stored_items
from coordinator.responses_background import BackgroundResponses, EventLog, Replay
from coordinator.token_bytes import token_bytes_of

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None  # optional with a conversation: its items are the prompt
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing to obfuscate here
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    store: bool | None = True
    truncation: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None  # accepted, unused
    safety_identifier: str | None = None  # accepted, unused
    prompt_cache_key: str | None = None  # accepted, unused: every prompt is prefix-cached
    service_tier: str | None = None  # accepted, unused
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None  # a conversation's id, or {"id": ...}
    max_tool_calls: int | None = None  # a cap on built-in tool calls: this server runs none, so it holds
    # Known, not implemented: refused unless unset
    prompt: Any = None
    # vLLM's extras (as on the chat endpoint)
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = 0
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.prompt:
            raise ValueError("prompt is not supported by this server; leave it unset")
        self.conversation_id()  # ValueError: malformed, or beside previous_response_id
        if self.background and self.store is False:
            raise ValueError("background requires store=true: a background response is read back from the store")
        if self.truncation not in (None, "disabled", "auto"):
            raise ValueError(f"truncation must be \"disabled\" (a prompt too long for the model is refused) or "
                             f"\"auto\" (its oldest turns are dropped); got {self.truncation!r}")
        if self.max_tool_calls is not None and self.max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be an integer >= 0; got {self.max_tool_calls}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be an integer >= 1; got {self.max_output_tokens}")
        unknown = sorted(set(self.text or {}) - {"format"})
        if unknown:
            raise ValueError(f"text.{unknown[0]} is not supported by this server; send text.format only")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")

    def conversation_id(self) -> str | None:
        """The conversation this response reads and extends; ValueError for a malformed one."""
        conversation = self.conversation
        if isinstance(conversation, dict):
            conversation = conversation.get("id")
            if not isinstance(conversation, str) or set(self.conversation) != {"id"}:
                raise ValueError(f'conversation must be a conversation id or {{"id": "conv_..."}}; '
                                 f"got {self.conversation!r}")
        if conversation is not None and self.previous_response_id is not None:
            raise ValueError("conversation cannot be used with previous_response_id: a response continues one "
                             "or the other")
        return conversation

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])

    def chat_request(self, history: list[dict]) -> ChatCompletionRequest:
        """The chat request this one is: `history` (a previous response's conversation) first.
        ValueError naming this request's field for what does not map."""
        self.check_supported()
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history
        if self.input is None and self.conversation is None:
            raise ValueError("input is required (only a response in a conversation may leave it out)")
        messages += input_messages(self.input or [], allow_empty=True)
        if len(messages) == bool(self.instructions):
            raise ValueError("input must hold at least one message (or the conversation must hold one)")
        kwargs = dict(self.chat_template_kwargs or {})
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
        fields = {name: getattr(self, name) for name in (
            "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "stop", "ignore_eos", "min_tokens", "skip_special_tokens", "priority",
            "structured_outputs", "parallel_tool_calls") if getattr(self, name) is not None}
        return ChatCompletionRequest(
            messages=messages, max_completion_tokens=self.max_output_tokens, stream=self.stream,
            logprobs=self.wants_logprobs or None, top_logprobs=self.top_logprobs if self.wants_logprobs else None,
            tools=chat_tools(self.tools), tool_choice=chat_tool_choice(self.tool_choice),
            response_format=response_format(self.text), chat_template_kwargs=kwargs or None, **fields)

    def echo(self) -> dict:
        """The request's settings as a Response object repeats them."""
        conversation = self.conversation_id()
        return {"background": bool(self.background), "instructions": self.instructions,
                "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "conversation": conversation and {"id": conversation},
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": self.previous_response_id,
                "reasoning": {"effort": (self.reasoning or {}).get("effort"),
                              "summary": (self.reasoning or {}).get("summary")},
                "store": self.store is not False, "temperature": 1.0 if self.temperature is None else self.temperature,
                "text": {"format": (self.text or {}).get("format") or {"type": "text"}},
                "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
                "tools": self.tools or [], "top_logprobs": self.top_logprobs,
                "top_p": 1.0 if self.top_p is None else self.top_p, "truncation": self.truncation or "disabled",
                "user": self.user, "max_tool_calls": self.max_tool_calls}


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools as the chat API's nested ones."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ValueError(f"tools[{i}].type must be \"function\" (the only kind of tool this server runs); "
                             f"got {tool.get('type')!r}")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ValueError(f"tools[{i}].name is required: a non-empty string")
        function = {"name": tool["name"]}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise ValueError('tool_choice {"type": "function"} needs "name": the function to call')
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None and not isinstance(choice, str):
        raise ValueError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "name": ...}}; '
                         f"got {choice!r}")
    return choice


def response_format(text: dict | None) -> dict | None:
    """`text.format` as the chat API's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type", "text") == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] != "json_schema":
        raise ValueError(f"text.format.type must be text, json_object or json_schema; got {fmt['type']!r}")
    if not isinstance(fmt.get("schema"), dict):
        raise ValueError("text.format.schema is required: the JSON schema, an object")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}


class ResponseStore:
    """The most recent stored responses, for GET and `previous_response_id`: each with the chat
    conversation it continues (its prompt's messages, then its reply as an assistant message) and
    its input items as stored (GET /v1/responses/{id}/input_items)."""

    capacity = 512

    def __init__(self) -> None:
        self._entries: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()
        self._inputs: dict[str, list[dict]] = {}

    def put(self, response: dict, conversation: list[dict] | None, inputs: list[dict] | None = None) -> None:
        """Store `response` (again); `inputs` None keeps the input items stored with it before."""
        self._entries[response["id"]] = (response, conversation)
        if inputs is not None:
            self._inputs[response["id"]] = inputs
        while len(self._entries) > self.capacity:
            self._inputs.pop(self._entries.popitem(last=False)[0], None)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        return self._entries.get(response_id)

    def input_items(self, response_id: str) -> list[dict]:
        return self._inputs.get(response_id, [])

    def delete(self, response_id: str) -> bool:
        self._inputs.pop(response_id, None)
        return self._entries.pop(response_id, None) is not None


class OutputItems:
    """A reply's output items as its chat deltas arrive, and the stream events that build them:
    a reasoning item, then a message, then one function_call item per call, each opened when its
    first piece comes and closed when the next begins or the reply ends."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.seq = 0
        self._open: dict | None = None
        self._calls: dict[int, dict] = {}  # the chat delta's call index -> its item

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def add(self, delta: dict, logprobs: list[dict] | None) -> list[dict]:
        """The events for one chat delta ({"reasoning_content", "content", "tool_calls"})."""
        events = []
        if delta.get("reasoning_content"):
            events += self._piece("reasoning", delta["reasoning_content"], None)
        if delta.get("content") or (logprobs and "content" in delta):  # logprobs go with the text
            events += self._piece("message", delta.get("content") or "", logprobs)
        for call in delta.get("tool_calls") or []:
            events += self._call_piece(call)
        return events

    def _piece(self, kind: str, text: str, logprobs: list[dict] | None) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            events += self._begin(kind)
        item = self._open
        at = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        part = item["content"][0]
        part["text"] += text
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **at, delta=text))
        else:
            part["logprobs"] += logprobs or []
            events.append(self.event("response.output_text.delta", **at, delta=text, logprobs=logprobs or []))
        return events

    def _begin(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                    "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                    "content": [], "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        self._open = item
        at = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        events = [self.event("response.output_item.added", output_index=len(self.items) - 1, item=copy_item(item))]
        item["content"].append(part)
        events.append(self.event("response.content_part.added", **at, part=dict(part)))
        return events

    def begin_empty_message(self) -> list[dict]:
        """A reply with no output so far is an empty message: its opening events."""
        return [] if self.items else self._begin("message")

    def _call_piece(self, call: dict) -> list[dict]:
        events = []
        item = self._calls.get(call["index"])
        arguments = call.get("function", {}).get("arguments") or ""
        if item is None:
            events += self.close()
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
            self._calls[call["index"]] = item
            self.items.append(item)
            self._open = item
            events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                     item=copy_item(item)))
        if arguments:
            item["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.items.index(item), delta=arguments))
        return events

    def close(self, complete: bool = True) -> list[dict]:
        """The events that finish the open item, if any (`complete` False: the reply was cut short
        by max_output_tokens, and its last item with it)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed" if complete else "incomplete"
        index = self.items.index(item)
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "reasoning":
                events.append(self.event("response.reasoning_text.done", **at, text=part["text"]))
            else:
                events.append(self.event("response.output_text.done", **at, text=part["text"],
                                         logprobs=part["logprobs"]))
            events.append(self.event("response.content_part.done", **at, part=dict(part)))
        events.append(self.event("response.output_item.done", output_index=index, item=copy_item(item)))
        return events

    def assistant_message(self) -> dict:
        """The reply as the chat message a next turn's prompt holds (its reasoning left out)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        message = {"role": "assistant", "content": text}
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        if calls:
            message["tool_calls"] = calls
        return message


def _usage(final: RequestOutput, reasoning_tokens: int) -> dict:
    """Chat's usage (openai_responses.usage) under the Responses API's names."""
    counts = usage([final])
    return {"input_tokens": counts["prompt_tokens"], "input_tokens_details": counts["prompt_tokens_details"],
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}, "total_tokens": counts["total_tokens"]}


async def _truncated(engine: AsyncEngine, messages: list[dict], chat_options: dict,
                     room: int) -> tuple[list[dict], list[int]]:
    """`truncation: "auto"`, as OpenAI's: the oldest turns dropped, whole (from a user message up to
    the next), the leading system messages kept, until the prompt leaves `room` new tokens in
    max_model_len; the last turn is kept even if alone it is too long (then refused as usual).
    Returns the messages kept and their rendered token ids (admitted as they are: no second render)."""
    processor = engine.llm_engine.input_processor
    loop = asyncio.get_running_loop()
    while True:
        ids = await loop.run_in_executor(None, lambda: processor.chat_prompt_ids(messages, **chat_options))
        if len(ids) + room <= processor.max_model_len:
            return messages, ids
        lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        later_user = next((i for i in range(lead + 1, len(messages)) if messages[i]["role"] == "user"), None)
        if later_user is None:
            return messages, ids
        messages = messages[:lead] + messages[later_user:]


@dataclasses.dataclass
class _Turn:
    """One response being made: what its reply is finished and stored with."""
    head: dict  # the Response object's fields known before the reply
    req: ResponsesRequest
    messages: list[dict]  # the prompt's chat messages: instructions, history, input
    inputs: list[dict]  # the request's input items as stored and listed
    conversation: Conversation | None  # the conversation it reads and extends
    engine: AsyncEngine
    rendered: list[int] | None = None  # `messages` already rendered to token ids (truncation did it)


class ResponsesServing:
    """/v1/responses over the engine: `create` returns the Response (a dict) or, streamed, a
    ChunkStream of events; ValueError (naming the field) and the engine's refusals come before
    any event. `history`: the chat messages the response continues (a previous response's, from
    `store.get`, or its conversation's); `conversation`: the Conversation it extends, if any."""

    def __init__(self, model_name: str, request_timeout: float | None, tool_call_parser: str | None, reasoning):
        self.model_name = model_name
        self.request_timeout = request_timeout
        self.tool_call_parser = tool_call_parser
        self.reasoning = reasoning  # the server's ThinkParser, or None
        self.store = ResponseStore()
        self.background = BackgroundResponses(self.store)
        self.conversations = ConversationStore()

    async def create(self, engine: AsyncEngine, req: ResponsesRequest, history: list[dict],
                     conversation: Conversation | None = None) -> dict | ChunkStream:
        chat = req.chat_request(history)
        tools = chat.tool_call_plan(self.tool_call_parser)
        reasoning = ReasoningTags(self.reasoning, engine.llm_engine.tokenizer)
        # A background reply shows in_progress from its first output on: it streams inside.
        params = final_only_unless(req.stream or req.background, reasoning.constrain_after(
            chat.sampling_params(tools, engine.llm_engine.generation_defaults)))
        head = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
                "model": self.model_name, **req.echo(), "temperature": params.temperature, "top_p": params.top_p}
        messages, rendered = chat.conversation(), None
        if req.truncation == "auto":
            messages, rendered = await _truncated(engine, messages, chat.chat_options(), req.max_output_tokens or 1)
        turn = _Turn(head, req, messages, stored_items(req.input or [], "input"), conversation, engine, rendered)
        field = "max_output_tokens" if req.max_output_tokens is not None else None
        if conversation is None:
            return await self._start_naming_input(turn, chat, tools, reasoning, params, field)
        conversation.check_room(len(turn.inputs) + 1, "conversation")
        conversation.lock(lambda: True)  # until the reply runs, then while it runs
        try:
            return await self._start_naming_input(turn, chat, tools, reasoning, params, field)
        except BaseException:
            conversation.unlock()
            raise

    async def _start_naming_input(self, *args) -> dict | ChunkStream:
        """_start, where a refusal of the rendered conversation names `input`, this API's field
        (the engine's checks name a chat's `messages` or a prompt's `prompt`)."""
        try:
            return await self._start(*args)
        except PromptError as e:
            if e.by_template:
                raise ValueError(f"input: the chat template refused it: {e.detail}") from None
            raise ValueError(f"input, as the chat template renders it: {e.detail}") from None

    async def _start(self, turn: _Turn, chat: ChatCompletionRequest, tools, reasoning: ReasoningTags, params,
                     field: str | None) -> dict | ChunkStream:
        """The response admitted (or queued, in the background): its object or its stream."""
        engine, req, head, conversation = turn.engine, turn.req, turn.head, turn.conversation

        async def admit(token_ids: list[int] | None = None) -> tuple[RequestGroup, ChatFormat]:
            """`token_ids`: the conversation already rendered (a background one's, checked; a
            truncated one's)."""
            prompt = (None, None, turn.messages) if token_ids is None else (None, token_ids, None)
            group = await RequestGroup.admit(engine, [prompt], params, head["id"], req.priority or 0,
                                             self.request_timeout, chat.chat_options(), field)
            if conversation is not None and not req.background:
                conversation.hold(group.running)
            return group, ChatFormat(1, params.logprobs, tools, self.reasoning,
                                     reasoning.starts_inside(params, group.prompt_token_ids[0]),
                                     token_bytes_of(engine.llm_engine.tokenizer) if params.logprobs is not None
                                     else None)

        if req.background:
            # Refusals (a prompt too long, a full queue) answer the POST; the reply runs on alone.
            engine.check_accepting(head["id"])
            token_ids = await engine.check_input(None, turn.rendered, params, req.priority or 0,
                                                 None if turn.rendered else turn.messages, chat.chat_options(), field)
            events = EventLog() if req.stream else None

            async def reply(started) -> None:
                group, fmt = await admit(token_ids)  # rendered and tokenized once, above
                running = started()
                if events is None:
                    await self._whole(group, fmt, turn)
                    return
                events.append({"type": "response.in_progress", "response": running})
                async for event in self._events(group, fmt, OutputItems(), turn, announced=True):
                    events.append(event)

            if conversation is not None:  # held until the background reply has an end state
                conversation.hold(lambda: self._unfinished(head["id"]))
            queued = self.background.start(head, reply, events, turn.inputs)
            return queued if events is None else Replay(events, -1)
        group, fmt = await admit(turn.rendered)
        if req.stream:
            return ChunkStream(group, self._events(group, fmt, OutputItems(), turn))
        return await self._whole(group, fmt, turn)

    def _unfinished(self, response_id: str) -> bool:
        stored = self.store.get(response_id)  # None: deleted, or evicted
        return stored is not None and stored[0]["status"] in ("queued", "in_progress")

    async def _whole(self, group: RequestGroup, fmt: ChatFormat, turn: _Turn) -> dict:
        """The finished Response of an admitted request, not streamed (stored unless store=false)."""
        try:
            (final,) = await group.finals()
        finally:
            group.close()
        (choice,) = fmt.whole(final)
        message = choice["message"]
        calls = [{"index": k, **call} for k, call in enumerate(message.get("tool_calls") or [])]
        items = OutputItems()
        items.add({"reasoning_content": message.get("reasoning_content"), "content": message.get("content"),
                   "tool_calls": calls}, (choice["logprobs"] or {}).get("content"))
        items.begin_empty_message()
        items.close(choice["finish_reason"] != "length")
        return self._finish(turn, items, final, choice["finish_reason"])

    async def _events(self, group: RequestGroup, fmt: ChatFormat, items: OutputItems, turn: _Turn,
                      announced: bool = False) -> AsyncIterator[dict]:
        """The stream's events; `announced`: response.created and .in_progress were sent already
        (a background response's, when it was queued and when it started)."""
        pending = {**turn.head, "status": "in_progress", "output": [], "usage": None, "error": None,
                   "incomplete_details": None}
        try:
            if not announced:
                yield items.event("response.created", response=pending)
                yield items.event("response.in_progress", response=pending)
            async for _, out in group.outputs():
                for choice in fmt.deltas(out):
                    for event in items.add(choice["delta"], (choice["logprobs"] or {}).get("content")):
                        yield event
                    if choice["finish_reason"] is not None:
                        for event in items.begin_empty_message() + items.close(choice["finish_reason"] != "length"):
                            yield event
                        response = self._finish(turn, items, out, choice["finish_reason"])
                        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                        yield items.event(kind, response=response)
        finally:
            group.close()

    def _finish(self, turn: _Turn, items: OutputItems, final: RequestOutput, finish_reason: str) -> dict:
        """The Response object of a finished reply (stored unless the request said not to); its
        input and output items join its conversation, if it has one."""
        complete = finish_reason != "length"
        reasoning = "".join(i["content"][0]["text"] for i in items.items if i["type"] == "reasoning")
        reasoning_tokens = len(turn.engine.llm_engine.tokenizer.encode(reasoning, add_special_tokens=False)) \
            if reasoning else 0
        response = {**turn.head, "status": "completed" if complete else "incomplete", "error": None,
                    "incomplete_details": None if complete else {"reason": "max_output_tokens"},
                    "output": [copy_item(i) for i in items.items], "usage": _usage(final, reasoning_tokens),
                    "completed_at": int(time.time()) if complete else None}
        if turn.conversation is not None:
            turn.conversation.add(turn.inputs + [copy_item(i) for i in items.items], field=None)
        if turn.req.store is not False:
            history = turn.messages[1:] if turn.req.instructions else turn.messages  # instructions: one turn only
            self.store.put(response, history + [items.assistant_message()], turn.inputs)
        return response
