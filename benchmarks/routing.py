"""Routing across engine replicas, measured: prefix-aware routing against round-robin and
least-loaded at `--data-parallel-size 2` (one core each), and against one replica of 2 threads,
on a shared-prefix chat workload; then scaling from 1 to 2 replicas on a workload with no
shared prefix.

The shared-prefix workload: `--system-prompts` distinct system prompts of `--system-len` tokens
(windows of real English text), each followed by `--turns` short user turns, sent as Poisson
arrivals at `--rate` requests/s in an order that interleaves the conversations. Each replica's KV
pool (`--kv-cache-memory`) holds only about half of the system prompts: routing decides whether
the two pools hold each prefix once (prefix routing) or both try to hold all of them. The single
replica gets the pools of both (the same memory in all). Per configuration: the prefix-cache hit
rate (prompt tokens served from the cache over prompt tokens looked up), TTFT p50/p90, ITL
p50/p99, output tokens/s from the first send to the last token, and per replica the requests
routed and tokens generated.

    .venv/bin/python benchmarks/routing.py                                            # ~10 minutes
    .venv/bin/python benchmarks/routing.py --system-prompts 2 --system-len 64 --turns 2 \\
        --scaling-requests 4 --output-len 4                                           # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import pagedserve  # noqa: E402
from pagedserve.bench.dataset import corpus_text  # noqa: E402
from pagedserve.bench.embedded import EmbeddedServer  # noqa: E402

MODEL = "smollm2-135m-instruct"
MiB = 1 << 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-len", type=int, default=512, help="tokens of each system prompt")
    p.add_argument("--turns", type=int, default=4, help="user turns per system prompt")
    p.add_argument("--user-len", type=int, default=48, help="tokens of each user turn")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests/s")
    p.add_argument("--kv-cache-memory", type=int, default=128 * MiB, help="bytes of KV pool per replica")
    p.add_argument("--policies", default="prefix,round-robin,least-loaded")
    p.add_argument("--scaling-requests", type=int, default=24, help="no-shared-prefix requests (0: skip)")
    p.add_argument("--scaling-prompt-len", type=int, default=256)
    p.add_argument("--scaling-output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-start-timeout", type=float, default=300.0)
    p.add_argument("--result-json", default="benchmarks/results/routing.json")
    p.add_argument("--plot", default="benchmarks/results/routing.png")
    return p.parse_args(argv)


# ---- workloads -----------------------------------------------------------------------------------
def tokenizer():
    from pagedserve.config import resolve_model
    from workers.gguf_cache import load_tokenizer

    source = resolve_model(MODEL)
    return load_tokenizer(source)


def windows(corpus: list[int], rng: random.Random, length: int, count: int) -> list[list[int]]:
    return [corpus[s:s + length] for s in (rng.randint(0, len(corpus) - length) for _ in range(count))]


def shared_prefix_workload(args, corpus) -> list[tuple[float, list[int], int]]:
    """(arrival second, prompt ids, max tokens): turn t of every conversation before turn t + 1 of
    any, conversations shuffled within a turn, Poisson gaps."""
    rng = random.Random(args.seed)
    systems = windows(corpus, rng, args.system_len, args.system_prompts)
    order = []
    for _ in range(args.turns):
        conversations = list(range(args.system_prompts))
        rng.shuffle(conversations)
        order += conversations
    users = windows(corpus, rng, args.user_len, len(order))
    at, out = 0.0, []
    for k, user in zip(order, users):
        out.append((at, systems[k] + user, args.output_len))
        at += rng.expovariate(args.rate)
    return out


def no_prefix_workload(args, corpus) -> list[tuple[float, list[int], int]]:
    rng = random.Random(args.seed + 1)
    return [(0.0, p, args.scaling_output_len)
            for p in windows(corpus, rng, args.scaling_prompt_len, args.scaling_requests)]


# ---- one configuration ---------------------------------------------------------------------------
async def drive(target: str, workload) -> list[dict]:
    """Send each request at its arrival time as a stream; per request its TTFT, token gaps, tokens."""
    async with pagedserve.AsyncClient(target, timeout=600) as client:
        start = time.perf_counter()

        async def one(at, prompt, max_tokens):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            sent = last = time.perf_counter()
            ttft, gaps, tokens = None, [], 0
            async for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - sent
                elif chunk.token_ids:
                    gaps += [(now - last) / len(chunk.token_ids)] * len(chunk.token_ids)
                last, tokens = now, tokens + len(chunk.token_ids)
            return {"ttft": ttft, "gaps": gaps, "tokens": tokens, "sent": sent - start, "done": last - start}

        return await asyncio.gather(*(one(*r) for r in workload))


def run_config(name: str, flags: dict, workload, args) -> dict:
    print(f"  {name}: starting the server ({flags})", flush=True)
    server = EmbeddedServer({"model": MODEL, **flags})
    try:
        startup = server.wait_healthy(args.server_start_timeout)
        with pagedserve.Client(server.target, timeout=60) as client:
            for i in range(int(flags.get("data_parallel_size", 1))):  # first-call costs, every replica
                client.generate([1, 2, 3 + i], max_tokens=2, temperature=0.0)
            before = client.stats()
        results = asyncio.run(drive(server.target, workload))
        with pagedserve.Client(server.target, timeout=30) as client:
            after = client.stats()
    finally:
        server.stop()
    report = summarize(results, before, after)
    report.update(flags=flags, startup_s=startup)
    print(f"  {name}: hit rate {report['prefix_hit_rate']:.1%}, TTFT p50 {report['ttft_p50_s']:.2f} s "
          f"p90 {report['ttft_p90_s']:.2f} s, ITL p50 {report['itl_p50_ms']:.0f} ms p99 {report['itl_p99_ms']:.0f} ms, "
          f"{report['output_tokens_per_s']:.1f} output tok/s, routed {report.get('routed')}", flush=True)
    return report


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(results: list[dict], before: dict, after: dict) -> dict:
    ttfts = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    span = max(r["done"] for r in results) - min(r["sent"] for r in results)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    queries = delta["prefix_cache_queries"]
    report = {"requests": len(results), "output_tokens": tokens, "seconds": span,
              "output_tokens_per_s": tokens / span if span else 0.0,
              "prefix_hit_rate": delta["prefix_cache_hits"] / queries if queries else 0.0,
              "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p90_s": _pct(ttfts, 0.9), "ttft_mean_s": statistics.fmean(ttfts),
              "itl_p50_ms": 1000 * _pct(gaps, 0.5), "itl_p99_ms": 1000 * _pct(gaps, 0.99)}
    replicas = int(after.get("num_replicas", 1))
    if replicas > 1:
        report["routed"] = [int(delta[f"replica.{i}.routed"]) for i in range(replicas)]
        report["generated_per_replica"] = [int(delta[f"replica.{i}.generation_tokens"]) for i in range(replicas)]
    return report


# ---- main ----------------------------------------------------------------------------------------
def main(argv=None) -> None:
    args = parse_args(argv)
    corpus = tokenizer().encode(corpus_text(), add_special_tokens=False)
    shared = shared_prefix_workload(args, corpus)
    print(f"shared-prefix workload: {len(shared)} requests, {args.system_prompts} system prompts of "
          f"{args.system_len} tokens, {args.rate:g} req/s", flush=True)
    res = {"args": vars(args), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                           "load_average_at_start": os.getloadavg()}, "shared_prefix": {}}
    for policy in args.policies.split(","):
        res["shared_prefix"][policy] = run_config(policy, dict(
            data_parallel_size=2, routing_policy=policy, kv_cache_memory=args.kv_cache_memory), shared, args)
    res["shared_prefix"]["single"] = run_config("single replica, 2 threads", dict(
        kv_cache_memory=2 * args.kv_cache_memory), shared, args)
    sp = res["shared_prefix"]
    if "prefix" in sp:
        single = sp["single"]["prefix_hit_rate"]
        res["prefix_hit_rate_over_single"] = sp["prefix"]["prefix_hit_rate"] / single if single else None
        if "round-robin" in sp:
            res["ttft_p90_round_robin_over_prefix"] = sp["round-robin"]["ttft_p90_s"] / sp["prefix"]["ttft_p90_s"]
    if args.scaling_requests:
        plain = no_prefix_workload(args, corpus)
        res["scaling"] = {n: run_config(f"scaling, {n} replica(s)", dict(
            data_parallel_size=n, kv_cache_memory=args.kv_cache_memory * (2 // n), enable_prefix_caching=False),
            plain, args) for n in (1, 2)}
        res["scaling_2_over_1"] = (res["scaling"][2]["output_tokens_per_s"]
                                   / res["scaling"][1]["output_tokens_per_s"])
    res["machine"]["load_average_at_end"] = os.getloadavg()
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(res, indent=2, default=str))
    print(json.dumps({k: v for k, v in res.items() if k.endswith(("_over_single", "_over_prefix", "_over_1"))}))
    if args.plot:
        plot(res, args.plot)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sp = res["shared_prefix"]
    names = list(sp)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].bar(names, [100 * sp[n]["prefix_hit_rate"] for n in names], color="tab:green")
    axes[0].set_title("prefix-cache hit rate (%)")
    x = range(len(names))
    axes[1].bar([i - 0.2 for i in x], [sp[n]["ttft_p50_s"] for n in names], width=0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [sp[n]["ttft_p90_s"] for n in names], width=0.4, label="p90")
    axes[1].set_xticks(list(x), names)
    axes[1].set_title("TTFT (s)")
    axes[1].legend()
    axes[2].bar(names, [sp[n]["output_tokens_per_s"] for n in names], color="tab:purple")
    axes[2].set_title("output tokens/s")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle("SmolLM2-135M, shared-prefix chat workload, 2 cores: 2 replicas by policy vs 1 replica")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
