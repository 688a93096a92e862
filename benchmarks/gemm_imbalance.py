"""pagedserve's packed GEMM with its panels handed between threads (a thread done early takes the
others' last ones) against the fixed split it replaced, on a model's decoder projections, with
the cores to itself and with one core shared.

A step's threads end together only if their cores run alike. On a shared VM they often do not
(a neighbour, or Ray's own processes beside a worker), and with a fixed split of the panels every
GEMM then waits for its slower thread. Here the second case is made on purpose: a process pinned
to the last core spins for `--hog-on-ms` and sleeps for `--hog-off-ms`, in turn. Both builds of
kernels/cpu/packed_gemm.c (the fixed split is `-DPACKED_GEMM_STEAL=0`) run one pass over every
layer's four projections (QKV, O, gate/up, down; random fp32 weights of the model's shapes) on
all of torch's threads, alternated `--repeats` times; the median and best pass of each, ms.

    .venv/bin/python benchmarks/gemm_imbalance.py                  # SmolLM2's shapes, ~1-2 minutes
    .venv/bin/python benchmarks/gemm_imbalance.py --rows 32 --repeats 5
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from benchmarks.bf16_gemm import MODEL, projection_shapes, timed  # noqa: E402
from benchmarks.offline_throughput import write_json  # noqa: E402
from kernels.cpu import packed_gemm  # noqa: E402

BUILDS = {"fixed split": ("-DPACKED_GEMM_STEAL=0",), "handed over": ()}


def hog(core: int, on_s: float, off_s: float) -> None:
    """Spin on `core` for on_s, sleep off_s, until killed."""
    os.sched_setaffinity(0, {core})
    while True:
        until = time.perf_counter() + on_s
        while time.perf_counter() < until:
            pass
        time.sleep(off_s)


def passes(lib: ctypes.CDLL, shapes: list[tuple[int, int]], rows: int, threads: int):
    """A function running one pass over `shapes` at `rows` rows on `lib`'s own packed weights."""
    weights = []
    for n_out, k_in in shapes:
        packed, weight = torch.empty(lib.packed_f32_size(n_out, k_in)), torch.randn(n_out, k_in) * 0.05
        lib.pack_f32_panels(packed.data_ptr(), weight.data_ptr(), n_out, k_in)
        weights.append((packed, n_out, k_in, torch.randn(rows, k_in), torch.empty(rows, n_out)))

    def run():
        for packed, n_out, k_in, x, out in weights:
            lib.packed_gemm_f32(out.data_ptr(), x.data_ptr(), packed.data_ptr(), rows, n_out, k_in, threads)
    return run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64, 256])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--hog-on-ms", type=float, default=20.0)
    p.add_argument("--hog-off-ms", type=float, default=20.0)
    p.add_argument("--result-json", default="benchmarks/results/gemm_imbalance.json")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    if threads < 2 or not packed_gemm.available():
        print("needs 2 or more threads and a C compiler with OpenMP: nothing to compare")
        return
    from pagedserve.config import resolve_model
    from workers.model_config import load_hf_config
    hf_config = load_hf_config(resolve_model(MODEL))
    shapes = projection_shapes(hf_config) * hf_config.num_hidden_layers
    flops_per_row = 2 * sum(n * k for n, k in shapes)
    libs = {name: packed_gemm.build_variant(*defines) for name, defines in BUILDS.items()}
    results = []
    for condition in ("cores to itself", "one core shared"):
        hogger = None
        if condition == "one core shared":
            hogger = multiprocessing.Process(target=hog, daemon=True,
                                             args=(os.cpu_count() - 1, args.hog_on_ms / 1e3, args.hog_off_ms / 1e3))
            hogger.start()
        try:
            for rows in args.rows:
                runs = {name: passes(lib, shapes, rows, threads) for name, lib in libs.items()}
                for run in runs.values():
                    run()  # warm: pages touched, the thread pool up
                times = {name: [] for name in runs}
                for _ in range(args.repeats):
                    for name, run in runs.items():
                        times[name].append(timed(run) * 1e3)
                row = {"condition": condition, "rows": rows,
                       **{name: {"median_ms": statistics.median(t), "best_ms": min(t),
                                 "median_gflops": flops_per_row * rows / statistics.median(t) / 1e6}
                          for name, t in times.items()}}
                fixed, handed = row["fixed split"], row["handed over"]
                row["fixed_over_handed_median"] = fixed["median_ms"] / handed["median_ms"]
                results.append(row)
                print(f"{condition:16} {rows:5d} rows: fixed split {fixed['median_ms']:8.2f} ms (best "
                      f"{fixed['best_ms']:.2f}), handed over {handed['median_ms']:8.2f} "
                      f"(best {handed['best_ms']:.2f}): {row['fixed_over_handed_median']:.2f}x", flush=True)
        finally:
            if hogger is not None:
                hogger.kill()
                hogger.join()
    write_json({"model": MODEL, "threads": threads, "cpu_count": os.cpu_count(), "repeats": args.repeats,
                "hog_on_ms": args.hog_on_ms, "hog_off_ms": args.hog_off_ms, "results": results}, args.result_json)


if __name__ == "__main__":
    main()
