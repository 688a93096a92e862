"""Client SDK for a pagedserve server: `Client` (blocking) and `AsyncClient` (asyncio).

    client = Client("127.0.0.1:50051")
    client.generate("Hello", max_tokens=16, temperature=0).text
    for chunk in client.stream("Hello"): print(chunk.text, end="")

A prompt is a string, a list of token ids, or a list of chat messages
(`{"role": ..., "content": ...}`, rendered by the server's chat template). Keyword arguments are
the fields of SamplingParams. Errors raise ServingError with the gRPC `.code` and `.details`.
A structured output is one keyword: `client.generate(prompt, json_schema={...})`, `regex=...`,
`choice=[...]`, `grammar=...` (Lark) or `json_object=True`. A chat prompt also takes the chat
API's template options: `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`
(a dict) and `chat_template` (if the server trusts requests with one).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
from google.protobuf import descriptor

from pagedserve.v1 import serving_pb2 as pb
from pagedserve.v1 import serving_pb2_grpc

_HEALTH_SERVICE = "pagedserve.v1.Serving"


class ServingError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(slots=True)
class Chunk:
    token_ids: list[int]
    text: str
    index: int = 0  # which sample, with n > 1
    # Per token, with logprobs=k: {"token_id", "logprob", "rank", "decoded_token", "top": [...]}.
    logprobs: list[dict] = field(default_factory=list)


@dataclass(slots=True)
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    stop_reason: str = ""
    usage: dict = field(default_factory=dict)  # of the whole request (every sample)
    timing: dict = field(default_factory=dict)
    index: int = 0
    logprobs: list[dict] = field(default_factory=list)
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict] = field(default_factory=list)  # prompt tokens after the first


# Keyword arguments that belong to the request rather than to its SamplingParams.
_REQUEST_FIELDS = ("priority", "final_only")
# Keyword arguments of a chat prompt's template (ChatMessages' fields).
_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template")
# The members of SamplingParams' structured_output oneof.
_STRUCTURED_FIELDS = ("json_schema", "regex", "choice", "grammar", "json_object")


# The protobuf integer types' ranges: a value outside its field's range is refused here, by name
# (protobuf's own error, "Value out of range: -1", names neither the field nor the range).
_F = descriptor.FieldDescriptor
_INT_RANGES = {
    _F.TYPE_INT32: (-2**31, 2**31 - 1), _F.TYPE_SINT32: (-2**31, 2**31 - 1), _F.TYPE_SFIXED32: (-2**31, 2**31 - 1),
    _F.TYPE_UINT32: (0, 2**32 - 1), _F.TYPE_FIXED32: (0, 2**32 - 1),
    _F.TYPE_INT64: (-2**63, 2**63 - 1), _F.TYPE_SINT64: (-2**63, 2**63 - 1), _F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    _F.TYPE_UINT64: (0, 2**64 - 1), _F.TYPE_FIXED64: (0, 2**64 - 1),
}


def _check_int_ranges(message_type, fields: dict) -> None:
    """ValueError naming the first integer in `fields` outside its field's range in `message_type`."""
    for name, value in fields.items():
        field_type = getattr(message_type.DESCRIPTOR.fields_by_name.get(name), "type", None)
        if field_type in _INT_RANGES and isinstance(value, int) and not isinstance(value, bool):
            low, high = _INT_RANGES[field_type]
            if not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}]; got {value}")


def build_request(prompt, request_id: str = "", **sampling) -> pb.GenerateRequest:
    """`sampling`: SamplingParams' fields, and one structured output at most: `json_schema` (a dict
    or its JSON text), `regex`, `choice` (a list of strings), `grammar` (Lark) or `json_object=True`."""
    extra = {name: sampling.pop(name) for name in _REQUEST_FIELDS if name in sampling}
    chat_options = {name: sampling.pop(name) for name in _CHAT_FIELDS if sampling.get(name) is not None}
    if isinstance(chat_options.get("chat_template_kwargs"), dict):
        chat_options["chat_template_kwargs"] = json.dumps(chat_options["chat_template_kwargs"])
    structured = [name for name in _STRUCTURED_FIELDS if sampling.get(name) not in (None, False)]
    if len(structured) > 1:
        raise ValueError(f"set one structured output at most; got {', '.join(structured)}")
    if isinstance(sampling.get("json_schema"), dict):
        sampling["json_schema"] = json.dumps(sampling["json_schema"])
    if sampling.get("choice") is not None:
        sampling["choice"] = pb.Choices(choices=list(sampling["choice"]))
    _check_int_ranges(pb.SamplingParams, sampling)
    _check_int_ranges(pb.GenerateRequest, extra)
    params = pb.SamplingParams(**sampling)
    is_chat = not isinstance(prompt, str) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
    if chat_options and not is_chat:
        raise ValueError(f"{next(iter(chat_options))} applies to a chat prompt (a list of messages)")
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, sampling=params, request_id=request_id, **extra)
    prompt = list(prompt)
    if is_chat:
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt],
                               **chat_options)
        return pb.GenerateRequest(chat=chat, sampling=params, request_id=request_id, **extra)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params, request_id=request_id, **extra)


def _logprob(entry: pb.TokenLogprob) -> dict:
    return {"token_id": entry.token_id, "logprob": entry.logprob, "rank": entry.rank,
            "decoded_token": entry.decoded_token}


def _chunk(resp: pb.GenerateResponse) -> Chunk:
    logprobs = [{**_logprob(p.sampled), "top": [_logprob(t) for t in p.top]} for p in resp.logprobs]
    return Chunk(list(resp.token_ids), resp.text, resp.index, logprobs)


def _fold(completions: dict[int, Completion], resp: pb.GenerateResponse) -> None:
    """Add one response to the completion of its sample."""
    completion = completions.setdefault(resp.index, Completion(index=resp.index))
    if resp.prompt_logprobs:
        completion.prompt_logprobs = [{**_logprob(p.sampled), "top": [_logprob(t) for t in p.top]}
                                      for p in resp.prompt_logprobs]
    chunk = _chunk(resp)
    completion.token_ids += chunk.token_ids
    completion.text += chunk.text
    completion.logprobs += chunk.logprobs
    if resp.finish_reason:
        completion.finish_reason = resp.finish_reason
        completion.stop_reason = resp.stop_reason
        if resp.HasField("cumulative_logprob"):
            completion.cumulative_logprob = resp.cumulative_logprob
    if resp.HasField("usage"):  # the request's last response
        usage = {"prompt_tokens": resp.usage.prompt_tokens, "completion_tokens": resp.usage.completion_tokens,
                 "cached_prompt_tokens": resp.usage.cached_prompt_tokens}
        timing = {"queue_s": resp.timing.queue_s, "time_to_first_token_s": resp.timing.time_to_first_token_s,
                  "total_s": resp.timing.total_s}
        for c in completions.values():
            c.usage, c.timing = usage, timing


def _metadata(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def _channel(module, target: str, credentials: grpc.ChannelCredentials | None):
    return module.secure_channel(target, credentials) if credentials else module.insecure_channel(target)


class Client:
    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None, timeout: float | None = None):
        self._channel = _channel(grpc, target, credentials)
        self._stub = serving_pb2_grpc.ServingStub(self._channel)
        self._metadata = _metadata(token)
        self.timeout = timeout

    def stream(self, prompt, request_id: str = "", **sampling) -> Iterator[Chunk]:
        """Chunks as the server sends them (with n > 1, the samples' chunks interleave: see
        `Chunk.index`). Closing the iterator early cancels the request, and the server frees its
        blocks at once."""
        call = self._stub.Generate(build_request(prompt, request_id, **sampling),
                                   timeout=self.timeout, metadata=self._metadata)
        try:
            for resp in call:
                yield _chunk(resp)
        except grpc.RpcError as e:
            raise ServingError(e.code(), e.details()) from None
        finally:
            call.cancel()  # a no-op once the stream has ended

    def generate(self, prompt, request_id: str = "", **sampling) -> Completion:
        """The whole completion (the first sample's, with n > 1: see generate_all)."""
        return self.generate_all(prompt, request_id, **sampling)[0]

    def generate_all(self, prompt, request_id: str = "", **sampling) -> list[Completion]:
        """Every sample of the request (n of them), by index."""
        completions: dict[int, Completion] = {}
        sampling.setdefault("final_only", True)  # nothing sent per token
        try:
            for resp in self._stub.Generate(build_request(prompt, request_id, **sampling),
                                            timeout=self.timeout, metadata=self._metadata):
                _fold(completions, resp)
        except grpc.RpcError as e:
            raise ServingError(e.code(), e.details()) from None
        return [completions[i] for i in sorted(completions)]

    def stats(self) -> dict:
        try:
            return dict(self._stub.GetStats(pb.GetStatsRequest(), timeout=self.timeout,
                                            metadata=self._metadata).stats)
        except grpc.RpcError as e:
            raise ServingError(e.code(), e.details()) from None

    def health(self) -> bool:
        """Whether the server serves (gRPC's health check of the Serving service)."""
        from grpc_health.v1 import health_pb2

        try:
            reply = _health_stub(self._channel).Check(_health_request(), timeout=self.timeout or 5)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _health_stub(channel):
    from grpc_health.v1 import health_pb2_grpc

    return health_pb2_grpc.HealthStub(channel)


def _health_request():
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckRequest(service=_HEALTH_SERVICE)


class AsyncClient:
    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None, timeout: float | None = None):
        self._channel = _channel(grpc.aio, target, credentials)
        self._stub = serving_pb2_grpc.ServingStub(self._channel)
        self._metadata = _metadata(token)
        self.timeout = timeout

    async def stream(self, prompt, request_id: str = "", **sampling) -> AsyncIterator[Chunk]:
        call = self._stub.Generate(build_request(prompt, request_id, **sampling),
                                   timeout=self.timeout, metadata=self._metadata)
        try:
            async for resp in call:
                yield _chunk(resp)
        except grpc.RpcError as e:
            raise ServingError(e.code(), e.details()) from None
        finally:
            call.cancel()

    async def generate(self, prompt, request_id: str = "", **sampling) -> Completion:
        return (await self.generate_all(prompt, request_id, **sampling))[0]

    async def generate_all(self, prompt, request_id: str = "", **sampling) -> list[Completion]:
        completions: dict[int, Completion] = {}
        sampling.setdefault("final_only", True)  # nothing sent per token
        try:
            async for resp in self._stub.Generate(build_request(prompt, request_id, **sampling),
                                                  timeout=self.timeout, metadata=self._metadata):
                _fold(completions, resp)
        except grpc.RpcError as e:
            raise ServingError(e.code(), e.details()) from None
        return [completions[i] for i in sorted(completions)]

    async def stats(self) -> dict:
        try:
            reply = await self._stub.GetStats(pb.GetStatsRequest(), timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise ServingError(e.code(), e.details()) from None
        return dict(reply.stats)

    async def health(self) -> bool:
        """Whether the server serves (gRPC's health check of the Serving service)."""
        from grpc_health.v1 import health_pb2

        try:
            reply = await _health_stub(self._channel).Check(_health_request(), timeout=self.timeout or 5)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
