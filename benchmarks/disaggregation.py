"""Prefill/decode disaggregation, measured: do long prompts arriving mid-stream still stall the
tokens of running decodes when a prefill replica computes them and hands their KV over?

One workload, the same for every configuration: `--num-decodes` slots of greedy decodes (prompts of
32 seeded token ids, `--decode-tokens` output tokens each, EOS ignored; a slot starts its next
decode when one ends) stream for `--window` seconds and are then cancelled, while long
prompts (`--long-min`..`--long-max` seeded token ids, 8 output tokens each) arrive as a Poisson
process at each of `--rates` per second during the window (the same prompts at the same times for
every configuration); then every long prompt is waited for. Configurations, each its own
coordinator actor in this script's local Ray, one at a time, on `--cores` cores:

- **pd**: one prefill and one decode replica (`--cores`/2 threads each), sharing one KV store;
- **colocated-N**: one replica of `--cores` threads, chunked prefill with max_num_batched_tokens N
  (64, 256, 2048): long prompts' chunks share steps with the decodes;
- **two-replicas**: data_parallel_size 2 (`--cores`/2 threads each), routing auto.

Per configuration and rate, from the client's timestamps of streamed chunks: the decodes'
inter-token latency (each chunk's gap to the previous chunk of its stream, divided by its tokens)
p50/p99/max, the long prompts' TTFT p50/p99, output and total (prompt + output) tokens/s over the
run's wall time (the window and the long prompts' drain); from the server's stats, KV transfer
seconds and bytes per handed-over request. The JSON is rewritten after every configuration.
Target: P/D decodes' ITL p99 <= 1.5 x their ITL p50 at every rate (reported for every config).

    .venv/bin/python benchmarks/disaggregation.py                                   # ~20-25 minutes
    .venv/bin/python benchmarks/disaggregation.py --smoke --model /tmp/tiny_pd      # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

import pagedserve  # noqa: E402
from coordinator.actor import CoordinatorActor, config_dict  # noqa: E402
from coordinator.server_options import ServerOptions  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from workers.local_ray import init_local_ray  # noqa: E402

MiB = 1 << 20
ALL_CONFIGS = ("pd", "colocated-64", "colocated-256", "colocated-2048", "two-replicas")
TARGET_RATIO = 1.5  # ITL p99 / p50
PD_KEYS = ("pd_handoffs", "pd_transfer_blocks_published", "pd_transfer_bytes_published",
           "pd_transfer_seconds_publish_sum", "pd_transfer_seconds_load_sum")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, HF folder or .gguf file")
    p.add_argument("--num-decodes", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=256,
                   help="output tokens of each decode; a finished decode's slot starts the next one")
    p.add_argument("--window", type=float, default=60.0, help="seconds the decodes run and long prompts arrive")
    p.add_argument("--long-min", type=int, default=1024, help="fewest tokens of a long prompt")
    p.add_argument("--long-max", type=int, default=2048, help="most tokens of a long prompt")
    p.add_argument("--rates", default="0.05,0.1,0.2", help="long prompts per second, comma-separated")
    p.add_argument("--configs", default=",".join(ALL_CONFIGS), help=f"a subset of {','.join(ALL_CONFIGS)}")
    p.add_argument("--cores", type=int, default=2, help="worker threads in all: P/D and two replicas split them")
    p.add_argument("--kv-cache-memory", type=int, default=512 * MiB, help="bytes of KV pool per replica")
    p.add_argument("--cpu-threads-bind", default="auto", help="the engines' cpu_threads_bind (auto, nobind)")
    p.add_argument("--pd-min-prompt-tokens", type=int, default=0, help="shorter prompts skip the prefill hop")
    p.add_argument("--pd-decode-prefill-chunk", type=int, default=None,
                   help="the decode replica's long_prefill_token_threshold (default 1)")
    p.add_argument("--pd-prefill-chunk", type=int, default=None,
                   help="the prefill replica's max_num_batched_tokens (default the engine's)")
    p.add_argument("--pd-decode-load-blocks", type=int, default=None,
                   help="the decode replica's max_loaded_blocks_per_step (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="1 decode of 24 tokens, 1 rate, short 'long' prompts")
    p.add_argument("--result-json", default=None, help="default benchmarks/results/disaggregation[_smoke].json")
    p.add_argument("--plot", default=None, help="default docs/disaggregation.png (smoke: under benchmarks/results)")
    args = p.parse_args(argv)
    if args.smoke:
        args.num_decodes, args.decode_tokens, args.rates, args.window = 1, 24, "1.0", 4.0
        args.long_min, args.long_max, args.configs = 64, 96, "pd,colocated-64"
    suffix = "_smoke" if args.smoke else ""
    args.result_json = args.result_json or f"benchmarks/results/disaggregation{suffix}.json"
    args.plot = args.plot if args.plot is not None else (f"benchmarks/results/disaggregation{suffix}.png" if args.smoke
                              else "docs/disaggregation.png")
    args.rates = [float(r) for r in args.rates.split(",")]
    args.configs = args.configs.split(",")
    unknown = sorted(set(args.configs) - set(ALL_CONFIGS))
    if (unknown or not 1 <= args.long_min <= args.long_max or args.decode_tokens < 2 or min(args.rates) <= 0
            or args.window <= 0):
        p.error(f"need --configs among {','.join(ALL_CONFIGS)} (got {unknown or 'ok'}), "
                "1 <= --long-min <= --long-max, --decode-tokens >= 2, --rates > 0 and --window > 0")
    return args


def configuration(name: str, args) -> tuple[EngineConfig, dict]:
    """(engine config, ServerOptions fields) of one configuration."""
    half = max(1, args.cores // 2)
    base = dict(model=args.model, kv_cache_memory=args.kv_cache_memory, enable_chunked_prefill=True,
                cpu_threads_bind=args.cpu_threads_bind)
    if name == "pd":
        decode = {k: v for k, v in (("long_prefill_token_threshold", args.pd_decode_prefill_chunk),
                                    ("max_loaded_blocks_per_step", args.pd_decode_load_blocks)) if v is not None}
        prefill = {} if args.pd_prefill_chunk is None else {"max_num_batched_tokens": args.pd_prefill_chunk}
        return EngineConfig(**base, worker_cpus=half), dict(
            prefill_replicas=1, decode_replicas=1, pd_min_prompt_tokens=args.pd_min_prompt_tokens,
            decode_config=decode, prefill_config=prefill)
    if name == "two-replicas":
        return EngineConfig(**base, worker_cpus=half), dict(data_parallel_size=2, routing_policy="auto")
    tokens = int(name.removeprefix("colocated-"))
    return EngineConfig(**base, worker_cpus=args.cores, max_num_batched_tokens=tokens), {}


# ---- one run: decodes plus Poisson-injected long prompts -----------------------------------------
def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(100, 40000) for _ in range(n)]  # clear of special tokens, inside any vocab here


async def run_rate(target: str, rate: float, rate_index: int, args) -> dict:
    """One pass at `rate`: the decodes stream for `--window` seconds (then are cancelled) while
    long prompts arrive; then every long prompt is waited for. The prompts and arrival times
    depend on the seed and the rate's index only: the same for every configuration."""
    rng = random.Random(args.seed * 1000 + rate_index)
    arrivals, t = [], rng.expovariate(rate)
    while t < args.window:
        arrivals.append((t, ids(rng, rng.randint(args.long_min, args.long_max))))
        t += rng.expovariate(rate)
    async with pagedserve.AsyncClient(target, timeout=1800) as client:
        before = await client.stats()
        start = time.perf_counter()
        end = start + args.window

        async def stream(prompt, max_tokens, until=None):
            sent = last = time.perf_counter()
            ttft, gaps, tokens = None, [], 0
            async for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - sent
                elif chunk.token_ids:
                    gaps.append((now - last) / len(chunk.token_ids))
                last, tokens = now, tokens + len(chunk.token_ids)
                if until is not None and now >= until:
                    break  # the window is over: cancel the stream (the server aborts it)
            return {"prompt": len(prompt), "tokens": tokens, "ttft": ttft, "gaps": gaps, "done": last}

        async def decode_slot(slot: int) -> list[dict]:
            """Decodes of `--decode-tokens` back to back until the window ends (the last one is
            cancelled then), so that a few decodes always run with short contexts."""
            runs = []
            while time.perf_counter() < end:
                prompt = ids(random.Random(f"{args.seed}/{rate_index}/{slot}/{len(runs)}"), 32)
                runs.append(await stream(prompt, args.decode_tokens, end))
            return runs

        decodes = [asyncio.ensure_future(decode_slot(slot)) for slot in range(args.num_decodes)]
        longs = []
        for at, prompt in arrivals:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            longs.append(asyncio.ensure_future(stream(prompt, 8)))
        decoded = [run for runs in await asyncio.gather(*decodes) for run in runs]
        longs = list(await asyncio.gather(*longs))
        after = await client.stats()
    return summarize(decoded, longs, start, args.window, before, after)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(decoded: list[dict], longs: list[dict], start: float, window: float, before: dict,
              after: dict) -> dict:
    everything = decoded + longs
    wall = max(window, max(r["done"] for r in everything) - start)  # the window, then the long prompts' drain
    gaps = [g for r in decoded for g in r["gaps"]]
    ttfts = [r["ttft"] for r in longs]
    output = sum(r["tokens"] for r in everything)
    prompt = sum(r["prompt"] for r in everything)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in PD_KEYS}
    handoffs = delta["pd_handoffs"]
    ms = lambda v: None if v is None else 1000 * v  # noqa: E731
    return {"wall_s": wall, "long_prompts": len(longs), "long_prompt_tokens": sum(r["prompt"] for r in longs),
            "itl_p50_ms": ms(_pct(gaps, 0.5)), "itl_p99_ms": ms(_pct(gaps, 0.99)),
            "itl_max_ms": ms(max(gaps, default=None)), "itl_samples": len(gaps),
            "long_ttft_p50_s": _pct(ttfts, 0.5), "long_ttft_p99_s": _pct(ttfts, 0.99),
            "output_tokens_per_s": output / wall, "total_tokens_per_s": (prompt + output) / wall,
            "pd": {**delta, "transfer_ms_per_request": 1000 * (delta["pd_transfer_seconds_publish_sum"] + delta[
                "pd_transfer_seconds_load_sum"]) / handoffs if handoffs else None,
                "transfer_bytes_per_request": delta["pd_transfer_bytes_published"] / handoffs if handoffs else None}}


# ---- one configuration ---------------------------------------------------------------------------
def run_config(name: str, args) -> dict:
    config, options = configuration(name, args)
    print(f"{name}: starting ({options or 'one replica'}, worker_cpus {config.worker_cpus}, "
          f"max_num_batched_tokens {config.max_num_batched_tokens})", flush=True)
    actor = CoordinatorActor.remote()
    try:
        began = time.monotonic()
        opts = ServerOptions(host="127.0.0.1", port=0, http=False, **options)
        target = f"127.0.0.1:{ray.get(actor.start.remote(config_dict(config), opts), timeout=600)}"
        startup = time.monotonic() - began
        replicas = 2 if options else 1
        with pagedserve.Client(target, timeout=120) as client:  # first-call costs, every replica
            for i in range(replicas):
                client.generate(ids(random.Random(-1 - i), 64), max_tokens=4, temperature=0.0, ignore_eos=True)
        engine = {"worker_cpus": config.worker_cpus, "max_num_batched_tokens": config.max_num_batched_tokens,
                  "cpu_threads_bind": config.cpu_threads_bind}
        report = {"engine": engine, "options": options, "startup_s": startup, "rates": {}}
        for i, rate in enumerate(args.rates):
            r = report["rates"][str(rate)] = asyncio.run(run_rate(target, rate, i, args))
            print(f"  rate {rate:g}/s: {r['long_prompts']} long prompts, ITL p50 {_f(r['itl_p50_ms'])} "
                  f"p99 {_f(r['itl_p99_ms'])} ms, long TTFT p50 {_f(r['long_ttft_p50_s'], 2)} s", flush=True)
    finally:
        try:
            ray.get(actor.shutdown.remote(), timeout=120)
        finally:
            ray.kill(actor)
    rows = report["rates"].values()
    report["itl_target_met"] = all(bool(r["itl_p50_ms"]) and r["itl_p99_ms"] <= TARGET_RATIO * r["itl_p50_ms"]
                                   for r in rows)
    return report


# ---- report --------------------------------------------------------------------------------------
def _f(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict) -> str:
    head = (f"{'config':<15}{'rate/s':>7}{'longs':>6}{'ITL p50':>9}{'p99':>7}{'max':>7}{'TTFT p50':>10}"
            f"{'p99':>7}{'out tok/s':>10}{'tot tok/s':>10}{'xfer ms/req':>12}{'xfer KiB/req':>13}")
    lines = [head, "-" * len(head)]
    for name, rep in results.items():
        for rate, r in rep["rates"].items():
            kib = r["pd"]["transfer_bytes_per_request"]
            lines.append(f"{name:<15}{float(rate):>7g}{r['long_prompts']:>6}{_f(r['itl_p50_ms']):>9}"
                         f"{_f(r['itl_p99_ms']):>7}{_f(r['itl_max_ms']):>7}{_f(r['long_ttft_p50_s'], 2):>10}"
                         f"{_f(r['long_ttft_p99_s'], 2):>7}{r['output_tokens_per_s']:>10.1f}"
                         f"{r['total_tokens_per_s']:>10.1f}{_f(r['pd']['transfer_ms_per_request'], 1):>12}"
                         f"{_f(None if kib is None else kib / 1024, 0):>13}")
    lines.append("ITL in ms, TTFT (long prompts) in s. Target ITL p99 <= "
                 f"{TARGET_RATIO:g} x p50 at every rate: " + ", ".join(
                     f"{name} {'yes' if rep['itl_target_met'] else 'no'}" for name, rep in results.items()))
    return "\n".join(lines)


def plot(results: dict, path: str, model: str) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, (name, rep) in enumerate(results.items()):
        rates = [float(r) for r in rep["rates"]]
        color = f"C{k}"
        ax.plot(rates, [r["itl_p99_ms"] for r in rep["rates"].values()], "o-", color=color, label=f"{name} p99")
        ax.plot(rates, [r["itl_p50_ms"] for r in rep["rates"].values()], "x--", color=color, label=f"{name} p50")
    ax.set_xlabel("long prompts per second")
    ax.set_ylabel("decode inter-token latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{Path(model).name}: decodes' ITL under injected long prompts")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def main(argv=None) -> None:
    args = parse_args(argv)
    # Workers at nice 0, as under `pagedserve serve` (workers/local_ray.py).
    init_local_ray(num_cpus=max(4, args.cores + 2), log_to_driver=False)
    res = {"args": vars(args), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                           "load_average_at_start": os.getloadavg()}, "configs": {}}
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    try:
        for name in args.configs:
            res["configs"][name] = run_config(name, args)
            res["machine"]["load_average_at_end"] = os.getloadavg()
            res["target"] = {"rule": f"ITL p99 <= {TARGET_RATIO} x ITL p50 at every rate",
                             **{name: rep["itl_target_met"] for name, rep in res["configs"].items()}}
            Path(args.result_json).write_text(json.dumps(res, indent=2, default=str))
    finally:
        ray.shutdown()
    print(table(res["configs"]))
    print(f"results: {args.result_json}")
    if args.plot:
        plot(res["configs"], args.plot, args.model)


if __name__ == "__main__":
    main()
