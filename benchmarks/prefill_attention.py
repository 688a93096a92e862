"""Prefill attention: the `cpu` backend's C kernel (kernels/cpu/paged_prefill_attention.c) against
the `torch` backend (SDPA over the chunk's gathered blocks, a mask for chunks over cached context),
on SmolLM2's attention shape (9 query / 3 KV heads of 64, 16-token blocks placed at random).

Each case is one engine step's prompt chunks, run once per layer (30 calls), the two backends
alternated; it reports the median ms per step, the causal attention's GFLOP/s (2 FMAs per query
head, key and element attended), the ratio, and the largest difference between the two outputs.
`--dtype bfloat16`: queries and cache in bf16, as a bf16 model runs them (the C kernel's bf16 path
needs AVX512-BF16; torch's is its bf16 SDPA).

    .venv/bin/python benchmarks/prefill_attention.py               # ~1 minute
    .venv/bin/python benchmarks/prefill_attention.py --dtype bfloat16
    .venv/bin/python benchmarks/prefill_attention.py --repeats 3 --layers 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

import kernels  # noqa: E402
from kernels import cpu  # noqa: E402
from kernels.random_batch import random_paged_batch  # noqa: E402
from benchmarks.offline_throughput import write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM ** -0.5
# name: (new tokens per chunk, tokens already cached before it)
CASES = {
    "fresh prompts (6 of 100-600 tokens)": ([300, 500, 200, 600, 100, 348], [0] * 6),
    "chunks over cached context (512 over 988 and 288, 1,024 fresh)": ([512, 512, 1024], [988, 288, 0]),
    "short prompts (16 of 128 tokens)": ([128] * 16, [0] * 16),
}


def make_step(query_lens: list[int], cached_lens: list[int], gen: torch.Generator, dtype: torch.dtype):
    """A one-layer paged cache of `dtype` holding every chunk's context (its new tokens written by
    write_kv), the chunks' queries, and each backend's metadata."""
    batch = random_paged_batch(gen, BLOCK_SIZE, query_lens, cached_lens, HEADS, KV_HEADS, HEAD_DIM)
    cache, query, new_k, new_v = (t.to(dtype) for t in (batch.cache, batch.query, batch.new_k, batch.new_v))
    metas = {name: batch.metadata(kernels.get_backend(name, "cpu", dtype)) for name in ("torch", "cpu")}
    metas["torch"].backend.write_kv(new_k, new_v, cache, metas["torch"])
    return cache, query, new_k, new_v, metas


def attention_flops(query_lens: list[int], cached_lens: list[int]) -> int:
    """Scores and weighted values: 2 x 2 FLOPs per query head, element and key attended."""
    keys = sum(c + i + 1 for q, c in zip(query_lens, cached_lens) for i in range(q))
    return 4 * HEADS * HEAD_DIM * keys


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30, help="calls per step (SmolLM2's layers)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="queries' and cache's")
    p.add_argument("--result-json", default="benchmarks/results/prefill_attention.json")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if not cpu.prefill_takes(dtype):
        print(f"the C prefill kernel takes no {args.dtype} here (not built, or bf16 without AVX512-BF16): "
              "nothing to compare")
        return
    gen = torch.Generator().manual_seed(0)
    results = []
    for label, (query_lens, cached_lens) in CASES.items():
        cache, query, new_k, new_v, metas = make_step(query_lens, cached_lens, gen, dtype)
        backends = {name: metas[name].backend for name in metas}
        outputs = {}

        def step(name):
            for _ in range(args.layers):
                outputs[name] = backends[name].paged_attention(query, new_k, new_v, cache, metas[name], scale=SCALE)

        times = {name: [] for name in backends}
        for name in backends:
            step(name)  # warm: the kernel built, pages touched
        for _ in range(args.repeats):
            for name in backends:
                started = time.perf_counter()
                step(name)
                times[name].append((time.perf_counter() - started) * 1e3)
        flops = attention_flops(query_lens, cached_lens) * args.layers
        row = {"case": label, "query_lens": query_lens, "cached_lens": cached_lens,
               "max_abs_difference": (outputs["cpu"].float() - outputs["torch"].float()).abs().max().item(),
               **{name: {"median_ms": statistics.median(t), "best_ms": min(t),
                         "median_gflops": flops / statistics.median(t) / 1e6} for name, t in times.items()}}
        row["torch_over_cpu_median"] = row["torch"]["median_ms"] / row["cpu"]["median_ms"]
        results.append(row)
        print(f"{label}: torch {row['torch']['median_ms']:.1f} ms ({row['torch']['median_gflops']:.0f} GFLOP/s), "
              f"C kernel {row['cpu']['median_ms']:.1f} ms ({row['cpu']['median_gflops']:.0f} GFLOP/s): "
              f"{row['torch_over_cpu_median']:.2f}x; outputs differ by at most {row['max_abs_difference']:.1e}",
              flush=True)
    write_json({"dtype": args.dtype, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                "block_size": BLOCK_SIZE, "layers": args.layers, "repeats": args.repeats,
                "threads": torch.get_num_threads(),
                "cpu_count": os.cpu_count(), "results": results}, args.result_json)


if __name__ == "__main__":
    main()
