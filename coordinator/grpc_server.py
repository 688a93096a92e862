"""The gRPC face of the engine: `pagedserve.v1.Serving` (streaming Generate, GetStats), the
standard health service and server reflection, on a grpc.aio server."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.async_engine import AsyncEngine, QueueFullError
from coordinator.sampling_params import SamplingParams
from pagedserve.v1 import serving_pb2, serving_pb2_grpc

SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Serving"].full_name


def sampling_from_proto(msg: serving_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; bad values raise ValueError."""
    kwargs = {name: getattr(msg, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens")
              if msg.HasField(name)}
    return SamplingParams(min_tokens=msg.min_tokens, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                          ignore_eos=msg.ignore_eos, **kwargs)


class ServingServicer(serving_pb2_grpc.ServingServicer):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def _prompt(self, request: serving_pb2.GenerateRequest) -> tuple[str | None, list[int] | None]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return request.text, None
        if kind == "token_ids":
            return None, list(request.token_ids.ids)
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages:
                raise ValueError("chat.messages must not be empty")
            return None, self.engine.engine.chat_prompt_ids(messages)
        raise ValueError("prompt: set one of text, chat or token_ids")

    async def Generate(self, request, context):
        try:
            prompt, token_ids = self._prompt(request)
            params = sampling_from_proto(request.sampling)
            stream = self.engine.generate(prompt, token_ids, params, request.request_id)
            first = await anext(stream)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        try:
            out = first
            while True:
                yield _response(out)
                if out.finished:
                    break
                out = await anext(stream)
        finally:
            # A cancelled or expired stream arrives here as CancelledError: closing the stream
            # now aborts the request and frees its blocks before the next step.
            await stream.aclose()

    async def GetStats(self, request, context):
        stats = await self.engine.stats()
        return serving_pb2.GetStatsResponse(stats={k: float(v) for k, v in stats.items()})


def _response(out) -> serving_pb2.GenerateResponse:
    completion = out.outputs[0]
    resp = serving_pb2.GenerateResponse(request_id=out.request_id, token_ids=out.delta_token_ids,
                                        text=out.delta_text)
    if out.finished:
        m = out.metrics
        resp.finish_reason = completion.finish_reason or ""
        resp.stop_reason = "" if completion.stop_reason is None else str(completion.stop_reason)
        resp.usage.prompt_tokens = len(out.prompt_token_ids)
        resp.usage.completion_tokens = len(completion.token_ids)
        resp.usage.cached_prompt_tokens = m.num_cached_tokens
        if m.first_scheduled_time is not None:
            resp.timing.queue_s = m.first_scheduled_time - m.arrival_time
        if m.first_token_time is not None:
            resp.timing.time_to_first_token_s = m.first_token_time - m.arrival_time
        if m.finished_time is not None:
            resp.timing.total_s = m.finished_time - m.arrival_time
    return resp


async def start_server(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 50051) -> tuple[grpc.aio.Server, int]:
    """Serve on host:port (port 0 picks a free one); returns the server and its port."""
    # so_reuseport=0: otherwise a second server binds the same port silently.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    serving_pb2_grpc.add_ServingServicer_to_server(ServingServicer(engine), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, bound
