"""bf16 GEMM: the AMX kernel (kernels/cpu/amx_gemm.c; on AVX512-BF16 dot products where the CPU has
no AMX) against oneDNN's GEMM on its own packed weight (what torch runs, and what pagedserve ran
before), on a model's decoder projections.

For each row count, one pass over every layer's four projections (QKV, O, gate/up, down) with
random bf16 weights of the model's shapes, each GEMM kernel timed over the same inputs, the two
alternated `--repeats` times; the best pass of each is reported, with the ratio and the bytes of
weight each read per second. On AVX512-BF16 the kernel as built without its prefetch of the next
pair of blocks (the code before it, "no next") is timed beside them. Where the machine has
neither AMX nor AVX512-BF16 (or the kernel did not build) it says so and stops.

    .venv/bin/python benchmarks/bf16_gemm.py                        # SmolLM2's shapes
    .venv/bin/python benchmarks/bf16_gemm.py --rows 1 16 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from kernels.cpu import amx_gemm  # noqa: E402

MODEL = "smollm2-135m-instruct"


def projection_shapes(hf_config) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's fused projections: QKV, O, gate/up, down."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 160, 256, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--result-json", default="benchmarks/results/bf16_gemm.json")
    args = p.parse_args(argv)
    if not amx_gemm.available():
        print("no AMX nor AVX512-BF16 here (or the kernel did not build): nothing to compare")
        return
    from pagedserve.config import resolve_model
    from workers.model_config import load_hf_config

    hf_config = load_hf_config(resolve_model(MODEL))
    shapes = projection_shapes(hf_config) * hf_config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for n, k in shapes]
    amx = [amx_gemm.pack(w) for w in weights]
    # On AVX512-BF16 the kernel also runs as built without its prefetch of the next pair of blocks.
    without_next = amx_gemm.build_variant("-DDP_NEXT_GROUP=0") if amx_gemm.isa() == "avx512_bf16" else None
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    weight_bytes = sum(w.numel() * 2 for w in weights)
    print(f"{MODEL}: {hf_config.num_hidden_layers} layers x 4 projections, {weight_bytes / 1e6:.0f} MB of bf16 "
          f"weights, {torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"{'rows':>6} {'kernel ms':>9} {'oneDNN ms':>10} {'oneDNN/ker.':>11} {'ker. GB/s':>9}"
          + (f" {'no next ms':>10} {'no next/ker.':>12}" if without_next else ""))
    results = []
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in set(shapes)}

        def run_amx(lib=None):
            for (n, k), packed in zip(shapes, amx):
                amx_gemm.linear(inputs[k], packed, n, lib=lib)

        def run_onednn():
            for (n, k), packed in zip(shapes, onednn):
                torch.ops.mkldnn._linear_pointwise(inputs[k], packed, None, "none", [], "")

        run_amx(), run_onednn()  # first calls: oneDNN builds its kernels for the shape
        t_amx, t_dnn, t_without = float("inf"), float("inf"), float("inf")
        for _ in range(args.repeats):  # alternated, so a slow minute hits all
            t_amx, t_dnn = min(t_amx, timed(run_amx)), min(t_dnn, timed(run_onednn))
            if without_next:
                t_without = min(t_without, timed(lambda: run_amx(without_next)))
        print(f"{rows:>6} {t_amx * 1e3:>9.2f} {t_dnn * 1e3:>10.2f} {t_dnn / t_amx:>10.2f}x "
              f"{weight_bytes / t_amx / 1e9:>9.1f}"
              + (f" {t_without * 1e3:>10.2f} {t_without / t_amx:>11.2f}x" if without_next else ""))
        results.append({"rows": rows, "amx_s": t_amx, "onednn_s": t_dnn,
                        **({"no_next_s": t_without} if without_next else {})})
    print(f"the kernel ran on {amx_gemm.isa()}; pagedserve takes it up to {amx_gemm.MAX_ROWS} rows, "
          "oneDNN's GEMM beyond")
    out = Path(args.result_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": MODEL, "threads": torch.get_num_threads(), "weight_bytes": weight_bytes,
                               "max_rows": amx_gemm.MAX_ROWS, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
