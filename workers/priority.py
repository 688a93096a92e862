"""CPU priorities of the cluster's processes.

Ray starts its worker processes at nice 15 (its `worker_niceness`) so that its own daemons win
over CPU-bound tasks. A serving worker is the opposite case: its steps are the critical path,
every thread of a step waits at a barrier for the slowest, and at nice 15 any other process of
the node (the coordinator, the raylet, a client) preempts those threads mid-GEMM. Measured on 2
cores (SmolLM2, 24 requests): the same engine computed 10% slower in a Ray worker at nice 15
than in the driver's own process, nearly all the worker's context switches involuntary; at
nice 0, three alternated runs took 22.8, 22.9 and 20.6 s against 23.9, 21.7 and 25.4 s at 15
(a noisy machine; the preemptions remain, only their priority changes). So a Ray started here
sets `worker_niceness` to 0, and the coordinator and each worker raise themselves to nice 0
where Ray started them lower (this needs the right to raise priority: root or CAP_SYS_NICE;
otherwise they say so).

On Linux, nice and scheduling policy are per thread, and a new thread takes its creator's: a
thread raised before torch starts its thread pools passes nice 0 on to them.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

# `ray.init(_system_config=...)` of every Ray a pagedserve process starts (`ray start` takes the
# same as the environment variable RAY_worker_niceness=0).
RAY_SYSTEM_CONFIG = {"worker_niceness": 0}


def raise_to_normal_priority() -> None:
    """Nice 0 for every thread of this process that runs lower, where it may be raised (threads
    started later by any of them then start at 0 too)."""
    nice = os.getpriority(os.PRIO_PROCESS, os.getpid())
    if nice <= 0:
        return
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
            except ProcessLookupError:
                pass  # a thread that ended meanwhile
    except PermissionError:
        log.warning("this process runs at nice %d (Ray's worker_niceness) and may not raise it: every other "
                    "process on the node preempts it; start Ray with RAY_worker_niceness=0", nice)
    except OSError:  # no /proc: the calling thread alone
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError:
            pass


def lower_this_threads_priority() -> None:
    """The calling thread (not its process) gets CPU time only where nothing else wants it: on
    Linux both calls act on the calling thread alone, and an unprivileged thread may make either."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 19)
        except (AttributeError, OSError):
            pass  # no way to lower it here: it runs at the priority it has


def return_idle_threads_to_normal_policy() -> None:
    """Every thread of this process at SCHED_IDLE goes back to SCHED_OTHER: the threads a lowered
    thread started (they take its policy: importing torch starts its OpenMP pool), and the lowered
    thread itself, which /proc may still list for a moment after `join()` returned."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return  # no /proc: nothing lowered can be found
    for tid in tids:
        try:
            if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE:
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:
            pass  # a thread that ended meanwhile
        except (AttributeError, OSError) as e:
            log.warning("thread %s stays at SCHED_IDLE: %s", tid, e)
