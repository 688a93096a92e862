"""Decode attention over long contexts: the C decode kernel (kernels/cpu/paged_decode_attention.c)
splitting a context past 1,024 tokens into parts of about equal length, one per 1,024 tokens
begun, that every thread takes (flash-decoding),
against the same kernel built without the split (`-DDECODE_SPLIT_FROM` past every context), where
each sequence is one thread's work.

SmolLM2's attention shape (9 query / 3 KV heads of 64, 16-token blocks placed at random), each
layer its own cache (30 of them: a step reads every layer's K/V once, as the model does). Cases:
one stream at 1.2k-8k tokens (a long chat, where the split matters: one sequence on one core),
2 and 5 streams, and a batch of 32 at 1-2k tokens (where the work already spreads, and the split
only adds its merges). The two builds alternate; reported: the median ms of a step's 30 layers
for each, the ratio, and the largest difference between their outputs.

    .venv/bin/python benchmarks/decode_attention_split.py                 # ~1 minute
    .venv/bin/python benchmarks/decode_attention_split.py --dtype bfloat16  # a bf16 cache
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from kernels import cpu  # noqa: E402
from kernels.random_batch import shuffled_block_tables  # noqa: E402
from benchmarks.offline_throughput import write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 9, 3, 64, 16, 30
SCALE = HEAD_DIM ** -0.5
CASES = {  # name: context lengths of the step's sequences
    "1 stream, 1,200 tokens": [1200],
    "1 stream, 2,048 tokens": [2048],
    "1 stream, 4,096 tokens": [4096],
    "1 stream, 8,192 tokens": [8192],
    "2 streams, 3,000-3,500 tokens": [3000, 3500],
    "5 streams, 1,500-2,500 tokens": [1500, 1750, 2000, 2250, 2500],
    "32 streams, 1,024-2,048 tokens": [1024 + 32 * i for i in range(32)],
}


def make_step(lens: list[int], gen: torch.Generator, dtype: torch.dtype):
    """Per layer a cache holding exactly the step's blocks, in a random order; the queries."""
    blocks = sum(-(-n // BLOCK_SIZE) for n in lens)
    tables, _ = shuffled_block_tables(gen, BLOCK_SIZE, [1] * len(lens), lens, blocks)
    caches = [(torch.rand(blocks, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen) - 0.5).to(dtype)
              for _ in range(LAYERS)]
    query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen)
    return caches, query, tables, torch.tensor(lens, dtype=torch.int32)


def step_ms(lib, caches, query, tables, lens, out) -> float:
    start = time.perf_counter()
    for cache in caches:
        cpu.decode_attention(out, query, cache, tables, lens, SCALE, lib=lib)
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the cache's")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--result-json", default="benchmarks/results/decode_attention_split.json")
    args = p.parse_args(argv)
    if not cpu.available():
        sys.exit("no C compiler with OpenMP: the decode kernel did not build")
    dtype = getattr(torch, args.dtype)
    builds = {"split": cpu.load(), "whole": cpu.decode_variant(f"-DDECODE_SPLIT_FROM={1 << 30}")}
    gen = torch.Generator().manual_seed(0)
    print(f"decode attention, {LAYERS} layers, {args.dtype} cache, {torch.get_num_threads()} threads; ms a step "
          "(median), whole contexts -> split")
    results = {}
    for name, lens in CASES.items():
        caches, query, tables, lens_t = make_step(lens, gen, dtype)
        outs = {build: torch.empty_like(query) for build in builds}
        times = {build: [] for build in builds}
        for _ in range(args.repeats):
            for build, lib in builds.items():
                times[build].append(step_ms(lib, caches, query, tables, lens_t, outs[build]))
        whole, split = (statistics.median(times[b]) for b in ("whole", "split"))
        diff = float((outs["split"] - outs["whole"]).abs().max())
        results[name] = {"lens": lens, "whole_ms": whole, "split_ms": split, "speedup": whole / split,
                         "max_abs_diff": diff}
        print(f"  {name:34s} {whole:8.2f} -> {split:8.2f} ms  {whole / split:5.2f}x  (max |diff| {diff:.1e})")
        del caches
    write_json({"dtype": args.dtype, "threads": torch.get_num_threads(), "cases": results}, args.result_json)


if __name__ == "__main__":
    main()
