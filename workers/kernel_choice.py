"""How a model's fp32 linear layers multiply on this machine, measured per machine: which packed GEMM
they run (MKL's, oneDNN's or pagedserve's own, kernels/cpu/packed_gemm.c: `llama.F32_GEMMS`), and up
to how many rows they run the C weight kernel rather than that GEMM (`f32_kernel_rows` on each
packed layer and on the model for its LM head, read by `linear` and `lm_head` in
workers/models/llama.py; F32_KERNEL_ROWS there is the default). The crossover's figures below were
taken against oneDNN ("oneDNN" for the packed GEMM).

Why the GEMM is measured: each library is the faster on some CPUs. SmolLM2's 30 layers of
projections, 2 threads, MKL packed against oneDNN packed: on a Xeon with AVX-512 64 rows 46.7
against 64.3 ms (kernels/cpu/mkl_packed.py); on an AMD EPYC (Zen 3, AVX2; benchmarks/f32_gemm.py) 16
rows 64.4 against 39.3 ms, 32 rows 88.3 / 60.0, 64 rows 149.9 / 108.5, 256 rows 368.4 / 372.0, 2,048
rows 2,573 / 2,789; there pagedserve's own took 8 rows 23.0 ms against oneDNN's 29.6, 48 rows 65.2 /
86.3 (random weights, kernels/cpu/packed_gemm.py). They are compared at GEMM_ROWS, a decode batch's
row counts beyond the C kernel's, where a serving engine spends most of its steps; another GEMM
replaces the default (MKL's where torch has it) only where it wins by MARGIN, and then the layers
are packed again for it (`llama.repack_f32`).

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
CPUs' caches hold, so that they stream from memory as a step's weights do), first the GEMMs
(the others' packings of those layers made for the measurement and dropped after), then the C
kernel against the chosen GEMM at each of CANDIDATE_ROWS in turn, the best of REPEATS rounds each
(the sides alternating within a round). A row count is taken only where the C kernel wins by
MARGIN, and the first it does not win ends the search; where it loses at one row, the crossover
is 0: the packed GEMM takes every row count (on that AMD EPYC pagedserve's GEMM took 1 row in 13.4
ms against the C kernel's 16.0, 4 rows 18.4 / 20.5). The LM head takes the same GEMM and count
(it is not measured apart). The answer is kept on disk, keyed by the CPU, the thread count, the
kernel's source, the GEMMs torch has and the layers' shapes, under a lock: later starts read it
before their first step (the GEMM before the weights are packed, `kept_f32_gemm`, so that they
are packed once), and every process of the machine runs the same kernels (a step's rounding
depends on the kernel, so a server and the offline API give the same tokens). Only the
first start of a machine runs its first steps on the defaults, until it has measured.
Models whose fp32 linear weights are under MIN_MODEL_BYTES (tests' tiny models) keep the defaults:
their weights sit in cache, where the comparison says nothing. PAGEDSERVE_F32_KERNEL_ROWS=N sets
the count outright and keeps the default GEMM (no measurement, nothing kept): the test suite runs
at the defaults that way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

import kernels.cpu
from kernels.cpu import F32_GEMV_MAX_ROWS, f32_linear
from pagedserve.config import cache_dir
from workers.json_file import locked, write_atomically
from workers.models import llama

log = logging.getLogger(__name__)

CANDIDATE_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
GEMM_ROWS = (32, 128)
MEASURED_BYTES = 128 << 20
MIN_MODEL_BYTES = 32 << 20
REPEATS = 5
MARGIN = 0.05
OVERRIDE_ENV = "PAGEDSERVE_F32_KERNEL_ROWS"
# The C kernels' sources: a change to either is measured again.
KERNEL_SOURCES = tuple(Path(kernels.cpu.__file__).with_name(name) for name in ("weight_gemv.c", "packed_gemm.c"))


def choose_rows(timings: dict[int, tuple[float, float]], default: int) -> int:
    """The largest row count of the ascending run from the smallest where the C kernel beats the
    packed GEMM by MARGIN; one less than the smallest where it loses that one (0: the GEMM takes
    every row count); `default` where nothing was measured. `timings`: rows -> (C, GEMM) seconds."""
    if not timings:
        return default
    chosen = min(timings) - 1
    for rows in sorted(timings):
        kernel, gemm = timings[rows]
        if kernel > gemm * (1 - MARGIN):
            break
        chosen = rows
    return chosen


def choose_gemm(timings: dict[str, float], default: str) -> str:
    """The GEMM that beats `default` by MARGIN (the fastest, if more do); `default` where none does.
    `timings`: GEMM -> seconds over GEMM_ROWS."""
    best = min(timings, key=timings.__getitem__, default=default)
    if best != default and default in timings and timings[best] > timings[default] * (1 - MARGIN):
        return default
    return best


def _valid(rows) -> bool:
    return type(rows) is int and 0 <= rows <= F32_GEMV_MAX_ROWS


def _valid_entry(entry) -> bool:
    """A kept answer: {"rows": a valid crossover, "gemm": one of the GEMMs torch has here}."""
    return (isinstance(entry, dict) and _valid(entry.get("rows"))
            and entry.get("gemm") in llama.F32_GEMMS)


def _layers(model: nn.Module) -> list[nn.Linear]:
    """The fp32 linear layers that carry both the plain and the packed weight, in model order."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32
            and m.weight.device.type == "cpu" and getattr(m, "packed_weight", None) is not None]


def _key(layers: list[nn.Linear]) -> str:
    shapes = sorted({tuple(m.weight.shape) for m in layers})
    kernel = hashlib.blake2b(b"".join(p.read_bytes() for p in KERNEL_SOURCES), digest_size=8).hexdigest()
    gemms = ",".join(llama.F32_GEMMS)  # the candidates
    # The CPU's model and flags, as its kernels' builds are keyed: the model name alone ("AMD EPYC")
    # was the same on a Zen 3 and a Zen 4, whose fastest GEMMs differ.
    text = f"{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}|{kernel}|{gemms}|{shapes}"
    return hashlib.blake2b(kernels.cpu.cpu_signature() + text.encode(), digest_size=8).hexdigest()


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


def _write_cache(key: str, rows: int, gemm: str) -> None:
    path = _cache_path()
    try:
        entries = _read_cache()
        entries[key] = {"rows": rows, "gemm": gemm}
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


def _inputs(layers: list[nn.Linear], rows: int) -> dict[int, torch.Tensor]:
    # Not randn: the global RNG stays as it was.
    return {n: torch.full((rows, n), 0.5) for n in {m.weight.shape[1] for m in layers}}


@torch.inference_mode()
def measure_gemms(layers: list[nn.Linear]) -> dict[str, float]:
    """GEMM -> seconds over `layers` at GEMM_ROWS (the sum of each row count's best), for every
    GEMM of `llama.F32_GEMMS`; empty where there are fewer than two. The layers keep their packing:
    the others are made for the measurement and dropped after it."""
    if len(llama.F32_GEMMS) < 2:
        return {}
    packings = {gemm: [m.packed_weight if llama.f32_gemm_of(m.packed_weight) == gemm else llama._pack(m.weight, gemm)
                       for m in layers] for gemm in llama.F32_GEMMS}
    timings = dict.fromkeys(packings, 0.0)
    for rows in GEMM_ROWS:
        xs = _inputs(layers, rows)
        runs = [lambda packed=packed: [llama.packed_linear(xs[m.weight.shape[1]], p) for m, p in zip(layers, packed)]
                for packed in packings.values()]
        for gemm, seconds in zip(packings, _best_times(*runs)):
            timings[gemm] += seconds
    return timings


@torch.inference_mode()
def measure(layers: list[nn.Linear]) -> dict[int, tuple[float, float]]:
    """rows -> (C kernel, packed GEMM) seconds over `layers` (on the GEMM their weights are packed
    for), up to the first row count where the C kernel does not win by MARGIN; empty where the C
    kernel did not build."""
    timings = {}
    for rows in CANDIDATE_ROWS:
        if rows > F32_GEMV_MAX_ROWS:
            break
        xs = _inputs(layers, rows)
        if f32_linear(xs[layers[0].weight.shape[1]], layers[0].weight) is None:
            break
        kernel, gemm = _best_times(
            lambda: [f32_linear(xs[m.weight.shape[1]], m.weight) for m in layers],
            lambda: [llama.packed_linear(xs[m.weight.shape[1]], m.packed_weight) for m in layers])
        timings[rows] = (kernel, gemm)
        if choose_rows(timings, llama.F32_KERNEL_ROWS) != rows:
            break
    return timings


def _apply(model: nn.Module, layers: list[nn.Linear], rows: int, gemm: str | None = None) -> int:
    """Set the crossover, and re-pack the fp32 weights for `gemm` where they are not (None: as
    they are)."""
    if gemm is not None:
        llama.repack_f32(model, gemm)
    for m in layers:
        m.f32_kernel_rows = rows
    model.f32_kernel_rows = rows  # its LM head's
    return rows


def kept_f32_kernel_rows(model: nn.Module) -> int | None:
    """Set `model`'s crossover and GEMM where they need no measurement (the override, a small
    model, a kept answer) and return the crossover; None where they are still to be measured
    (`tune_f32_kernel_rows`)."""
    return _kept_rows(model, _layers(model))


def _kept_rows(model: nn.Module, layers: list[nn.Linear]) -> int | None:
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        if not override.isdigit() or not _valid(int(override)):
            raise ValueError(f"{OVERRIDE_ENV}: a row count from 0 to {F32_GEMV_MAX_ROWS}, got {override!r}")
        return _apply(model, layers, int(override))
    if sum(m.weight.nbytes for m in layers) < MIN_MODEL_BYTES:
        return _apply(model, layers, llama.F32_KERNEL_ROWS)
    entry = _kept_entry(layers)
    return None if entry is None else _apply(model, layers, entry["rows"], entry["gemm"])


def _kept_entry(layers: list[nn.Linear]) -> dict | None:
    """The answer kept for these layers on this machine, where a valid one is."""
    entry = _read_cache().get(_key(layers))
    return entry if _valid_entry(entry) else None


def kept_f32_gemm(model: nn.Module) -> str | None:
    """The GEMM kept for `model`'s fp32 linear layers on this machine, read before they are packed
    so that they are packed once, for it (SmolLM2: 0.28 s to pack them for MKL's, 0.24 s again for
    oneDNN's, on a start's critical path); None where the default stands (no answer kept yet, the
    override, a small model)."""
    head = model.lm_head_weight() if hasattr(model, "lm_head_weight") else None
    # The layers `llama.pack_weights` packs, as `_layers` finds them once packed.
    layers = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32
              and m.weight.device.type == "cpu" and m.weight is not head]
    if not llama.PACK_F32 or os.environ.get(OVERRIDE_ENV) or sum(m.weight.nbytes for m in layers) < MIN_MODEL_BYTES:
        return None
    entry = _kept_entry(layers)
    return None if entry is None else entry["gemm"]


def tune_f32_kernel_rows(model: nn.Module) -> int:
    """Set `model`'s GEMM and crossover on this machine (see the module docstring) and return the
    crossover: read back, or measured and kept. Run between steps, on the thread that runs them (its
    OpenMP team is the one sized and pinned), once the weights are where they stay (on huge pages,
    workers/huge_pages.py)."""
    layers = _layers(model)
    rows = _kept_rows(model, layers)
    if rows is not None:
        return rows
    key = _key(layers)
    with _cache_locked():
        entry = _read_cache().get(key)  # another process may have measured while this one waited
        if _valid_entry(entry):
            return _apply(model, layers, entry["rows"], entry["gemm"])
        measured, total = [], 0
        for m in layers:
            measured.append(m)
            total += m.weight.nbytes
            if total >= MEASURED_BYTES:
                break
        start = time.perf_counter()
        gemm_timings = measure_gemms(measured)
        gemm = choose_gemm(gemm_timings, llama.DEFAULT_F32_GEMM)
        llama.repack_f32(model, gemm)  # the crossover is measured against the GEMM the steps will run
        timings = measure(measured)
        rows = choose_rows(timings, llama.F32_KERNEL_ROWS)
        log.info("fp32 linear layers run %s's packed GEMM (%s at %s rows), and the C kernel up to %d rows "
                 "(%s; measured in %.2f s)", gemm, ", ".join(f"{g} {t * 1e3:.2f} ms" for g, t in gemm_timings.items()),
                 "+".join(map(str, GEMM_ROWS)), rows,
                 ", ".join(f"{r} rows {k * 1e3:.2f} / {o * 1e3:.2f} ms" for r, (k, o) in timings.items()),
                 time.perf_counter() - start)
        if timings or gemm_timings:  # nothing measured (no kernel built, one GEMM): nothing to keep
            _write_cache(key, rows, gemm)
    return _apply(model, layers, rows)
