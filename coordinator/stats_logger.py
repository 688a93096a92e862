"""The server's periodic one-line report, as vLLM's engine logs it every few seconds: prompt and
generation throughput over the interval, requests running, waiting and swapped, KV cache usage
and the prefix cache's hit rate over the interval. Quiet while the server is idle (one line when
it becomes idle, then nothing until work comes). `--disable-log-stats` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable


def _interval_from_env(default: float = 10.0) -> float:
    """PAGEDSERVE_LOG_STATS_INTERVAL's seconds (vLLM's default period without it, or for one that is
    not a number >= 0.1: a tight loop would slow the event loop that serves requests)."""
    try:
        value = float(os.environ.get("PAGEDSERVE_LOG_STATS_INTERVAL", default))
    except ValueError:
        return default
    return value if value >= 0.1 else default


DEFAULT_INTERVAL_S = _interval_from_env()

log = logging.getLogger("pagedserve.stats")


class StatsLine:
    """The report's text from two successive stats snapshots (GetStats' dicts)."""

    def __init__(self) -> None:
        self._last: dict | None = None
        self._last_time = 0.0
        self._idle_reported = False

    def update(self, stats: dict, now: float) -> str | None:
        """The line for the interval that ends now, or None (the first snapshot, or still idle)."""
        last, last_time = self._last, self._last_time
        self._last, self._last_time = stats, now
        if last is None or now <= last_time:
            return None
        elapsed = now - last_time
        prompt = stats["prompt_tokens"] - last["prompt_tokens"]
        generated = stats["generation_tokens"] - last["generation_tokens"]
        queued = stats["num_requests_running"] + stats["num_requests_waiting"] + stats["num_requests_swapped"]
        if prompt == generated == queued == 0:
            if self._idle_reported:
                return None
            self._idle_reported = True
        else:
            self._idle_reported = False
        queries = stats["prefix_cache_queries"] - last["prefix_cache_queries"]
        hits = stats["prefix_cache_hits"] - last["prefix_cache_hits"]
        return (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
                f"Running: {stats['num_requests_running']} reqs, Waiting: {stats['num_requests_waiting']} reqs, "
                f"Swapped: {stats['num_requests_swapped']} reqs, KV cache usage: {stats['kv_usage']:.1%}, "
                f"Prefix cache hit rate: {hits / queries if queries else 0.0:.1%}")


async def log_stats_forever(read_stats: Callable[[], Awaitable[dict]], interval: float = DEFAULT_INTERVAL_S) -> None:
    """Log StatsLine's report every `interval` seconds until cancelled; a failed read skips one."""
    to_stderr(log)
    line = StatsLine()
    while True:
        try:
            text = line.update(await read_stats(), time.monotonic())
        except Exception as e:  # noqa: BLE001 (a snapshot that fails, during a rebuild say, skips a line)
            log.debug("no stats this interval: %r", e)
            text = None
        if text is not None:
            log.info("%s", text)
        await asyncio.sleep(interval)


def to_stderr(logger: logging.Logger) -> None:
    """Info lines on stderr, where the server's operator reads them (a Ray actor has no handler)."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s pagedserve: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
