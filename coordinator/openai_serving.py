"""The OpenAI endpoints' request path over the AsyncEngine, free of HTTP: a request's prompts
become engine requests (admitted together or not at all), and their outputs OpenAI's responses
or stream chunks. The HTTP layer (http_server) only parses bodies and writes bytes.

Admission waits for each engine request's first output, as the gRPC door does: every refusal
(a bad value, a full queue, a server not serving) is known before the response starts, so it can
be an HTTP status; once a stream has begun, a failure can only be an error event inside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from coordinator.async_engine import AsyncEngine, QueueFullError
from coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest
from coordinator.openai_responses import ChatFormat, CompletionFormat, prompt_logprobs_json, usage
from coordinator.outputs import RequestOutput
from coordinator.reasoning_parsers import PARSERS as REASONING_PARSERS
from coordinator.reasoning_parsers import ThinkParser, reply_starts_inside
from coordinator.sampling_params import RequestOutputKind, SamplingParams
from coordinator.token_bytes import token_bytes_of


class RequestGroup:
    """The engine requests of one HTTP request, one per prompt, with their outputs merged in the
    order they come. Once admitted, a task per request reads its stream, so that `close()`
    aborts every request still running at once, without awaiting anything: it works even in a
    task being cancelled (a client that left). Their blocks are freed before the next step."""

    def __init__(self, streams: list, firsts: list[RequestOutput]):
        self.echo_only = False  # set: outputs show the prompt alone (max_tokens 0 with echo)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._running = len(streams)
        self._pumps: list[asyncio.Task] = []
        self.prompt_token_ids = [first.prompt_token_ids for first in firsts]  # per prompt
        for i, (stream, first) in enumerate(zip(streams, firsts)):
            self._queue.put_nowait((i, first))
            if not first.finished:
                self._pumps.append(asyncio.ensure_future(_pump(i, stream, self._queue)))

    @classmethod
    async def admit(cls, engine: AsyncEngine, prompts: list[tuple], params: SamplingParams, request_id: str,
                    priority: int, timeout: float | None, chat_options: dict | None = None,
                    max_tokens_field: str | None = None) -> RequestGroup:
        """`prompts`: (text, token ids, messages) each. Raises the first refusal (in prompt order)
        after aborting the others. `max_tokens_field`: the field that set params.max_tokens, which
        with each prompt must fit in max_model_len (None: the default, ended at max_model_len)."""
        if len(prompts) > engine.max_queued_requests:  # could never be admitted: not worth a retry
            raise ValueError(f"prompt holds {len(prompts)} prompts; at most {engine.max_queued_requests} "
                             "(the server's max_queued_requests) fit in one request")
        if len(prompts) > 1:
            prompts = await _checked(engine, prompts, params, priority, max_tokens_field)
        streams = [engine.generate(text, ids, dataclasses.replace(params), f"{request_id}-{i}", priority,
                                   messages=messages, timeout=timeout, chat_options=chat_options,
                                   max_tokens_field=max_tokens_field)
                   for i, (text, ids, messages) in enumerate(prompts)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        try:
            # The first failure ends the group at once: with FINAL_ONLY a first output is a whole
            # completion, which the other prompts would otherwise run to before it is raised.
            await asyncio.wait(firsts, return_when=asyncio.FIRST_EXCEPTION)
            error = next((f.exception() for f in firsts if f.done() and f.exception() is not None), None)
        except BaseException:  # cancelled (the client left): abort whatever got in
            await _close(streams, firsts)
            raise
        if error is not None:
            await _close(streams, firsts)
            raise error
        return cls(streams, [f.result() for f in firsts])

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) until every request has finished; raises a request's failure."""
        while self._running:
            i, out = await self._queue.get()
            if isinstance(out, BaseException):
                self._running = 0
                raise out
            if out.finished:
                self._running -= 1
            yield i, (_without_completion(out) if self.echo_only else out)

    async def finals(self) -> list[RequestOutput]:
        """Each request's finished output, in prompt order."""
        finals = {}
        async for i, out in self.outputs():
            if out.finished:
                finals[i] = out
        return [finals[i] for i in sorted(finals)]

    def running(self) -> bool:
        """Whether a request of the group still runs in the engine."""
        return any(not pump.done() for pump in self._pumps)

    def close(self) -> None:
        for pump in self._pumps:
            pump.cancel()  # the stream it reads aborts its request on the way out


async def _close(streams: list, firsts: list[asyncio.Future]) -> None:
    """Abort every request of a group that is not admitted: their first outputs' waits cancelled
    (a generator that a task is still running cannot be closed), then each stream closed."""
    for first in firsts:
        first.cancel()
    await asyncio.gather(*firsts, return_exceptions=True)
    await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


async def _checked(engine: AsyncEngine, prompts: list[tuple], params: SamplingParams, priority: int,
                   max_tokens_field: str | None) -> list[tuple]:
    """Every prompt of a request checked before any is queued, so that a refused request runs
    nothing; the refusal names the prompt. (text, token ids, None) each, for `generate` to take
    as they are (tokenized and truncated once)."""
    if engine.num_queued + len(prompts) > engine.max_queued_requests:
        raise QueueFullError(f"the queue cannot take {len(prompts)} more requests "
                             f"({engine.num_queued} of {engine.max_queued_requests} waiting)")
    checked = []
    for i, (text, ids, messages) in enumerate(prompts):
        try:
            ids = await engine.check_input(text, ids, dataclasses.replace(params), priority, messages,
                                           max_tokens_field=max_tokens_field)
        except ValueError as e:
            raise ValueError(f"{e} (prompt {i} of {len(prompts)})") from None
        checked.append((text, ids, None))
    return checked


def _without_completion(out: RequestOutput) -> RequestOutput:
    """`out` as if nothing had been generated: the engine's one token dropped from every sample."""
    samples = [dataclasses.replace(c, text="", token_ids=[], finish_reason="length" if c.finished() else None,
                                   stop_reason=None, cumulative_logprob=None,
                                   logprobs=None if c.logprobs is None else [], delta_text="", delta_token_ids=[])
               for c in out.outputs]
    return dataclasses.replace(out, outputs=samples, delta_text="", delta_token_ids=[])


async def _pump(i: int, stream, queue: asyncio.Queue) -> None:
    try:
        async for out in stream:
            queue.put_nowait((i, out))
    except Exception as e:
        queue.put_nowait((i, e))


class OpenAIServing:
    """Completions and chat over the engine a ServerState holds. Each method returns the whole
    response (a dict) or, for `stream`, a ChunkStream of chunks (dicts); the caller has
    checked auth, serving and the model name. ValueError (naming the field) and the engine's
    refusals are raised before any chunk."""

    def __init__(self, model_name: str, request_timeout: float | None, fingerprint: str,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        self.model_name = model_name
        self.request_timeout = request_timeout
        self.fingerprint = fingerprint
        self.tool_call_parser = tool_call_parser  # set: tool_choice "auto" is served (openai_tools.py)
        # set: chat replies' reasoning comes apart from their content (reasoning_parsers.py)
        self.reasoning = None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser]

    def _head(self, prefix: str, kind: str) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.model_name, "system_fingerprint": self.fingerprint}

    async def completions(self, engine: AsyncEngine, req: CompletionRequest) -> dict | ChunkStream:
        params = final_only_unless(req.stream, req.sampling_params(engine.llm_engine.generation_defaults))
        prompts = [(text, ids, None) for text, ids in req.prompts()]
        head = self._head("cmpl", "text_completion")
        group = await RequestGroup.admit(engine, prompts, params, head["id"], req.priority or 0, self.request_timeout,
                                         max_tokens_field=req.max_tokens_field())
        group.echo_only = req.echo_only
        fmt = CompletionFormat(params.n, params.logprobs, bool(req.echo), req.prompt_logprobs is not None,
                               engine.llm_engine.tokenizer, bool(req.return_token_ids),
                               bool(req.return_tokens_as_token_ids))
        if req.stream:
            return ChunkStream(group, _chunks(group, head, lambda i, out: fmt.deltas(i, out), req.include_usage,
                                              continuous_usage=req.continuous_usage))
        try:
            finals = await group.finals()
        finally:
            group.close()
        choices = [choice for i, out in enumerate(finals) for choice in fmt.whole(i, out)]
        return {**head, "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage(finals)}

    async def chat(self, engine: AsyncEngine, req: ChatCompletionRequest) -> dict | ChunkStream:
        tools = req.tool_call_plan(self.tool_call_parser)
        reasoning = ReasoningTags(self.reasoning, engine.llm_engine.tokenizer)
        params = final_only_unless(req.stream, reasoning.constrain_after(
            req.sampling_params(tools, engine.llm_engine.generation_defaults)))
        prompts = [(None, None, req.conversation())]
        head = self._head("chatcmpl", "chat.completion")
        group = await RequestGroup.admit(engine, prompts, params, head["id"], req.priority or 0,
                                         self.request_timeout, req.chat_options(), req.max_tokens_field())
        fmt = ChatFormat(params.n, params.logprobs, tools, self.reasoning,
                         reasoning.starts_inside(params, group.prompt_token_ids[0]),
                         token_bytes_of(engine.llm_engine.tokenizer) if params.logprobs is not None else None,
                         bool(req.return_token_ids),
                         bool(req.return_tokens_as_token_ids))
        prompt_ids = {"prompt_token_ids": list(group.prompt_token_ids[0])} if req.return_token_ids else {}
        if req.stream:
            head["object"] = "chat.completion.chunk"
            return ChunkStream(group, _chunks(group, head, lambda i, out: fmt.deltas(out), req.include_usage,
                                              first=fmt.first_deltas(params.n), continuous_usage=req.continuous_usage,
                                              first_fields=prompt_ids))
        try:
            (final,) = await group.finals()
        finally:
            group.close()
        response = {**head, "choices": fmt.whole(final), "usage": usage([final]), **prompt_ids}
        if req.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(final)
        return response


def final_only_unless(stream: bool, params: SamplingParams) -> SamplingParams:
    """A response sent whole needs the engine's final outputs only: none is built per token."""
    return params if stream else dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


class ReasoningTags:
    """Where a chat reply's reasoning is, under the server's reasoning parser (`parser`, or None)
    and its tokenizer: whether the reply starts inside a think block, and, for a constrained
    reply, a grammar that starts after the block (as vLLM runs structured outputs with a
    reasoning parser), where the tags are tokens of the model."""

    def __init__(self, parser: ThinkParser | None, tokenizer):
        self.parser = parser
        self.ids = None if parser is None else parser.tag_ids(tokenizer)

    def constrain_after(self, params: SamplingParams) -> SamplingParams:
        """`params` with its grammar (if any) told the tags: it waits out a block the reply starts in."""
        so = params.structured_outputs
        if so is None or self.ids is None:
            return params
        return dataclasses.replace(params, structured_outputs=dataclasses.replace(
            so, reasoning=(*self.ids, self.parser.implicit_start)))

    def starts_inside(self, params: SamplingParams, prompt_token_ids: list[int]) -> bool | None:
        """For ChatFormat: the engine's decision for this prompt (None: the parser's own reading)."""
        if self.parser is None:
            return None
        if self.ids is None:  # a grammar then applies from the first token: no block unless it writes one
            return False if params.structured_outputs is not None else None
        return reply_starts_inside(prompt_token_ids, *self.ids, self.parser.implicit_start)


class ChunkStream:
    """The chunks of a streamed response. `aclose()` aborts what still runs, whether iteration
    began or not (closing a generator that never started runs none of its code)."""

    def __init__(self, group: RequestGroup, chunks: AsyncIterator[dict]):
        self._group, self._chunks = group, chunks

    def __aiter__(self) -> AsyncIterator[dict]:
        return self._chunks

    async def aclose(self) -> None:
        self._group.close()
        await self._chunks.aclose()


async def _chunks(group: RequestGroup, head: dict, deltas, include_usage: bool,
                  first: list[dict] | None = None, continuous_usage: bool = False,
                  first_fields: dict | None = None) -> AsyncIterator[dict]:
    """Chunks as outputs come; with include_usage every chunk has `usage: null` (the usage so
    far, with `continuous_usage`) and a last one (no choices) carries the totals. `first`: the
    first chunk's choices, and `first_fields` its other fields beside head's."""
    extra = {"usage": None} if include_usage else {}
    latest: dict[int, RequestOutput] = {}  # each prompt's output so far
    try:
        if first:
            prompt = sum(len(ids) for ids in group.prompt_token_ids)
            if continuous_usage:
                extra = {"usage": {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}}
            yield {**head, "choices": first, **extra, **(first_fields or {})}
        async for i, out in group.outputs():
            latest[i] = out
            choices = deltas(i, out)
            if choices:
                if continuous_usage:
                    extra = {"usage": usage(list(latest.values()))}
                yield {**head, "choices": choices, **extra}
        if include_usage:
            yield {**head, "choices": [], "usage": usage([latest[i] for i in sorted(latest)])}
    finally:
        group.close()
