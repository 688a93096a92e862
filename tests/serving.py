"""A coordinator actor serving gRPC in the test session's Ray, for the tests of a running server."""

from __future__ import annotations

import contextlib

import ray

from coordinator.actor import CoordinatorActor, config_dict
from pagedserve.config import EngineConfig


@contextlib.contextmanager
def running_coordinator(config: EngineConfig, **start_kwargs):
    """Yields (actor, "127.0.0.1:port") once it serves; shuts it down after."""
    actor = CoordinatorActor.remote()
    try:
        port = ray.get(actor.start.remote(config_dict(config), "127.0.0.1", 0, **start_kwargs), timeout=180)
        yield actor, f"127.0.0.1:{port}"
    finally:
        ray.get(actor.shutdown.remote(), timeout=60)
        ray.kill(actor)
