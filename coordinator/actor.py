"""The coordinator as a Ray actor: it owns the engine (scheduler, block allocator) and serves gRPC.

One async actor: the gRPC server and the engine loop share its event loop, and engine steps run
in a worker thread (see AsyncEngine), so the actor stays responsive while the model computes.
"""

from __future__ import annotations

import dataclasses

import ray

from pagedserve.config import EngineConfig

@ray.remote(num_cpus=0)
class CoordinatorActor:
    def __init__(self):
        self._engine = None
        self._server = None
        self.port = 0

    async def start(self, config: dict, host: str = "127.0.0.1", port: int = 50051,
                    max_queued_requests: int = 1024) -> int:
        """Load the model, start the engine loop and the gRPC server; returns the bound port."""
        from coordinator.async_engine import AsyncEngine
        from coordinator.engine import LLMEngine
        from coordinator.grpc_server import start_server

        engine = LLMEngine(EngineConfig(**config))
        self._engine = AsyncEngine(engine, max_queued_requests)
        self._engine.start()
        self._server, self.port = await start_server(self._engine, host, port)
        return self.port

    async def stats(self) -> dict:
        return await self._engine.stats()

    async def shutdown(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=2)
        if self._engine is not None:
            await self._engine.stop()


def config_dict(config: EngineConfig) -> dict:
    return dataclasses.asdict(config)
