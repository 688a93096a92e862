"""The coordinator as a Ray actor: it owns the engine (scheduler, block allocator) and serves gRPC.

One async actor: the gRPC server and the engine loop share its event loop, and engine steps run
in a worker thread (see AsyncEngine), so the actor stays responsive while the model computes.

`start(config, ServerOptions(...))` binds the gRPC server first and loads the model in a thread:
until the model is loaded health says NOT_SERVING and Generate answers UNAVAILABLE. The front
door's state (loading / serving / failed / stopping, refusal counts, auth) is one ServerState,
shared by the transports and read by the Prometheus collector. `start(wait=True)` (the default)
returns once it serves; `start(wait=False)` returns the port at once and `wait_ready()` waits.

`pagedserve serve` creates it as a named actor (ACTOR_NAME in NAMESPACE) so that
`pagedserve stop` can find it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

import ray

from coordinator.server_options import ServerOptions
from pagedserve.config import EngineConfig

log = logging.getLogger("pagedserve.server")

ACTOR_NAME = "pagedserve-coordinator"
DEFAULT_METRICS_PORT = 9400
NAMESPACE = "pagedserve"


@ray.remote(num_cpus=0)
class CoordinatorActor:
    def __init__(self):
        # The engine's ray.get calls (worker actors) run in threads, never on this actor's event
        # loop; Ray's warning about blocking gets in async actors would only mislead.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
        self._async_engine = None  # AsyncEngine, once the model is loaded
        self._state = None  # ServerState
        self._drain_timeout = 30.0
        self._server = None  # ServingServer
        self._load: asyncio.Task | None = None
        self._closing = False
        self._metrics = None  # MetricsServer
        self.port = 0
        self._info: dict = {}

    async def start(self, config: dict, options: ServerOptions | None = None, wait: bool = True) -> int:
        """Bind the gRPC server and the Prometheus endpoint (see ServerOptions), then load the
        model and start the engine loop; returns the bound gRPC port. `wait=False` returns once
        bound; `wait_ready()` waits for the model."""
        from coordinator.grpc_server import ServingServer
        from coordinator.server_state import ServerState

        if self._server is not None:
            raise RuntimeError("this coordinator has already started")
        if options is None:
            options = ServerOptions()
        elif not isinstance(options, ServerOptions):
            raise TypeError(f"options must be a ServerOptions; got {type(options).__name__}")
        engine_config = EngineConfig(**config)
        if engine_config.distributed_executor_backend == "auto":
            # The server is the disaggregated shape: the engine here, the model in worker actors.
            engine_config = engine_config.replace(distributed_executor_backend="ray")
        self._state = ServerState(options.api_key, options.request_timeout)
        self._drain_timeout = options.drain_timeout
        self._server = ServingServer(self._state, options.tls)
        self.port = await self._server.start(options.host, options.port)
        self._info = {"model": engine_config.model, "host": options.host, "port": self.port,
                      "tls": options.tls is not None, "auth": self._state.auth,
                      "drain_timeout": options.drain_timeout}
        if options.metrics_port is not None:
            self._start_metrics(engine_config.model, options.metrics_host, options.metrics_port)
        elif options.default_metrics:
            try:
                self._start_metrics(engine_config.model, options.metrics_host, DEFAULT_METRICS_PORT)
            except OSError:  # another server on this machine has it: any free port (status says which)
                self._start_metrics(engine_config.model, options.metrics_host, 0)
        self._load = asyncio.get_running_loop().create_task(
            self._load_engine(engine_config, options.max_queued_requests))
        self._load.add_done_callback(lambda t: t.cancelled() or t.exception())  # reported by wait_ready
        if wait:
            await self.wait_ready()
        return self.port

    def _start_metrics(self, model: str, host: str, port: int) -> None:
        from coordinator.prometheus import MetricsServer, PagedserveCollector

        state = self._state  # read from the metrics thread: see ServerState on what is safe there
        collector = PagedserveCollector(
            model, lambda: state.engine.llm_engine if state.engine is not None else None,
            lambda: dict(state.rejected))
        self._metrics = MetricsServer(collector, host, port)
        self._info["metrics_port"] = self._metrics.port

    async def _load_engine(self, config: EngineConfig, max_queued_requests: int) -> None:
        from coordinator.async_engine import AsyncEngine
        from coordinator.engine import LLMEngine

        loop = asyncio.get_running_loop()
        try:
            # Loading takes seconds to minutes: a thread, never the event loop.
            engine = await loop.run_in_executor(None, LLMEngine.from_config, config)
        except BaseException as e:
            await self._state.set_failed(f"the model failed to load: {e}")
            raise
        if self._closing:
            await loop.run_in_executor(None, engine.shutdown)
            return
        self._async_engine = AsyncEngine(engine, max_queued_requests)
        self._async_engine.start()
        await self._state.set_engine(self._async_engine)

    async def wait_ready(self) -> dict:
        """Wait until the model is loaded and served; raises the load error if loading failed."""
        if self._load is None:
            raise RuntimeError("start() has not been called")
        await asyncio.shield(self._load)
        return await self.status()

    async def status(self) -> dict:
        """model, host, port, tls, auth, and state: loading, serving, failed or stopping (with
        the reason when not serving)."""
        if self._state is None:
            return {"state": "new"}
        return {**self._info, "state": self._state.status, "reason": self._state.reason}

    async def worker_pids(self) -> list[int]:
        """The process ids of the worker actors (for operators and fault tests)."""
        if self._async_engine is None:
            return []
        return self._async_engine.llm_engine.executor.worker_pids()

    async def stats(self) -> dict:
        """The engine's figures and the refusal counts, as GetStats answers."""
        if self._state is None:
            raise RuntimeError("not started")
        return await self._state.stats()

    async def shutdown(self) -> None:
        """Drain: refuse new requests (UNAVAILABLE), let those in flight finish for up to
        drain_timeout, end the rest with UNAVAILABLE; then stop the engine loop and its workers."""
        self._closing = True
        if self._state is not None:
            await self._state.stop()
        if self._async_engine is not None:
            unfinished = await self._async_engine.drain(self._drain_timeout)
            if unfinished:
                log.warning("drain time (%g s) passed; %d requests ended unfinished", self._drain_timeout, unfinished)
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._server is not None:
            await self._server.stop(grace=2)  # time for the last responses to go out
        if self._async_engine is not None:
            await self._async_engine.stop()
            await asyncio.get_running_loop().run_in_executor(None, self._async_engine.llm_engine.shutdown)
            self._async_engine = None


def config_dict(config: EngineConfig) -> dict:
    return dataclasses.asdict(config)
