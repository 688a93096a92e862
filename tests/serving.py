"""A coordinator actor serving gRPC in the test session's Ray, for the tests of a running server."""

from __future__ import annotations

import contextlib
import time

import ray

from coordinator.actor import CoordinatorActor, config_dict
from coordinator.server_options import ServerOptions
from pagedserve.config import EngineConfig


@contextlib.contextmanager
def running_coordinator(config: EngineConfig, env: dict[str, str] | None = None, **options):
    """Yields (actor, "127.0.0.1:port") once it serves; shuts it down after. `options`: ServerOptions
    fields (host 127.0.0.1 and free gRPC and HTTP ports unless given); `env`: variables of the
    actor's process."""
    before = live_placement_groups()
    actor = CoordinatorActor.options(runtime_env={"env_vars": env} if env else None).remote()
    try:
        options = ServerOptions(**{"host": "127.0.0.1", "port": 0, "http_port": 0, **options})
        port = ray.get(actor.start.remote(config_dict(config), options), timeout=180)
        yield actor, f"127.0.0.1:{port}"
    finally:
        ray.get(actor.shutdown.remote(), timeout=60)
        ray.kill(actor)
    # A shut-down server holds no CPUs: a placement group left behind (a replica rebuilt while
    # it stopped, say) would starve every later test's workers in the session's Ray.
    leaked = live_placement_groups() - before
    assert not leaked, f"the server left placement groups behind after its shutdown: {sorted(leaked)}"


def assert_idle(actor, timeout: float = 30.0) -> None:
    """Wait until the served engine runs nothing and holds no KV block; fail if it does not."""
    deadline = time.monotonic() + timeout
    while True:
        stats = ray.get(actor.stats.remote(), timeout=30)
        if (stats["num_requests_running"] == 0 and stats["kv_blocks_used"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stats["num_requests_running"] == 0 and stats["kv_blocks_used"] == 0, stats


def live_placement_groups() -> set[str]:
    """Ids of the session's placement groups that still hold (or wait for) resources."""
    return {pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"}


def offline_greedy(offline, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens (EOS ignored) of the offline API `offline` (an LLM) for token-id prompts: what
    a served stream of the same prompts must equal."""
    from pagedserve import SamplingParams

    outs = offline.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
