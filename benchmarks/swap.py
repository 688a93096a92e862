"""Swap: the CPU KV store's shared-memory transport against plain memcpy, and swap preemption
against recompute on a workload whose KV pool forces preemption; one run, SmolLM2 fp32.

1. bandwidth: swap out then swap in `--blocks` SmolLM2-sized blocks (737,280 bytes each) through
   the store's segment (the workers' path: one copy per block between the cache and the mapping)
   and through the store's gRPC service on loopback, against `copy_` of the same bytes between
   two ordinary tensors;
2. throughput: the offline benchmark's workload (seeded, EOS ignored) with a KV pool of
   `--pool-blocks` blocks, preemption_mode swap against recompute: seconds, tokens/s,
   preemptions, blocks swapped, and whether the greedy outputs agree.

    .venv/bin/python benchmarks/swap.py
    .venv/bin/python benchmarks/swap.py --blocks 16 --num-requests 4 --prompt-len-max 60 --output-len-max 8   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import offline_throughput as workload  # noqa: E402
from kvstore.store import KVStore  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from workers.kv_cache import SwapSpace  # noqa: E402

SMOLLM2_BLOCK_SHAPE = (30, 2, 16, 3, 64)  # layers, K/V, tokens, KV heads, head dim


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload.add_workload_args(p)
    p.set_defaults(num_requests=32, prompt_len_max=400, output_len_max=128)
    p.add_argument("--blocks", type=int, default=256, help="blocks moved in the bandwidth test")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pool-blocks", type=int, default=96, help="device KV pool of the throughput test")
    p.add_argument("--swap-space", type=float, default=2.0, help="GiB of CPU KV store")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="with it, recompute re-finds a victim's full blocks in the prefix cache")
    p.add_argument("--skip-throughput", action="store_true", help="measure the bandwidth only")
    p.add_argument("--result-json", default="benchmarks/results/swap.json")
    return workload.check_workload_args(p, p.parse_args(argv))


def best_seconds(fn, repeats: int) -> float:
    fn()  # first touch of every page
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bandwidth(blocks: int, repeats: int) -> dict:
    cache = torch.randn(blocks, *SMOLLM2_BLOCK_SHAPE)
    block_bytes = cache[0].numel() * cache.element_size()
    total = blocks * block_bytes
    store = KVStore(blocks, 1, block_bytes)
    try:
        space = SwapSpace(store.layout, 0, cache)
        out_pairs = [(b, b) for b in range(blocks)]
        swap_out = best_seconds(lambda: space.swap_out(out_pairs), repeats)
        snapshot = cache.clone()
        swap_in = best_seconds(lambda: space.swap_in(out_pairs) or space.swap_out(out_pairs), repeats)
        space.swap_in(out_pairs)
        assert torch.equal(cache, snapshot)  # the round trip is exact
        space.close()
    finally:
        store.close()
    grpc_out, grpc_in = grpc_bandwidth(cache, blocks, block_bytes, repeats)
    dst = torch.empty_like(cache)
    memcpy = best_seconds(lambda: dst.copy_(cache), repeats)
    # swap_in was timed together with a swap_out (to re-validate the blocks): subtract it.
    swap_in = max(swap_in - swap_out, 1e-9)
    return {"bytes": total, "block_bytes": block_bytes,
            "memcpy_gb_s": total / memcpy / 1e9, "swap_out_gb_s": total / swap_out / 1e9,
            "swap_in_gb_s": total / swap_in / 1e9,
            "swap_out_share_of_memcpy": memcpy / swap_out, "swap_in_share_of_memcpy": memcpy / swap_in,
            "grpc_swap_out_gb_s": total / grpc_out / 1e9, "grpc_swap_in_gb_s": total / grpc_in / 1e9}


def _serve_store(blocks: int, block_bytes: int, conn) -> None:
    store = KVStore(blocks, 1, block_bytes, transport="grpc")
    conn.send(store.layout)
    conn.recv()  # until the benchmark is done
    store.close()


def grpc_bandwidth(cache: torch.Tensor, blocks: int, block_bytes: int, repeats: int) -> tuple[float, float]:
    """The same blocks through the store's gRPC service on loopback, the store in its own process
    (as the store actor is), chunks of 1 MiB."""
    import multiprocessing

    from kvstore.grpc_transport import GrpcSwapSpace

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve_store, args=(blocks, block_bytes, there))
    proc.start()
    try:
        layout = here.recv()
        space = GrpcSwapSpace(layout, 0, cache, layout.grpc_address)
        pairs = [(b, b) for b in range(blocks)]
        out = best_seconds(lambda: space.swap_out(pairs), repeats)
        snapshot = cache.clone()
        both = best_seconds(lambda: space.swap_in(pairs) or space.swap_out(pairs), repeats)
        space.swap_in(pairs)
        assert torch.equal(cache, snapshot)
        space.close()
    finally:
        here.send("done")
        proc.join(timeout=30)
    return out, max(both - out, 1e-9)


def throughput(args, requests) -> dict:
    block_bytes = 737_280
    rows = {}
    for mode in ("swap", "recompute"):
        with LLM(workload.MODEL, kv_cache_memory=args.pool_blocks * block_bytes, swap_space=args.swap_space,
                 preemption_mode=mode, max_num_batched_tokens=args.max_num_batched_tokens,
                 enable_prefix_caching=args.prefix_caching) as llm:
            llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
            params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            stats = llm.stats()
        prompt, generated = workload.useful_tokens(requests)
        rows[mode] = {"seconds": seconds, "total_tokens_per_s": (prompt + generated) / seconds,
                      "num_preemptions": stats["num_preemptions"], "swap_out_blocks": stats["swap_out_blocks"],
                      "swap_out_bytes": stats["swap_out_bytes"],
                      "outputs": [o.outputs[0].token_ids for o in outs]}
    same = sum(a == b for a, b in zip(rows["swap"].pop("outputs"), rows["recompute"].pop("outputs")))
    return {**rows, "identical_outputs": same, "requests": len(requests),
            "swap_over_recompute": rows["swap"]["total_tokens_per_s"] / rows["recompute"]["total_tokens_per_s"]}


def main(argv=None) -> None:
    args = parse_args(argv)
    result = {"args": vars(args), "bandwidth": bandwidth(args.blocks, args.repeats)}
    b = result["bandwidth"]
    print(f"bandwidth, {b['bytes'] / 1e6:.0f} MB in {args.blocks} blocks: memcpy {b['memcpy_gb_s']:.2f} GB/s; "
          f"shared-memory swap out {b['swap_out_gb_s']:.2f} GB/s ({100 * b['swap_out_share_of_memcpy']:.0f}%), "
          f"swap in {b['swap_in_gb_s']:.2f} GB/s ({100 * b['swap_in_share_of_memcpy']:.0f}%); gRPC on loopback "
          f"out {b['grpc_swap_out_gb_s']:.2f} GB/s, in {b['grpc_swap_in_gb_s']:.2f} GB/s")
    if not args.skip_throughput:
        tokenizer, _ = workload.load_tokenizer_and_config()
        requests = workload.make_workload(tokenizer, args)
        result["throughput"] = t = throughput(args, requests)
        print(f"throughput, {len(requests)} requests on a {args.pool_blocks}-block pool:")
        for mode in ("swap", "recompute"):
            r = t[mode]
            print(f"  {mode:9s} {r['seconds']:7.2f} s  {r['total_tokens_per_s']:7.1f} tok/s  "
                  f"preemptions {r['num_preemptions']}, blocks swapped out {r['swap_out_blocks']}")
        print(f"  swap / recompute: {t['swap_over_recompute']:.3f}; identical outputs {t['identical_outputs']} of "
              f"{t['requests']}")
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(result, indent=2))
    print(f"figures: {args.result_json}")


if __name__ == "__main__":
    main()
