"""The coordinator as a Ray actor: it owns the engine (scheduler, block allocator) and serves gRPC.

One async actor: the gRPC server and the engine loop share its event loop, and engine steps run
in a worker thread (see AsyncEngine), so the actor stays responsive while the model computes.

`start` binds the gRPC server first and loads the model in a thread: until the model is loaded
health says NOT_SERVING and Generate answers UNAVAILABLE. `start(wait=True)` (the default)
returns once it serves; `start(wait=False)` returns the port at once and `wait_ready()` waits.

`pagedserve serve` creates it as a named actor (ACTOR_NAME in NAMESPACE) so that
`pagedserve stop` can find it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import ray

from pagedserve.config import EngineConfig

ACTOR_NAME = "pagedserve-coordinator"
DEFAULT_METRICS_PORT = 9400
NAMESPACE = "pagedserve"


@ray.remote(num_cpus=0)
class CoordinatorActor:
    def __init__(self):
        # The engine's ray.get calls (worker actors) run in threads, never on this actor's event
        # loop; Ray's warning about blocking gets in async actors would only mislead.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
        self._engine = None
        self._server = None
        self._load: asyncio.Task | None = None
        self._closing = False
        self._metrics = None  # MetricsServer
        self.port = 0
        self._info: dict = {}

    async def start(self, config: dict, host: str = "127.0.0.1", port: int = 50051,
                    max_queued_requests: int = 1024, api_key: str | None = None,
                    tls_cert: bytes | None = None, tls_key: bytes | None = None, wait: bool = True,
                    metrics_host: str = "127.0.0.1", metrics_port: int | None = None,
                    default_metrics: bool = False) -> int:
        """Bind the gRPC server and the Prometheus endpoint on metrics_host:metrics_port (0 picks a
        free port; None and `default_metrics`: DEFAULT_METRICS_PORT, or a free port when that one
        is taken; None alone: no endpoint), then load the model and start the engine loop; returns
        the bound gRPC port. TLS takes the PEM bytes of a certificate chain and its key."""
        from coordinator.grpc_server import ServingServer

        if self._server is not None:
            raise RuntimeError("this coordinator has already started")
        engine_config = EngineConfig(**config)
        if engine_config.distributed_executor_backend == "auto":
            # The server is the disaggregated shape: the engine here, the model in worker actors.
            engine_config = engine_config.replace(distributed_executor_backend="ray")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both a certificate and its private key")
        tls = (tls_cert, tls_key) if tls_cert is not None else None
        self._server = ServingServer(api_key, tls)
        self.port = await self._server.start(host, port)
        self._info = {"model": engine_config.model, "host": host, "port": self.port, "tls": tls is not None,
                      "auth": bool(api_key)}
        if metrics_port is not None:
            self._start_metrics(engine_config.model, metrics_host, metrics_port)
        elif default_metrics:
            try:
                self._start_metrics(engine_config.model, metrics_host, DEFAULT_METRICS_PORT)
            except OSError:  # another server on this machine has it: any free port (status says which)
                self._start_metrics(engine_config.model, metrics_host, 0)
        self._load = asyncio.get_running_loop().create_task(self._load_engine(engine_config, max_queued_requests))
        self._load.add_done_callback(lambda t: t.cancelled() or t.exception())  # reported by wait_ready
        if wait:
            await self.wait_ready()
        return self.port

    def _start_metrics(self, model: str, host: str, port: int) -> None:
        from coordinator.prometheus import MetricsServer, PagedserveCollector

        collector = PagedserveCollector(
            model, lambda: self._engine.engine if self._engine is not None else None,
            lambda: dict(self._server.rejected))
        self._metrics = MetricsServer(collector, host, port)
        self._info["metrics_port"] = self._metrics.port

    async def _load_engine(self, config: EngineConfig, max_queued_requests: int) -> None:
        from coordinator.async_engine import AsyncEngine
        from coordinator.engine import LLMEngine

        loop = asyncio.get_running_loop()
        try:
            # Loading takes seconds to minutes: a thread, never the event loop.
            engine = await loop.run_in_executor(None, LLMEngine, config)
        except BaseException as e:
            await self._server.set_failed(f"the model failed to load: {e}")
            raise
        if self._closing:
            await loop.run_in_executor(None, engine.shutdown)
            return
        self._engine = AsyncEngine(engine, max_queued_requests)
        self._engine.start()
        await self._server.set_engine(self._engine)

    async def wait_ready(self) -> dict:
        """Wait until the model is loaded and served; raises the load error if loading failed."""
        if self._load is None:
            raise RuntimeError("start() has not been called")
        await asyncio.shield(self._load)
        return await self.status()

    async def status(self) -> dict:
        """model, host, port, tls, auth, and state: loading, serving, failed or stopping (with
        the reason when not serving)."""
        if self._server is None:
            return {"state": "new"}
        return {**self._info, "state": self._server.state, "reason": self._server.reason}

    async def worker_pids(self) -> list[int]:
        """The process ids of the worker actors (for operators and fault tests)."""
        executor = self._engine.engine.executor if self._engine is not None else None
        return executor.worker_pids() if hasattr(executor, "worker_pids") else []

    async def stats(self) -> dict:
        if self._engine is None:
            raise RuntimeError(self._server.reason if self._server is not None else "not started")
        return await self._engine.stats()

    async def shutdown(self) -> None:
        """Stop answering (2 s of grace for open streams), stop the engine loop and its workers."""
        self._closing = True
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._server is not None:
            await self._server.stop(grace=2)
        if self._engine is not None:
            await self._engine.stop()
            await asyncio.get_running_loop().run_in_executor(None, self._engine.engine.shutdown)
            self._engine = None


def config_dict(config: EngineConfig) -> dict:
    return dataclasses.asdict(config)
