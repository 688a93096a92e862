"""Serving throughput: the whole cluster over gRPC against the offline API, on one workload.

The workload is the offline benchmark's (seeded windows of real English text, per-request output
lengths, EOS ignored). In one run:

- **offline**: `LLM.generate` over all requests in this process (the engine with no server; with
  `--tensor-parallel-size` > 1 its ranks are Ray worker actors too);
- **served**: `pagedserve serve` started as a user starts it (local Ray, the coordinator actor,
  one worker actor per tensor-parallel rank), all requests sent at once as concurrent gRPC
  streams from an `AsyncClient`, timed from the first send to the last token received.

Both sides are timed once their worker's weights are on huge pages, a copy that runs beside a
worker's start (for seconds on a VM whose memory the host backs lazily): the offline `LLM` returns
once it is done, and the served side sends tiny requests until the server's stat
`weights_moving_to_huge_pages` reads 0 (`wait_for_full_speed`).

It reports both throughputs, their ratio (served / offline), whether the greedy tokens agree,
and the server's own figure of what the executor adds per engine step beyond rank 0's compute
(`executor_overhead_us_per_step`: Ray actor calls and serialization).

`--rounds N` repeats the pair N times, alternating which side goes first (offline, served, then
served, offline, ...), and reports every round's ratio and their median: on a shared 2-core VM
identical runs differ by 10-20% from minute to minute, more than the gap being measured, so a
single pair says little and a drift over the run would always favour the side that went first.

    .venv/bin/python benchmarks/serving_throughput.py
    .venv/bin/python benchmarks/serving_throughput.py --num-requests 8 --prompt-len-max 60 --output-len-max 8
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import offline_throughput as workload  # noqa: E402  (the same workload and stopwatch)

import pagedserve  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.bench.embedded import EmbeddedServer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload.add_workload_args(p)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--cpu-threads-bind", default="auto", help="the engines' cpu_threads_bind (auto, nobind)")
    p.add_argument("--server-start-timeout", type=float, default=300.0)
    p.add_argument("--rounds", type=int, default=1,
                   help="offline/served pairs, alternating which goes first; the median ratio is reported")
    p.add_argument("--result-json", default="benchmarks/results/serving_throughput.json")
    args = workload.check_workload_args(p, p.parse_args(argv))
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def engine_flags(args) -> dict:
    return dict(model=workload.MODEL, dtype=args.dtype, block_size=args.block_size,
                kv_cache_memory=args.kv_cache_memory, tensor_parallel_size=args.tensor_parallel_size,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                cpu_threads_bind=args.cpu_threads_bind)


# Where the wall time went, from the engine's own counters: its steps (scheduling, the executor,
# output processing) and, within them, rank 0's compute. Wall time outside the steps is the engine
# loop waiting (for requests, or for its thread to be scheduled).
BREAKDOWN = ("step_duration_seconds_sum", "worker_compute_seconds")


# ---- offline -------------------------------------------------------------------------------------
def run_offline(args, requests, flags: dict | None = None) -> dict:
    """Greedy tokens of every request through `LLM.generate`, timed, with the engine's stats;
    `flags`: the engine's, engine_flags(args) unless given."""
    llm = LLM(**(flags or engine_flags(args)))
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=2),
                 use_tqdm=False)  # first-call costs (the LLM itself waits for its weights' copy)
    before = llm.stats()
    prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    with workload.Stopwatch() as watch:
        outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    llm.shutdown()
    del llm
    gc.collect()
    return {"watch": watch, "outputs": [list(o.outputs[0].token_ids) for o in outs], "stats": stats,
            "spent": {key: stats[key] - before[key] for key in BREAKDOWN}}


# ---- served --------------------------------------------------------------------------------------
def wait_for_full_speed(run_tiny_request, read_stats, timeout: float = 300.0) -> float:
    """Run tiny requests until a step has run with the weights on huge pages (workers/huge_pages.py)
    and return the seconds waited. A server's workers copy their weights there beside its start; on
    a VM whose memory the host backs lazily that copy takes seconds of a core, and a run timed from
    the start would time the copy too. (An offline `LLM` returns once its copy is done.)"""
    started = time.perf_counter()
    while True:
        run_tiny_request()
        if not read_stats().get("weights_moving_to_huge_pages", 0):
            return time.perf_counter() - started
        if time.perf_counter() - started > timeout:
            raise TimeoutError(f"the weights were still moving onto huge pages after {timeout:.0f} s")
        time.sleep(0.25)


async def send_all(target: str, requests) -> list[list[int]]:
    client = pagedserve.AsyncClient(target)
    try:
        await client.generate([1, 2, 3], max_tokens=2, temperature=0.0)  # first-call costs
        return await asyncio.gather(*(_tokens(client, r) for r in requests))
    finally:
        await client.close()


async def _tokens(client, request) -> list[int]:
    out = await client.generate(request.prompt_ids, max_tokens=request.max_tokens, temperature=0.0,
                                ignore_eos=True)
    return out.token_ids


def run_served(args, requests) -> dict:
    server = EmbeddedServer(engine_flags(args))
    target = server.target
    try:
        startup_s = server.wait_healthy(args.server_start_timeout)
        with pagedserve.Client(target, timeout=30) as client:
            wait_for_full_speed(lambda: client.generate([1, 2, 3], max_tokens=2, temperature=0.0),
                                client.stats)  # as the offline side
            before = client.stats()
        loop = asyncio.new_event_loop()
        with workload.Stopwatch() as watch:
            outputs = loop.run_until_complete(send_all(target, requests))
        loop.close()
        with pagedserve.Client(target, timeout=30) as client:
            stats = client.stats()
    finally:
        server.stop()  # Ctrl-C, as a user stops it
    steps = int(stats["num_steps"] - before["num_steps"])
    spent = {key: stats[key] - before[key] for key in BREAKDOWN}
    overhead_us = ((stats["executor_overhead_us_per_step"] * stats["num_steps"]
                    - before["executor_overhead_us_per_step"] * before["num_steps"]) / max(1, steps))
    return {"watch": watch, "outputs": outputs, "stats": stats, "startup_s": startup_s,
            "steps": steps, "executor_overhead_us_per_step": overhead_us, "spent": spent}


# ---- report --------------------------------------------------------------------------------------
def run_round(args, requests, served_first: bool) -> tuple[dict, dict]:
    """One offline run and one served run of the same workload, in the order asked."""
    if served_first:
        served = run_served(args, requests)
        return run_offline(args, requests), served
    offline = run_offline(args, requests)
    return offline, run_served(args, requests)


def main(argv=None) -> None:
    args = parse_args(argv)
    tokenizer, _ = workload.load_tokenizer_and_config()
    requests = workload.make_workload(tokenizer, args)
    prompt, generated = workload.useful_tokens(requests)
    pairs, ratios = [], []
    for index in range(args.rounds):
        offline, served = run_round(args, requests, served_first=index % 2 == 1)
        pairs.append((offline, served))
        ratios.append(offline["watch"].seconds / served["watch"].seconds)
        print(f"round {index + 1}/{args.rounds}: offline {offline['watch'].seconds:.2f} s, served "
              f"{served['watch'].seconds:.2f} s, served / offline {ratios[-1]:.3f}", flush=True)
    # The figures below are the round whose ratio is the median (the lower middle of an even count).
    offline, served = pairs[sorted(range(len(ratios)), key=ratios.__getitem__)[(len(ratios) - 1) // 2]]
    rows = {}
    for name, res in (("offline", offline), ("served", served)):
        seconds = res["watch"].seconds
        rows[name] = {"seconds": seconds, "other_cpu_share": res["watch"].other_cpu_share, **res["spent"],
                      "total_tokens_per_s": (prompt + generated) / seconds,
                      "generated_tokens_per_s": generated / seconds}
    result = {
        "args": vars(args), "requests": len(requests), "prompt_tokens": prompt, "generated_tokens": generated,
        **rows,
        "served_over_offline": rows["served"]["total_tokens_per_s"] / rows["offline"]["total_tokens_per_s"],
        "rounds": [{"offline_s": o["watch"].seconds, "served_s": s["watch"].seconds, "served_first": i % 2 == 1,
                    "served_over_offline": r} for i, ((o, s), r) in enumerate(zip(pairs, ratios))],
        "served_over_offline_median": statistics.median(ratios),
        "identical_outputs": min(sum(a == b for a, b in zip(o["outputs"], s["outputs"])) for o, s in pairs),
        "server_startup_s": served["startup_s"],
        "server_steps": served["steps"],
        "executor_overhead_us_per_step": served["executor_overhead_us_per_step"],
        "offline_executor_overhead_us_per_step": offline["stats"]["executor_overhead_us_per_step"],
    }
    print(f"workload: {len(requests)} requests, {prompt} prompt + {generated} generated tokens, "
          f"{args.dtype}, tensor_parallel_size={args.tensor_parallel_size}"
          + (f"; the round of the median ratio, of {args.rounds}:" if args.rounds > 1 else ""))
    for name in ("offline", "served"):
        r = rows[name]
        share = "n/a" if r["other_cpu_share"] is None else f"{100 * r['other_cpu_share']:.1f}%"
        print(f"  {name:8s} {r['seconds']:8.2f} s  {r['total_tokens_per_s']:8.1f} tok/s total  "
              f"{r['generated_tokens_per_s']:7.1f} gen tok/s  (other processes' CPU {share})")
        print(f"           in engine steps {r['step_duration_seconds_sum']:.2f} s, of which rank 0 computed "
              f"{r['worker_compute_seconds']:.2f} s")
    print(f"  served / offline throughput: {result['served_over_offline']:.3f}"
          + (f" (rounds: {', '.join(f'{r:.3f}' for r in ratios)}; median {result['served_over_offline_median']:.3f})"
             if args.rounds > 1 else ""))
    print(f"  identical greedy outputs: {result['identical_outputs']} of {len(requests)}"
          + (" (the fewest of any round)" if args.rounds > 1 else ""))
    print(f"  executor overhead per step: served {result['executor_overhead_us_per_step']:.0f} us "
          f"(Ray, {served['steps']} steps), offline {result['offline_executor_overhead_us_per_step']:.0f} us "
          f"(in process)")
    workload.write_json(result, args.result_json)


if __name__ == "__main__":
    main()
