"""The front door's state, shared by every transport (gRPC, HTTP): one object, no transport in it.

    loading --set_engine--> serving --the engine loop fails--> failed (for good)
    serving --a worker fault--> restarting --the worker group is rebuilt--> serving
    loading --set_failed (the model failed to load)--> failed
    loading, serving or restarting --stop--> stopping

Each transport answers from it: requests only while `status == "serving"`, else UNAVAILABLE (HTTP
503) with `reason`; the bearer-token check; the refusal counters (GetStats, /metrics); and the
status kind of every error a request can meet (`error_kind`, the one table; each transport maps a
kind to its own code). Transports that must act on a change (gRPC health, HTTP readiness) add a
listener: an async callable told each new status.

All of it lives on the server's event loop. The metrics thread reads `rejected` and `engine`
only: `rejected` holds every reason from the start, so its size never changes under a reader.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from coordinator.async_engine import AsyncEngine, DeadlineExceededError, EngineDeadError, QueueFullError
from workers.executor import WorkerFailedError

STATUSES = ("loading", "serving", "restarting", "failed", "stopping")
REJECT_REASONS = ("invalid_argument", "queue_full", "unavailable", "unauthenticated")
# The status kinds: every refusal reason, a passed deadline, and "internal" for a bug (the engine
# died under a request).
KINDS = (*REJECT_REASONS, "deadline_exceeded", "internal")

log = logging.getLogger("pagedserve.server")

Listener = Callable[[str], Awaitable[None]]


def error_kind(error: BaseException) -> str:
    """The status kind of an error raised by `AsyncEngine.generate` (or its stream): ValueError ->
    invalid_argument, QueueFullError -> queue_full, EngineDeadError -> unavailable when refused
    before it was queued or when the workers failed past their restart budget (a fail-stop, not a
    bug), internal when the engine loop itself failed under the request; anything else is a bug
    (internal). RequestFailedError (a poison request ended by the engine) is internal too."""
    if isinstance(error, EngineDeadError):
        if not error.in_flight or isinstance(error.cause, WorkerFailedError):
            return "unavailable"
        return "internal"
    if isinstance(error, QueueFullError):
        return "queue_full"
    if isinstance(error, DeadlineExceededError):
        return "deadline_exceeded"
    if isinstance(error, ValueError):
        return "invalid_argument"
    return "internal"


class ServerState:
    """loading / serving / failed / stopping with its reason, the engine once loaded, refusal
    counts by reason, and auth (`api_key` None: off)."""

    def __init__(self, api_key: str | None = None, request_timeout: float | None = None):
        """`request_timeout`: the deadline (seconds) of a request that brings none of its own."""
        if api_key is not None and not api_key:
            raise ValueError("the API key must not be empty (None turns auth off)")
        self.request_timeout = request_timeout
        self.status = "loading"
        self.reason = "the model is still loading"  # why requests are refused; "" while serving
        self.engine: AsyncEngine | None = None
        self.rejected: Counter = Counter(dict.fromkeys(REJECT_REASONS, 0))
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self._listeners: list[Listener] = []
        self._watcher: asyncio.Task | None = None

    @property
    def auth(self) -> bool:
        return self._expected is not None

    @property
    def serving(self) -> bool:
        return self.status == "serving"

    def add_listener(self, listener: Listener) -> None:
        """`await listener(status)` after each change of status, in the order added."""
        self._listeners.append(listener)

    async def _set(self, status: str, reason: str) -> None:
        # The status changes before any listener runs: a request arriving meanwhile sees it.
        self.status, self.reason = status, reason
        for listener in self._listeners:
            try:
                await listener(status)
            except Exception:  # one transport's bug must not keep the others uninformed
                log.exception("a listener failed on the change to %s", status)

    async def set_engine(self, engine: AsyncEngine) -> None:
        """The model is loaded and the engine loop runs: serve, and watch the loop for a failure."""
        if self.status != "loading":
            raise RuntimeError(f"the engine is set once, while loading; the server is {self.status}")
        self.engine = engine
        self._watcher = asyncio.get_running_loop().create_task(self._watch(engine))
        engine.add_restart_listener(self._workers_restarting)
        await self._set("serving", "")

    async def _workers_restarting(self, restarting: bool) -> None:
        """Not ready while the workers are rebuilt (in-flight streams wait, new requests are
        refused); serving again after, unless the server failed or stops meanwhile."""
        if restarting and self.status == "serving":
            await self._set("restarting", "workers restarting after a fault; retry shortly")
        elif not restarting and self.status == "restarting":
            await self._set("serving", "")

    async def set_failed(self, reason: str) -> None:
        """Failed for good: requests are refused with `reason`."""
        await self._set("failed", reason)

    async def _watch(self, engine: AsyncEngine) -> None:
        error = await engine.wait_stopped()
        if error is not None:
            await self.engine_died(error)

    async def engine_died(self, error: BaseException) -> None:
        """The engine loop failed (seen by the watcher, or by a request first)."""
        if self.status == "failed":
            return
        log.error("the engine loop failed: %r; the server refuses requests from now on", error)
        await self.set_failed(f"the engine failed: {error!r}")

    async def stop(self) -> None:
        """The server is shutting down: refuse new requests (a failed server keeps its reason)."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self.status in ("loading", "serving", "restarting"):
            await self._set("stopping", "the server is shutting down")

    def check_auth(self, authorization: str | None) -> str | None:
        """None when the `authorization` value (header or metadata) may pass, else why not; a
        refusal is counted. The comparison takes the same time wherever the value differs."""
        if self._expected is None:
            return None
        if authorization and hmac.compare_digest(authorization.encode("utf-8", "replace"), self._expected):
            return None
        self.rejected["unauthenticated"] += 1
        if authorization:
            return "wrong bearer token"
        return "missing bearer token (metadata 'authorization: Bearer <key>')"

    def reject(self, kind: str) -> None:
        """Count a refused request."""
        if kind not in REJECT_REASONS:
            raise ValueError(f"kind must be one of {', '.join(REJECT_REASONS)}; got {kind!r}")
        self.rejected[kind] += 1

    async def request_failed(self, error: BaseException) -> str:
        """A request met `error` (from `AsyncEngine.generate` or its stream): count the refusal or,
        when the engine died under it, log it with the request id and fail the server before the
        client hears of it; returns the status kind."""
        kind = error_kind(error)
        if isinstance(error, EngineDeadError) and error.in_flight:
            log.error("request %s failed: the engine loop raised %r", error.request_id, error.cause)
            await self.engine_died(error.cause)
        elif kind in REJECT_REASONS:  # a passed deadline is counted as a finished request instead
            self.rejected[kind] += 1
        else:
            log.error("a request failed: %r", error)
        return kind

    async def stats(self) -> dict:
        """The engine's figures plus requests_rejected_<reason>."""
        if self.engine is None:
            raise RuntimeError(self.reason)
        stats = await self.engine.stats()
        for reason in REJECT_REASONS:
            stats[f"requests_rejected_{reason}"] = self.rejected[reason]
        return stats
