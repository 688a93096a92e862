"""A small JSON file that several processes of a node read and rewrite: the core registry
(workers/cpu_binding.py) and the measured kernel crossover (workers/kernel_choice.py).

Writers take turns under `locked` (an flock on a sibling `.lock` file, held from reading to
writing, so no update is lost), and `write_atomically` replaces the file whole: a reader without
the lock sees the old contents or the new, never a half-written file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path):
    """`path`'s lock, held exclusively for the block (the lock file is created if need be)."""
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write_atomically(path: Path, data, indent: int | None = None) -> None:
    """`data` as JSON into `path`, through a temporary file renamed over it."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent))
    os.replace(tmp, path)
