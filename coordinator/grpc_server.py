"""The gRPC face of the engine: `pagedserve.v1.Serving` (streaming Generate, GetStats), the
standard health service and server reflection, on a grpc.aio server.

Everything a request is judged by lives in a `ServerState` shared with the other transports:
this module only speaks gRPC. A server can bind before its engine exists (the model loads in the
background): health says NOT_SERVING and Serving calls answer UNAVAILABLE while the state is not
serving; health turns SERVING with it, and NOT_SERVING again for good when the engine loop fails.
Optional bearer-token auth (an interceptor) guards the Serving methods; health and reflection stay
open. Optional TLS.
"""

from __future__ import annotations

import json
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.async_engine import (AsyncEngine, DeadlineExceededError, EngineDeadError, QueueFullError,
                                     RequestFailedError)
from coordinator.generation_defaults import GenerationDefaults
from coordinator.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from coordinator.server_state import ServerState
from pagedserve.v1 import serving_pb2, serving_pb2_grpc

SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Serving"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The gRPC code of each status kind (server_state.error_kind).
GRPC_CODES = {"invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
              "queue_full": grpc.StatusCode.RESOURCE_EXHAUSTED,
              "unavailable": grpc.StatusCode.UNAVAILABLE,
              "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
              "deadline_exceeded": grpc.StatusCode.DEADLINE_EXCEEDED,
              "internal": grpc.StatusCode.INTERNAL}

log = logging.getLogger("pagedserve.server")


def sampling_from_proto(msg: serving_pb2.SamplingParams, defaults: GenerationDefaults | None = None) -> SamplingParams:
    """Unset optional fields take the model's generation defaults, else SamplingParams'; bad
    values raise ValueError."""
    kwargs = {name: getattr(msg, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "n", "best_of", "repetition_penalty",
        "logprobs", "skip_special_tokens", "beam_width", "length_penalty", "prompt_logprobs", "truncate_prompt_tokens")
        if msg.HasField(name)}
    defaults = defaults or GenerationDefaults()
    if "max_tokens" not in kwargs and defaults.max_tokens is not None:
        kwargs["max_tokens"] = defaults.max_tokens
    kwargs = defaults.fill({**kwargs, "use_beam_search": msg.use_beam_search})
    early = {"": False, "false": False, "true": True, "never": "never"}.get(msg.early_stopping.lower())
    if early is None:
        raise ValueError(f"early_stopping must be true, false or never; got {msg.early_stopping!r}")
    return SamplingParams(min_tokens=msg.min_tokens, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                          ignore_eos=msg.ignore_eos, presence_penalty=msg.presence_penalty,
                          frequency_penalty=msg.frequency_penalty, logit_bias=dict(msg.logit_bias) or None,
                          allowed_token_ids=list(msg.allowed_token_ids) or None,
                          include_stop_str_in_output=msg.include_stop_str_in_output, early_stopping=early,
                          structured_outputs=_structured_from_proto(msg), **kwargs)


def _structured_from_proto(msg: serving_pb2.SamplingParams) -> StructuredOutputsParams | None:
    kind = msg.WhichOneof("structured_output")
    if kind is None:
        if msg.disable_any_whitespace:
            raise ValueError("disable_any_whitespace needs a structured output (json_schema or json_object)")
        return None
    value = getattr(msg, kind)
    field = {"json_schema": "json"}.get(kind, kind)
    if kind == "choice":
        value = list(value.choices)
    return StructuredOutputsParams(**{field: value}, disable_any_whitespace=msg.disable_any_whitespace)


class ServingServicer(serving_pb2_grpc.ServingServicer):
    """The Serving methods over a ServerState; no state of their own."""

    def __init__(self, state: ServerState):
        self.state = state

    async def _fail(self, error: BaseException, context) -> None:
        kind = await self.state.request_failed(error)
        await context.abort(GRPC_CODES[kind], str(error))

    async def Generate(self, request, context):
        state = self.state
        if not state.serving:
            state.reject("unavailable")
            await context.abort(grpc.StatusCode.UNAVAILABLE, state.reason)
        try:
            prompt, token_ids, messages = _prompt(request)
            params = sampling_from_proto(request.sampling, state.engine.llm_engine.generation_defaults)
            if request.final_only:
                params.output_kind = RequestOutputKind.FINAL_ONLY
            # The client's deadline, else the server's default (request_timeout); gRPC also
            # cancels at the client's, which aborts the request the same way.
            timeout = context.time_remaining()
            if timeout is None:
                timeout = state.request_timeout
            stream = state.engine.generate(prompt, token_ids, params, request.request_id, request.priority,
                                           messages=messages, timeout=timeout, chat_options=_chat_options(request))
            first = await anext(stream)
        except (ValueError, QueueFullError, EngineDeadError, DeadlineExceededError, RequestFailedError) as e:
            await self._fail(e, context)
        try:
            out = first
            done: set[int] = set()  # samples whose last response has gone out
            first_response = True
            while True:
                responses = _responses(out, done, params.logprobs or 0)
                if first_response and out.prompt_logprobs is not None:
                    if not responses:
                        responses.append(serving_pb2.GenerateResponse(request_id=out.request_id))
                    responses[0].prompt_logprobs.extend(
                        _position_logprobs(step, token, params.prompt_logprobs)
                        for step, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:]))
                first_response = False
                for resp in responses:
                    yield resp
                if out.finished:
                    break
                try:
                    out = await anext(stream)
                except (EngineDeadError, DeadlineExceededError, RequestFailedError) as e:
                    await self._fail(e, context)
        finally:
            # A cancelled or expired stream arrives here as CancelledError: closing the stream
            # now aborts the request and frees its blocks before the next step.
            await stream.aclose()

    async def GetStats(self, request, context):
        if not self.state.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.state.reason)
        stats = await self.state.stats()
        return serving_pb2.GetStatsResponse(stats={k: float(v) for k, v in stats.items()})


def _prompt(request: serving_pb2.GenerateRequest) -> tuple[str | None, list[int] | None, list[dict] | None]:
    """(text, token ids, chat messages): exactly one is set; the engine tokenizes, off the loop."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text, None, None
    if kind == "token_ids":
        return None, list(request.token_ids.ids), None
    if kind == "chat":
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not messages:
            raise ValueError("chat.messages must not be empty")
        return None, None, messages
    raise ValueError("prompt: set one of text, chat or token_ids")


def _chat_options(request: serving_pb2.GenerateRequest) -> dict | None:
    """A chat prompt's template options (InputProcessor.chat_prompt_ids' keyword arguments);
    ValueError naming the field for kwargs that are not a JSON object."""
    if request.WhichOneof("prompt") != "chat":
        return None
    chat = request.chat
    options = {name: getattr(chat, name) for name in ("add_generation_prompt", "continue_final_message")
               if chat.HasField(name)}
    if chat.chat_template:
        options["chat_template"] = chat.chat_template
    if chat.chat_template_kwargs:
        try:
            kwargs = json.loads(chat.chat_template_kwargs)
        except ValueError as e:
            raise ValueError(f"chat_template_kwargs is not valid JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a JSON object; got {type(kwargs).__name__}")
        options["chat_template_kwargs"] = kwargs
    return options


def _responses(out, done: set[int], num_logprobs: int) -> list[serving_pb2.GenerateResponse]:
    """One response per sample with news (tokens, or its end); the request's totals ride on the
    very last one."""
    responses = []
    for completion in out.outputs:
        ended = completion.finish_reason is not None and completion.index not in done
        if not (completion.delta_token_ids or completion.delta_text or ended):
            continue
        resp = serving_pb2.GenerateResponse(request_id=out.request_id, index=completion.index,
                                            token_ids=completion.delta_token_ids, text=completion.delta_text)
        if completion.logprobs is not None and completion.delta_token_ids:
            new = completion.logprobs[len(completion.token_ids) - len(completion.delta_token_ids):]
            resp.logprobs.extend(_position_logprobs(step, token, num_logprobs)
                                 for step, token in zip(new, completion.delta_token_ids))
        if ended:
            done.add(completion.index)
            resp.finish_reason = completion.finish_reason
            resp.stop_reason = "" if completion.stop_reason is None else str(completion.stop_reason)
            if completion.cumulative_logprob is not None:
                resp.cumulative_logprob = completion.cumulative_logprob
        responses.append(resp)
    if out.finished:
        if not responses:  # nothing new, but the totals must still be sent
            responses.append(serving_pb2.GenerateResponse(request_id=out.request_id))
        last, m = responses[-1], out.metrics
        last.usage.prompt_tokens = len(out.prompt_token_ids)
        last.usage.completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        last.usage.cached_prompt_tokens = m.num_cached_tokens
        if m.first_scheduled_time is not None:
            last.timing.queue_s = m.first_scheduled_time - m.arrival_time
        if m.first_token_time is not None:
            last.timing.time_to_first_token_s = m.first_token_time - m.arrival_time
        if m.finished_time is not None:
            last.timing.total_s = m.finished_time - m.arrival_time
    return responses


def _position_logprobs(step: dict, token: int, k: int) -> serving_pb2.PositionLogprobs:
    """`step` holds the top k tokens (ranks 1..k) and the sampled one (which may rank lower)."""
    def entry(tid):
        lp = step[tid]
        return serving_pb2.TokenLogprob(token_id=tid, logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)

    top = sorted((tid for tid in step if step[tid].rank <= k), key=lambda t: step[t].rank)[:k]
    return serving_pb2.PositionLogprobs(sampled=entry(token), top=[entry(t) for t in top])


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Serving methods need `authorization: Bearer <token>` (checked by the ServerState); anything
    else answers UNAUTHENTICATED. Other services (health, reflection) stay open, so that probes need
    no secret."""

    def __init__(self, state: ServerState, guarded_prefix: str = f"/{SERVICE_NAME}/"):
        self._state = state
        self._prefix = guarded_prefix

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        got = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value if isinstance(value, str) else value.decode("latin-1")
        why = self._state.check_auth(got)
        return handler if why is None else _refusal(handler, why)


def _refusal(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class ServingServer:
    """The grpc.aio server over a ServerState: Serving (+ bearer auth when the state has a key),
    health (following the state), reflection, optional TLS.

        state = ServerState(api_key="...")
        server = ServingServer(state, tls=(cert_pem, key_pem))
        port = await server.start("127.0.0.1", 0)   # bound: NOT_SERVING, Generate -> UNAVAILABLE
        await state.set_engine(async_engine)        # SERVING until the engine loop fails
        await server.stop(grace=2)
    """

    def __init__(self, state: ServerState, tls: tuple[bytes, bytes] | None = None):
        self.state = state
        self.tls = tls
        self.servicer = ServingServicer(state)
        self.health = health.aio.HealthServicer()
        interceptors = [BearerTokenInterceptor(state)] if state.auth else []
        # so_reuseport=0: otherwise a second server binds the same port silently.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], interceptors=interceptors)
        serving_pb2_grpc.add_ServingServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self.server)
        state.add_listener(self._on_status)
        self.port = 0

    async def _on_status(self, status: str) -> None:
        if status == "stopping":
            await self.health.enter_graceful_shutdown()  # NOT_SERVING, and no later change
            return
        # Liveness ("") stays up while the workers restart; readiness (the service) does not.
        await self.health.set("", _SERVING if status in ("serving", "restarting") else _NOT_SERVING)
        await self.health.set(SERVICE_NAME, _SERVING if status == "serving" else _NOT_SERVING)

    async def start(self, host: str = "127.0.0.1", port: int = 50051) -> int:
        """Bind host:port (port 0 picks a free one) and start answering; returns the bound port."""
        await self._on_status(self.state.status)
        address = f"{host}:{port}"
        try:
            if self.tls is not None:
                cert, key = self.tls
                bound = self.server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
            else:
                bound = self.server.add_insecure_port(address)
        except RuntimeError as e:  # grpc raises RuntimeError when it cannot bind
            raise OSError(f"cannot bind {address}: {e}") from None
        if bound == 0:
            raise OSError(f"cannot bind {address}")
        await self.server.start()
        self.port = bound
        return bound

    async def stop(self, grace: float | None = None) -> None:
        """Stop the state (new requests are refused) and this server, open streams given `grace` s."""
        await self.state.stop()
        await self.health.enter_graceful_shutdown()  # a failed state does not change on stop()
        await self.server.stop(grace)


async def start_server(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 50051,
                       api_key: str | None = None, tls: tuple[bytes, bytes] | None = None,
                       request_timeout: float | None = None) -> tuple[ServingServer, int]:
    """Serve an engine that already runs on host:port (a ServerState of its own); returns the server
    and its port."""
    server = ServingServer(ServerState(api_key, request_timeout), tls)
    bound = await server.start(host, port)
    await server.state.set_engine(engine)
    return server, bound
