"""fp32 GEMMs: the kernels an fp32 linear layer can run on (workers/models/llama.py), side by side
on a model's decoder projections: MKL's GEMM on a weight packed once (kernels/cpu/mkl_packed.py),
oneDNN's on its own packed weight, pagedserve's own on its panels (kernels/cpu/packed_gemm.c),
and built without its prefetch of the next block (the code before it: "no next"), torch's `mm` on
the plain weight, and, up to 16 rows, the C weight kernel (kernels/cpu/weight_gemv.c).

Which is fastest at a decode batch's rows is the CPU's (MKL's on a Xeon with AVX-512, pagedserve's
on an AMD EPYC), which is why a worker measures the packed GEMM and the C kernel's crossover once per
machine (workers/kernel_choice.py); this shows the whole picture. For each row count, one pass
over every layer's four projections (QKV, O, gate/up, down) with random fp32 weights of the
model's shapes, the kernels alternated `--repeats` times; the best pass of each is reported.

    .venv/bin/python benchmarks/f32_gemm.py                        # SmolLM2's shapes
    .venv/bin/python benchmarks/f32_gemm.py --rows 1 16 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from benchmarks.bf16_gemm import MODEL, projection_shapes, timed  # noqa: E402
from kernels.cpu import F32_GEMV_MAX_ROWS, f32_linear, packed_gemm  # noqa: E402
from workers.models import llama  # noqa: E402


def kernels_for(weights: list[torch.Tensor]) -> dict[str, Callable]:
    """name -> (x, i) -> x @ weights[i]^T, for every fp32 GEMM this torch has."""
    kernels = {}
    for name, gemm in (("MKL packed", "mkl"), ("oneDNN packed", "onednn"), ("pagedserve packed", "pagedserve")):
        if gemm in llama.F32_GEMMS:
            packed = [llama._pack(w, gemm) for w in weights]
            kernels[name] = lambda x, i, packed=packed: llama.packed_linear(x, packed[i])
    if "pagedserve" in llama.F32_GEMMS:  # the same panels, without prefetching the next block
        without = packed_gemm.build_variant("-DNEXT_BLOCK_PREFETCH=0")
        packed = [packed_gemm.PackedWeight(w) for w in weights]
        kernels["pagedserve, no next"] = lambda x, i, packed=packed: packed_gemm.linear(x, packed[i], lib=without)
    kernels["torch.mm"] = lambda x, i: torch.mm(x, weights[i].t())
    kernels["C kernel"] = lambda x, i: f32_linear(x, weights[i])  # None beyond its rows
    return kernels


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 256, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=None, help="decoder layers to take (default: all the model's)")
    p.add_argument("--result-json", default="benchmarks/results/f32_gemm.json")
    args = p.parse_args(argv)
    from pagedserve.config import resolve_model
    from workers.model_config import load_hf_config

    hf_config = load_hf_config(resolve_model(MODEL))
    layers = args.layers or hf_config.num_hidden_layers
    shapes = projection_shapes(hf_config) * layers
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    kernels = kernels_for(weights)
    flop_per_row = 2 * sum(n * k for n, k in shapes)
    print(f"{MODEL}: {layers} layers x 4 projections, {4 * flop_per_row / 2e6:.0f} MB of fp32 "
          f"weights, {torch.get_num_threads()} threads, best of {args.repeats}; ms (GFLOP/s)")
    print(f"{'rows':>6} " + " ".join(f"{name:>20}" for name in kernels))
    results = []
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=gen) for _, k in set(shapes)}
        runs = {name: (lambda kernel=kernel: [kernel(inputs[k], i) for i, (_, k) in enumerate(shapes)])
                for name, kernel in kernels.items() if name != "C kernel" or rows <= F32_GEMV_MAX_ROWS}
        for run in runs.values():
            run()  # first calls: oneDNN builds its kernels for the shape
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.repeats):  # alternated, so a slow minute hits them all
            for name, run in runs.items():
                best[name] = min(best[name], timed(run))
        cells = (f"{best[name] * 1e3:>11.2f} ({flop_per_row * rows / best[name] / 1e9:>5.1f})" if name in best
                 else f"{'':>20}" for name in kernels)
        print(f"{rows:>6} " + " ".join(cells))
        results.append({"rows": rows, **{f"{name}_s": seconds for name, seconds in best.items()}})
    out = Path(args.result_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": MODEL, "layers": layers, "threads": torch.get_num_threads(),
                               "packed_gemms": llama.F32_GEMMS, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
