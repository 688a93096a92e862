"""The C heap of a process that runs steps on the CPU: freed activations kept for the next step.

A bf16 step allocates its activations afresh (torch's CPU allocator takes them from malloc:
oneDNN's GEMM outputs and its own buffers, the attention's), and glibc hands back to the kernel
every freed block above its mmap threshold (at most 32 MiB, its dynamic ceiling) and the top of
its heap beyond its trim threshold. So the steps took their activations on fresh pages, one page
fault and one zeroed page per 4 KiB: the offline benchmark's 11 bf16 prompt steps (SmolLM2,
~2,048 tokens each) took 698k faults, 109k of them the KV pool's first touches.

With blocks up to MMAP_THRESHOLD taken from the heap and up to TRIM_THRESHOLD of free heap kept,
a step reuses the pages the steps before it freed: those prompt steps took 122-128k faults, and
14.04, 13.80 and 13.80 s against 14.83, 15.35 and 15.28 s (alternated runs). fp32 layers run on
buffers kept between steps (kernels/cpu/decoder_layer.py): their faults moved from 243k to 224k,
and their runs did not get faster (6 alternated pairs, +0.85 s on average, within this VM's
noise), so a worker sets this for bf16 models only. A process that is given glibc's variables
(MALLOC_*_, GLIBC_TUNABLES) or runs on another C library keeps its own settings.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 64 << 20  # above a step's largest activation (bf16 gate/up of 2,048 rows: 12 MiB)
TRIM_THRESHOLD = 256 << 20  # the most free heap kept: a step's activations, not a load's
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def keep_freed_memory_for_steps() -> bool:
    """Set this process's glibc heap as above (once its model is loaded: the load's large
    temporaries are returned as before); False, changing nothing, where it is not glibc's or
    the environment already tunes it."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if os.environ.get("GLIBC_TUNABLES") or any(
            name.startswith("MALLOC_") and name.endswith("_") and value for name, value in os.environ.items()):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        log.debug("glibc's mallopt refused the step heap's trim threshold")
        return False
    # A glibc that caps the threshold lower (its 32 MiB default ceiling) takes the cap.
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    return True
