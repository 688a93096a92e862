"""One log line per request as it arrives and as it ends, on the server's stderr (vLLM's
`--enable-log-requests`; off by default, since prompts are the users' data): its id, prompt
(cut to `max_len` characters) and token count, and sampling settings; then how it ended, the
tokens it generated and its seconds in the engine.
"""

from __future__ import annotations

import logging

from coordinator.stats_logger import to_stderr

log = logging.getLogger("pagedserve.requests")
_max_len: int | None = None  # characters of a prompt a line shows (None: all)


def enable(max_len: int | None = None) -> None:
    """Log every request from now on (this process); `max_len`: characters of a prompt shown."""
    global _max_len
    to_stderr(log)
    _max_len = max_len


def enabled() -> bool:
    return bool(log.handlers) and log.isEnabledFor(logging.INFO)


def received(request_id: str, prompt: str, token_ids: list[int], params) -> None:
    shown = prompt
    if _max_len is not None and len(shown) > _max_len:
        shown = shown[:_max_len] + "..."
    log.info("Received request %s: prompt: %r, %d prompt tokens, params: %s", request_id, shown, len(token_ids),
             params)


def ended(request_id: str, how: str, generated: int, seconds: float) -> None:
    log.info("Finished request %s: %s, %d tokens generated in %.2f s", request_id, how, generated, seconds)
