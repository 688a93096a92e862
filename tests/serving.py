"""A coordinator actor serving gRPC in the test session's Ray, for the tests of a running server."""

from __future__ import annotations

import contextlib

import ray

from coordinator.actor import CoordinatorActor, config_dict
from coordinator.server_options import ServerOptions
from pagedserve.config import EngineConfig


@contextlib.contextmanager
def running_coordinator(config: EngineConfig, env: dict[str, str] | None = None, **options):
    """Yields (actor, "127.0.0.1:port") once it serves; shuts it down after. `options`: ServerOptions
    fields (host 127.0.0.1 and free gRPC and HTTP ports unless given); `env`: variables of the
    actor's process."""
    actor = CoordinatorActor.options(runtime_env={"env_vars": env} if env else None).remote()
    try:
        options = ServerOptions(**{"host": "127.0.0.1", "port": 0, "http_port": 0, **options})
        port = ray.get(actor.start.remote(config_dict(config), options), timeout=180)
        yield actor, f"127.0.0.1:{port}"
    finally:
        ray.get(actor.shutdown.remote(), timeout=60)
        ray.kill(actor)
