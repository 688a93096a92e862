"""Up to how many rows a model's fp32 linear layers run the C weight kernel rather than the GEMM
on the packed weight (MKL's packed GEMM, or oneDNN's where torch has no MKL: both "oneDNN"
below, where the figures were taken), measured per machine and set on the model
(`f32_kernel_rows` on each packed layer and on the model for its LM head, read by `linear` and
`lm_head` in workers/models/llama.py; F32_KERNEL_ROWS there is the default).

Why measured: the crossover is the CPU's. The C kernel streams each weight once for all of a
step's rows (kernels/cpu/weight_gemv.c); oneDNN's GEMM wins once there are rows enough to fill its
tiles. SmolLM2's 30 layers, 2 threads: on an AMD EPYC the C kernel took 15.7 ms at 4 rows against
oneDNN's 17.0, and oneDNN led from 8; on a Xeon with AVX-512 (random weights on 4 KiB pages) the C
kernel led to 12 rows (5 rows 19.1 against 21.6 ms, 8 rows 21.3 / 24.3, 12 rows 25.3 / 27.2) and
was even at 16. A speculative verify step is K+1 rows (5 at K=4), and a handful of streams decode
a few rows: on that Xeon one stream's 5-row verify step took 39.5 ms with oneDNN against 34.1 ms
with the C kernel. Since fp32's 2-16 rows stream the weight on AVX-512 (STREAM in weight_gemv.c)
the C kernel leads there at every count it takes (SmolLM2's first 128 MiB: 12 rows 6.38 against
9.14 ms, 16 rows 7.84 against 9.60).

How: on the model's own weights (its first linear layers, up to MEASURED_BYTES, more than most
CPUs' caches hold, so that they stream from memory as a step's weights do), the C kernel against
oneDNN at each of CANDIDATE_ROWS in turn, the best of REPEATS rounds each (the two alternating).
A row count is taken only where the C kernel wins by MARGIN, and the first it does not win ends
the search. The LM head takes the same count (it is not measured apart). The answer is kept on
disk, keyed by the CPU, the thread count, the kernel's source and the layers' shapes, under a
lock: later starts read it before their first step, and every process of the machine runs the
same kernels (a step's rounding depends on the kernel, so a server and the offline API give the
same tokens). Only the first start of a machine runs its first steps on the default, until it
has measured.
Models whose fp32 linear weights are under MIN_MODEL_BYTES (tests' tiny models) keep the default:
their weights sit in cache, where the comparison says nothing. PAGEDSERVE_F32_KERNEL_ROWS=N sets
the count outright (no measurement, nothing kept): the test suite runs at the default that way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch
from torch import nn

import kernels.cpu
from kernels.cpu import F32_GEMV_MAX_ROWS, f32_linear, mkl_packed
from pagedserve.config import cache_dir
from workers.json_file import locked, write_atomically
from workers.models import llama

log = logging.getLogger(__name__)

CANDIDATE_ROWS = (5, 6, 8, 12, 16)
MEASURED_BYTES = 128 << 20
MIN_MODEL_BYTES = 32 << 20
REPEATS = 5
MARGIN = 0.05
OVERRIDE_ENV = "PAGEDSERVE_F32_KERNEL_ROWS"
GEMV_SOURCE = Path(kernels.cpu.__file__).with_name("weight_gemv.c")


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


def _valid(rows) -> bool:
    return type(rows) is int and 1 <= rows <= F32_GEMV_MAX_ROWS


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
    kernel = hashlib.blake2b(GEMV_SOURCE.read_bytes(), digest_size=8).hexdigest()
    gemm = "mkl-packed" if mkl_packed.available() else "onednn"  # the other side of the comparison
    text = f"{_cpu_name()}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}|{kernel}|{gemm}|{shapes}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _cache_path():
    return cache_dir() / "kernel_choice.json"


def _read_cache() -> dict:
    try:
        entries = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


@contextlib.contextmanager
def _cache_locked():
    """The file's lock, held from reading to writing: concurrent first starts (servers, a tensor-
    parallel group's ranks) measure one at a time, and the later ones read the first's answer.
    Without a writable cache folder, no lock (and nothing will be kept)."""
    with contextlib.ExitStack() as stack:
        try:
            _cache_path().parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(locked(_cache_path()))
        except OSError:
            pass
        yield


def _write_cache(key: str, rows: int) -> None:
    path = _cache_path()
    try:
        entries = _read_cache()
        entries[key] = rows
        write_atomically(path, entries, indent=1)
    except OSError as e:
        log.warning("could not keep the measured kernel crossover in %s: %s", path, e)


def _best_times(*runs) -> list[float]:
    """Each of `runs`' best time over REPEATS rounds, the runs taken in turn within a round: a
    burst of other work on the cores then slows both sides, not only the one it fell on (one
    measurement, each side's repeats in a row inside a benchmark's first start, kept a crossover
    of 8 rows where quiet ones measured 16)."""
    best = [float("inf")] * len(runs)
    for _ in range(REPEATS):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


@torch.inference_mode()
def measure(layers: list[nn.Linear]) -> dict[int, tuple[float, float]]:
    """rows -> (C kernel, oneDNN) seconds over `layers`, up to the first row count where the C
    kernel does not win by MARGIN; empty where the C kernel did not build."""
    inputs = {m.weight.shape[1] for m in layers}
    timings = {}
    for rows in CANDIDATE_ROWS:
        if rows > F32_GEMV_MAX_ROWS:
            break
        xs = {n: torch.full((rows, n), 0.5) for n in inputs}  # not randn: the global RNG stays as it was
        if f32_linear(xs[layers[0].weight.shape[1]], layers[0].weight) is None:
            break
        kernel, onednn = _best_times(
            lambda: [f32_linear(xs[m.weight.shape[1]], m.weight) for m in layers],
            lambda: [llama.packed_linear(xs[m.weight.shape[1]], m.packed_weight) for m in layers])
        timings[rows] = (kernel, onednn)
        if choose_rows(timings, llama.F32_KERNEL_ROWS) != rows:
            break
    return timings


def _apply(model: nn.Module, layers: list[nn.Linear], rows: int) -> int:
    for m in layers:
        m.f32_kernel_rows = rows
    model.f32_kernel_rows = rows  # its LM head's
    return rows


def kept_f32_kernel_rows(model: nn.Module) -> int | None:
    """Set `model`'s crossover where it needs no measurement (the override, a small model, a kept
    answer) and return it; None where it is still to be measured (`tune_f32_kernel_rows`)."""
    return _kept_rows(model, _layers(model))


def _kept_rows(model: nn.Module, layers: list[nn.Linear]) -> int | None:
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        if not override.isdigit() or not _valid(int(override)):
            raise ValueError(f"{OVERRIDE_ENV}: a row count from 1 to {F32_GEMV_MAX_ROWS}, got {override!r}")
        return _apply(model, layers, int(override))
    if sum(m.weight.nbytes for m in layers) < MIN_MODEL_BYTES:
        return _apply(model, layers, llama.F32_KERNEL_ROWS)
    rows = _read_cache().get(_key(layers))
    return _apply(model, layers, rows) if _valid(rows) else None


def tune_f32_kernel_rows(model: nn.Module) -> int:
    """Set `model`'s crossover on this machine (see the module docstring) and return it: read
    back, or measured and kept. Run between steps, on the thread that runs them (its OpenMP team
    is the one sized and pinned), once the weights are where they stay (on huge pages,
    workers/huge_pages.py)."""
    layers = _layers(model)
    rows = _kept_rows(model, layers)
    if rows is not None:
        return rows
    key = _key(layers)
    with _cache_locked():
        rows = _read_cache().get(key)  # another process may have measured while this one waited
        if _valid(rows):
            return _apply(model, layers, rows)
        measured, total = [], 0
        for m in layers:
            measured.append(m)
            total += m.weight.nbytes
            if total >= MEASURED_BYTES:
                break
        start = time.perf_counter()
        timings = measure(measured)
        rows = choose_rows(timings, llama.F32_KERNEL_ROWS)
        log.info("fp32 linear layers take the C kernel up to %d rows (measured in %.2f s: %s)", rows,
                 time.perf_counter() - start,
                 ", ".join(f"{r} rows {k * 1e3:.2f} / {o * 1e3:.2f} ms" for r, (k, o) in timings.items()))
        if timings:  # nothing measured (the kernel did not build): nothing to keep
            _write_cache(key, rows)
    return _apply(model, layers, rows)
