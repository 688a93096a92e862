"""Pinning a worker's torch threads to cores of their own (`cpu_threads_bind`).

Why: each step ends every thread at a barrier, so one thread that the kernel moves onto a core
another worker is using (or leaves waiting for one) delays the whole step. With several workers
on a node (replicas, tensor-parallel ranks, a prefill and a decode side) the scheduler's
placement drifts; pinned, each worker computes on cores nobody else of ours takes.

'auto': a Ray worker claims the first free cores of those its process may use, as many as its
threads, in a node-wide registry (a JSON file under a lock in /dev/shm, or the temporary
directory without it). Claims of dead processes are dropped, so a rebuilt worker takes the cores
its dead predecessor held. Where too few cores are free the worker is not pinned (logged).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from kernels.cpu import pin_omp_threads
from pagedserve.config import threads_bind_cores
from workers.json_file import locked, write_atomically

log = logging.getLogger(__name__)


def registry_path() -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(os.environ.get("PAGEDSERVE_CORE_REGISTRY", os.path.join(base, "pagedserve-cores.json")))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_claims() -> dict[int, list[int]]:
    """The registry's claims of processes still alive: pid -> cores."""
    try:
        held = {int(p): cores for p, cores in json.loads(registry_path().read_text()).items()}
    except (OSError, ValueError):
        return {}
    return {p: cores for p, cores in held.items() if _alive(p)}


def claim_cores(count: int, pid: int | None = None) -> list[int] | None:
    """`count` cores of this process's allowed set that no live process holds in the registry,
    recorded as `pid`'s (this process's by default), or None when fewer are free. Either way the
    claim replaces the process's earlier one: an unpinned process holds no cores."""
    pid = os.getpid() if pid is None else pid
    allowed = sorted(os.sched_getaffinity(0))
    path = registry_path()
    with locked(path):
        held = {p: cores for p, cores in live_claims().items() if p != pid}
        taken = {c for cores in held.values() for c in cores}
        free = [c for c in allowed if c not in taken]
        claimed = free[:count] if len(free) >= count else None
        if claimed is not None:
            held[pid] = claimed
        write_atomically(path, {str(p): cores for p, cores in held.items()})
    return claimed


def bind_worker(spec: str, rank: int, threads: int) -> list[int] | None:
    """A Ray worker's binding under `cpu_threads_bind` = `spec`: the cores its threads were
    pinned to, or None where they were not."""
    if spec == "nobind":
        return None
    explicit = threads_bind_cores(spec)
    cores = explicit[rank] if explicit is not None else claim_cores(threads)
    if cores is None:
        log.warning("cpu_threads_bind auto: fewer than %d free cores on this node; rank %d's threads are "
                    "not pinned", threads, rank)
        return None
    if not pin_omp_threads(cores):
        log.warning("cpu_threads_bind: could not pin rank %d's threads to cores %s", rank, cores)
        return None
    return cores
