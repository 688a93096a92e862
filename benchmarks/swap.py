"""Swap: the CPU KV store's shared-memory transport against plain memcpy, and swap preemption
against recompute on a workload whose KV pool forces preemption; one run, SmolLM2 fp32.

1. bandwidth: swap out then swap in `--blocks` SmolLM2-sized blocks (737,280 bytes each) through
   the store's segment (the workers' path: one copy per block between the cache and the mapping)
   and through the store's gRPC service on loopback, against `copy_` of the same bytes between
   two ordinary tensors;
2. the auto-mode threshold: the cost of swapping a victim out and back (fixed + per token, from
   the shared-memory timings of 1 and `--blocks` blocks) against recomputing its tokens (marginal
   prefill cost per token, from two prefills of SmolLM2 in this run): the victim size from which
   swapping is cheaper, against the `AUTO_SWAP_MIN_TOKENS` the scheduler uses;
3. time to first token of a prompt whose `--prefix-blocks`-block prefix was evicted from the
   device by other work: served from the CPU tier of the prefix cache against recomputed (no
   store), and against a device-cache hit, outputs compared;
4. throughput: the offline benchmark's workload (seeded, EOS ignored) with a KV pool of
   `--pool-blocks` blocks, preemption_mode swap against recompute: seconds, tokens/s,
   preemptions, blocks swapped, and whether the greedy outputs agree.

    .venv/bin/python benchmarks/swap.py
    .venv/bin/python benchmarks/swap.py --blocks 16 --num-requests 4 --prompt-len-max 60 --output-len-max 8   # smoke
"""

from __future__ import annotations

import argparse
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
from kvstore.shm_transport import ShmSwapSpace  # noqa: E402
from kvstore.store import KVStore  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402

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
    p.add_argument("--prefix-blocks", type=int, default=64, help="shared prefix of the TTFT test, in blocks")
    p.add_argument("--skip-throughput", action="store_true", help="skip the workload throughput test")
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
        space = ShmSwapSpace(store.layout, 0, cache)
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
        space = GrpcSwapSpace(layout, 0, cache)
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


def auto_threshold(repeats: int, blocks: int) -> dict:
    """Swap versus recompute for one victim, both measured here, as cost(tokens) = fixed + slope."""
    from coordinator.scheduler import AUTO_SWAP_MIN_TOKENS

    cache = torch.randn(blocks, *SMOLLM2_BLOCK_SHAPE)
    block_bytes = cache[0].numel() * cache.element_size()
    store = KVStore(blocks, 1, block_bytes)
    try:
        space = ShmSwapSpace(store.layout, 0, cache)
        round_trip = {}
        for n in (1, blocks):
            pairs = [(b, b) for b in range(n)]
            round_trip[n] = best_seconds(lambda: space.swap_out(pairs) or space.swap_in(pairs), repeats)
        space.close()
    finally:
        store.close()
    swap_per_token = (round_trip[blocks] - round_trip[1]) / ((blocks - 1) * 16)
    swap_fixed = max(round_trip[1] - 16 * swap_per_token, 0.0)
    # Recompute: the marginal prefill cost per token (a victim's tokens join other work's steps).
    short, long = 64, 512
    with LLM(workload.MODEL, kv_cache_memory=1 << 28, enable_prefix_caching=False) as llm:
        def prefill(n):
            return lambda: llm.generate({"prompt_token_ids": [7 + i % 1000 for i in range(n)]},
                                        SamplingParams(max_tokens=1), use_tqdm=False)
        t_short, t_long = best_seconds(prefill(short), 2), best_seconds(prefill(long), 2)
    recompute_per_token = (t_long - t_short) / (long - short)
    crossover = swap_fixed / max(recompute_per_token - swap_per_token, 1e-12)
    return {"swap_fixed_us": swap_fixed * 1e6, "swap_us_per_token": swap_per_token * 1e6,
            "recompute_us_per_token": recompute_per_token * 1e6, "swap_cheaper_from_tokens": crossover,
            "auto_swap_min_tokens": AUTO_SWAP_MIN_TOKENS}


def prefix_tier_ttft(args, tokenizer) -> dict:
    """TTFT of a prompt whose long prefix other work evicted from the device: from the CPU tier,
    recomputed, and (reference) found on the device."""
    block_bytes, bs = 737_280, 16
    corpus = tokenizer.encode(workload.corpus_text(), add_special_tokens=False)
    prefix = corpus[:args.prefix_blocks * bs]
    rest = len(prefix)  # questions and fillers come from text after the prefix
    ask = lambda i: {"prompt_token_ids": prefix + corpus[rest + 40 * i:rest + 40 * i + 24]}  # noqa: E731
    pool = args.prefix_blocks * 2
    length = min(600, pool * bs // 2)  # each filler fits the pool on its own
    fillers = [{"prompt_token_ids": corpus[rest + 1000 + 700 * i:rest + 1000 + 700 * i + length]}
               for i in range(-(-pool * bs // length) + 1)]  # more than the pool holds
    one = SamplingParams(temperature=0.0, max_tokens=1)
    rows = {}
    for name, swap_space, evict in (("device hit", 0.0, False), ("cpu tier", args.swap_space, True),
                                    ("recompute", 0.0, True)):
        with LLM(workload.MODEL, kv_cache_memory=pool * block_bytes, swap_space=swap_space,
                 max_num_batched_tokens=args.max_num_batched_tokens) as llm:
            llm.generate(ask(0), one, use_tqdm=False)  # the prefix is computed once
            if evict:
                llm.generate(fillers, one, use_tqdm=False)
            before = llm.stats()
            start = time.perf_counter()
            out = llm.generate(ask(1), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            seconds = time.perf_counter() - start
            after = llm.stats()
        rows[name] = {"ttft_s": seconds, "token": out[0].outputs[0].token_ids,
                      "device_hit_tokens": (after["prefix_cache_hits"] - after["cpu_prefix_cache_hits"])
                      - (before["prefix_cache_hits"] - before["cpu_prefix_cache_hits"]),
                      "cpu_tier_hit_tokens": after["cpu_prefix_cache_hits"] - before["cpu_prefix_cache_hits"]}
    return {**rows, "prefix_tokens": len(prefix),
            "same_token": len({str(r["token"]) for r in rows.values()}) == 1,
            "recompute_over_cpu_tier": rows["recompute"]["ttft_s"] / rows["cpu tier"]["ttft_s"]}


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
    result["auto_threshold"] = a = auto_threshold(args.repeats, args.blocks)
    print(f"auto threshold: swap out+in {a['swap_fixed_us']:.0f} us + {a['swap_us_per_token']:.2f} us/token; "
          f"recompute {a['recompute_us_per_token']:.0f} us/token: swap is cheaper from "
          f"{a['swap_cheaper_from_tokens']:.2f} tokens (scheduler: AUTO_SWAP_MIN_TOKENS = {a['auto_swap_min_tokens']})")
    tokenizer, _ = workload.load_tokenizer_and_config()
    result["prefix_tier_ttft"] = p = prefix_tier_ttft(args, tokenizer)
    print(f"TTFT, {p['prefix_tokens']}-token prefix evicted from the device:")
    for name in ("device hit", "cpu tier", "recompute"):
        r = p[name]
        print(f"  {name:10s} {1000 * r['ttft_s']:8.1f} ms  (device hits {r['device_hit_tokens']} tokens, "
              f"CPU tier {r['cpu_tier_hit_tokens']})")
    print(f"  recompute / cpu tier: {p['recompute_over_cpu_tier']:.2f}x; same first token: {p['same_token']}")
    if not args.skip_throughput:
        requests = workload.make_workload(tokenizer, args)
        result["throughput"] = t = throughput(args, requests)
        print(f"throughput, {len(requests)} requests on a {args.pool_blocks}-block pool:")
        for mode in ("swap", "recompute"):
            r = t[mode]
            print(f"  {mode:9s} {r['seconds']:7.2f} s  {r['total_tokens_per_s']:7.1f} tok/s  "
                  f"preemptions {r['num_preemptions']}, blocks swapped out {r['swap_out_blocks']}")
        print(f"  swap / recompute: {t['swap_over_recompute']:.3f}; identical outputs {t['identical_outputs']} of "
              f"{t['requests']}")
    workload.write_json(result, args.result_json)


if __name__ == "__main__":
    main()
