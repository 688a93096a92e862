"""Up to how many rows a step's fp32 linear layers run the C weight kernel rather than oneDNN's
GEMM on the packed weight (`F32_KERNEL_ROWS` in workers/models/llama.py), measured per machine.

Why measured: the crossover is the CPU's. The C kernel streams each weight once for all of a
step's rows (kernels/cpu/weight_gemv.c); oneDNN's GEMM wins once there are rows enough to use its
tiles. SmolLM2's 30 layers, 2 threads: on an AMD EPYC C 15.7 against oneDNN 17.0 ms at 4 rows and
oneDNN ahead from 8; on a Xeon with AVX-512 the C kernel ahead to 12 rows (5 rows 19.1 against
21.6 ms, 8 rows 21.3 / 24.3, 12 rows 25.3 / 27.2) and even at 16. A speculative step verifies
K+1 rows (5 at K=4), a handful of streams decode a few rows: on that Xeon a single stream's 5-row
verify step took 39.5 ms with oneDNN against 33.8 ms with the C kernel.

How: on the model's own weights (its first linear layers, up to MEASURED_BYTES, so that they
stream from memory as a step's weights do), the C kernel against oneDNN at each of CANDIDATE_ROWS
in turn, the best of REPEATS each. A row count is taken only where the C kernel wins by MARGIN,
and the first it does not win ends the search. The answer is kept on disk, keyed by the CPU, the
thread count and the layers' shapes: the later starts on the machine skip the measurement, and
every process of the machine takes the same kernels (a step's rounding depends on the kernel, so
two servers of one machine give the same tokens). Models whose fp32 linear weights are under
MIN_MODEL_BYTES (tests' tiny models) keep the default: their weights sit in cache, where the
comparison says nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time

import torch
from torch import nn

from kernels.cpu import F32_GEMV_MAX_ROWS, f32_linear
from pagedserve.config import cache_dir
from workers.models import llama

log = logging.getLogger(__name__)

CANDIDATE_ROWS = (5, 6, 8, 12, 16)
MEASURED_BYTES = 128 << 20
MIN_MODEL_BYTES = 32 << 20
REPEATS = 3
MARGIN = 0.05


def choose_rows(timings: dict[int, tuple[float, float]], default: int) -> int:
    """The largest row count of the ascending run from the smallest where the C kernel beats
    oneDNN by MARGIN; `default` where it loses the first. `timings`: rows -> (C, oneDNN) seconds."""
    chosen = default
    for rows in sorted(timings):
        kernel, onednn = timings[rows]
        if kernel > onednn * (1 - MARGIN):
            break
        chosen = rows
    return chosen


def _layers(model: nn.Module) -> list[nn.Linear]:
    """The fp32 linear layers that carry both the plain and the packed weight, in model order."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32
            and m.weight.device.type == "cpu" and getattr(m, "packed_weight", None) is not None]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _key(layers: list[nn.Linear]) -> str:
    shapes = sorted({tuple(m.weight.shape) for m in layers})
    text = f"{_cpu_name()}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}|{shapes}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _cache_path():
    return cache_dir() / "kernel_choice.json"


def _read_cache() -> dict:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, rows: int) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read_cache()
        entries[key] = rows
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one
    except OSError as e:
        log.warning("could not keep the measured kernel crossover in %s: %s", path, e)


def _best_time(run) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def measure(layers: list[nn.Linear]) -> dict[int, tuple[float, float]]:
    """rows -> (C kernel, oneDNN) seconds over `layers`, up to the first row count where the C
    kernel does not win by MARGIN."""
    inputs = {m.weight.shape[1] for m in layers}
    timings = {}
    for rows in CANDIDATE_ROWS:
        if rows > F32_GEMV_MAX_ROWS:
            break
        xs = {n: torch.randn(rows, n) for n in inputs}
        if f32_linear(xs[layers[0].weight.shape[1]], layers[0].weight) is None:
            break  # the kernel did not build: nothing to choose
        kernel = _best_time(lambda: [f32_linear(xs[m.weight.shape[1]], m.weight) for m in layers])
        onednn = _best_time(lambda: [llama.onednn_linear(xs[m.weight.shape[1]], m.packed_weight) for m in layers])
        timings[rows] = (kernel, onednn)
        if choose_rows(timings, llama.DEFAULT_F32_KERNEL_ROWS) != rows:
            break
    return timings


def tune_f32_kernel_rows(model: nn.Module) -> int:
    """Set `llama.F32_KERNEL_ROWS` for `model`'s fp32 layers on this machine (kept on disk, or
    measured and kept: see the module docstring); returns it. Run between steps, on the thread
    that runs them (its OpenMP team is the one sized and pinned), once the weights are where they
    stay (on huge pages, workers/huge_pages.py)."""
    layers = _layers(model)
    if sum(m.weight.nbytes for m in layers) < MIN_MODEL_BYTES:
        return llama.F32_KERNEL_ROWS
    key = _key(layers)
    rows = _read_cache().get(key)
    if not isinstance(rows, int):
        measured, total = [], 0
        for m in layers:
            measured.append(m)
            total += m.weight.nbytes
            if total >= MEASURED_BYTES:
                break
        start = time.perf_counter()
        timings = measure(measured)
        rows = choose_rows(timings, llama.DEFAULT_F32_KERNEL_ROWS)
        log.info("fp32 linear layers take the C kernel up to %d rows (measured in %.2f s: %s)", rows,
                 time.perf_counter() - start,
                 ", ".join(f"{r} rows {k * 1e3:.2f} / {o * 1e3:.2f} ms" for r, (k, o) in timings.items()))
        _write_cache(key, rows)
    llama.F32_KERNEL_ROWS = rows
    return rows
