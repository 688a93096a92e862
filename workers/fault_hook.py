"""A test-only fault hook: a poison request on demand.

With PAGEDSERVE_FAULT_CRASH_ON_TOKEN=<token id> in a worker's environment, the worker SIGKILLs its
own process when a step's input holds that token id, every time, as a request that crashes the
kernel or the model would. Only tests set it; unset (production) `armed_token()` is None and the
step path checks nothing. A ray executor forwards the variable from the engine's process to its
worker actors (`forwarded_env`), so that a test sets it where it builds the engine.
"""

from __future__ import annotations

import os
import signal

import numpy as np

CRASH_ON_TOKEN_ENV = "PAGEDSERVE_FAULT_CRASH_ON_TOKEN"
# With PAGEDSERVE_FAULT_CRASH_IN_PUBLISH=1 a worker SIGKILLs itself halfway through writing a prefill
# replica's handoff blocks (StepPlan.publish): a prefill replica that dies mid-transfer.
CRASH_IN_PUBLISH_ENV = "PAGEDSERVE_FAULT_CRASH_IN_PUBLISH"


def armed_token() -> int | None:
    value = os.environ.get(CRASH_ON_TOKEN_ENV)
    return int(value) if value else None


def crash_if_present(input_ids: np.ndarray, token: int) -> None:
    if (input_ids == token).any():
        os.kill(os.getpid(), signal.SIGKILL)


def armed_in_publish() -> bool:
    return os.environ.get(CRASH_IN_PUBLISH_ENV) == "1"


def crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def forwarded_env() -> dict[str, str]:
    """The hooks' variables as set in this process, for a worker actor's runtime_env."""
    return {name: os.environ[name] for name in (CRASH_ON_TOKEN_ENV, CRASH_IN_PUBLISH_ENV) if os.environ.get(name)}
