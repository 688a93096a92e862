"""The two doors of one server: serving throughput through HTTP (the OpenAI-compatible API) against
gRPC and the offline API on one workload, and what the HTTP layer adds per streamed token.

In one run, on the offline benchmark's workload (seeded windows of real English text, EOS ignored):

- **offline**: `LLM.generate` over all requests in this process (a fresh `LLM` each pass);
- **grpc** and **http**: one `pagedserve serve`, started as a user starts it, gets the whole
  workload through each door in turn, every request at once as a concurrent stream: gRPC from a
  `pagedserve.AsyncClient`, HTTP as `/v1/completions` with the same token-id prompts, streamed
  (SSE), from `pagedserve bench`'s OpenAI backend (aiohttp).
Each round runs offline, gRPC, HTTP, HTTP, gRPC, offline (the server idles while offline runs),
so drift (other load, warm allocators) falls on all three alike, and each side's best pass
counts: every side gets the same number of passes. Prefix caching is off everywhere: a second
pass of the same prompts would find them cached.
- **single streams**: `--latency-requests` requests one at a time, alternating doors: the
  inter-token latency a lone client sees through each.

Per door: tokens/s (target: HTTP >= 0.95 of gRPC); per streamed token, the CPU time of the
coordinator process (the engine loop, detokenizing and both doors live there, so the difference
between the doors is the HTTP layer's own cost: pydantic, JSON, SSE, uvicorn) and of this client
process; the single-stream inter-token latency. Greedy outputs are checked against the offline
run's.

    .venv/bin/python benchmarks/http_vs_grpc.py                                    # a few minutes
    .venv/bin/python benchmarks/http_vs_grpc.py --num-requests 4 --output-len-max 8 --rounds 1 \\
        --latency-requests 2 --latency-output-len 8                                # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
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
import serving_throughput as serving  # noqa: E402  (the same offline run)
import psutil  # noqa: E402

import pagedserve  # noqa: E402
from pagedserve.bench.backends import GrpcBackend, OpenAIBackend  # noqa: E402
from pagedserve.bench.dataset import BenchRequest  # noqa: E402
from pagedserve.bench.embedded import EmbeddedServer  # noqa: E402
from pagedserve.bench.runner import run_workload  # noqa: E402

DOORS = ("grpc", "http")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload.add_workload_args(p)
    # Smaller than the offline benchmark's default: four served passes must fit in a few minutes.
    p.set_defaults(num_requests=32, prompt_len_max=300, output_len_max=128)
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of offline, grpc, http, http, grpc, offline: 2 passes of each a round")
    p.add_argument("--latency-requests", type=int, default=8, help="single streams, alternating doors")
    p.add_argument("--latency-output-len", type=int, default=64, help="tokens of each single stream")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the server's stream_interval: tokens a stream gathers per message after its first")
    p.add_argument("--server-start-timeout", type=float, default=300.0)
    p.add_argument("--result-json", default="benchmarks/results/http_vs_grpc.json")
    args = workload.check_workload_args(p, p.parse_args(argv))
    if args.rounds < 1 or args.latency_requests < 0 or args.latency_output_len < 2 or args.stream_interval < 1:
        p.error("need --rounds >= 1, --latency-requests >= 0, --latency-output-len >= 2 and --stream-interval >= 1")
    return args


def engine_flags(args) -> dict:
    return dict(model=workload.MODEL, dtype=args.dtype, block_size=args.block_size,
                kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)


# ---- offline -------------------------------------------------------------------------------------
def run_offline(args, requests) -> dict:
    res = serving.run_offline(args, requests, engine_flags(args))  # prefix caching off, as served
    return {"seconds": res["watch"].seconds, "token_ids": res["outputs"]}


# ---- served --------------------------------------------------------------------------------------
def coordinator_process(server: EmbeddedServer) -> psutil.Process:
    """The coordinator actor of this server (a descendant of its `pagedserve serve` process; other
    servers on the machine have their own)."""
    for child in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith("ray::CoordinatorActor"):
                return child
        except psutil.NoSuchProcess:
            continue
    raise RuntimeError("no ray::CoordinatorActor process under the server")


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def backend(door: str, server: EmbeddedServer, max_connections: int | None = None):
    if door == "grpc":
        return GrpcBackend(server.target)
    return OpenAIBackend(server.base_url, "completions", max_connections=max_connections)


def one_pass(door: str, server: EmbeddedServer, coordinator: psutil.Process, requests) -> dict:
    """The whole workload through one door, every request at once."""

    async def run():
        return await run_workload(backend(door, server), requests, progress=False)

    coordinator_before, client_before = _cpu(coordinator), time.process_time()
    result = asyncio.run(run())
    coordinator_s, client_s = _cpu(coordinator) - coordinator_before, time.process_time() - client_before
    failed = [r.error for r in result.results if r.error is not None]
    if failed:
        raise RuntimeError(f"{door}: {len(failed)} requests failed, e.g. {failed[0]}")
    tokens = sum(r.output_len for r in result.results)
    # The warm-up request (2 tokens) falls inside the CPU window: negligible against the workload.
    return {"seconds": result.duration, "generated_tokens": tokens,
            "coordinator_cpu_us_per_token": 1e6 * coordinator_s / tokens,
            "client_cpu_us_per_token": 1e6 * client_s / tokens,
            "token_ids": [r.token_ids for r in result.results], "texts": [r.text for r in result.results]}


def single_streams(args, server: EmbeddedServer, requests) -> dict:
    """Mean inter-token latency of lone requests, per door (doors alternate: g h h g ...)."""
    prompts = [BenchRequest(r.prompt_ids[:64], args.latency_output_len) for r in requests]
    itl: dict[str, list[float]] = {door: [] for door in DOORS}

    async def run(door, request):
        return await run_workload(backend(door, server), [request], progress=False)

    for i in range(args.latency_requests):
        door = DOORS[(i + i // 2) % 2]  # g h h g g h h g: ABBA, as the passes
        result = asyncio.run(run(door, prompts[i % len(prompts)])).results[0]
        if result.error is None and len(result.chunk_times) > 1:
            itl[door].append(statistics.mean(result.inter_token_latencies()))
    return {door: {"mean_itl_ms": 1e3 * statistics.mean(v) if v else None, "requests": len(v)}
            for door, v in itl.items()}


ROUND = ("offline", "grpc", "http", "http", "grpc", "offline")


def run_passes(args, requests) -> dict:
    """`--rounds` rounds of ROUND's passes over one server, then the single streams."""
    server = EmbeddedServer({**engine_flags(args), "stream_interval": args.stream_interval})
    try:
        startup_s = server.wait_healthy(args.server_start_timeout)
        coordinator = coordinator_process(server)
        # As the offline side and serving_throughput.py: the first pass timed the workers' copy of
        # their weights onto huge pages too (seconds of a core on this VM), and lost to the second.
        with pagedserve.Client(server.target, timeout=30) as client:
            serving.wait_for_full_speed(lambda: client.generate([1, 2, 3], max_tokens=2, temperature=0.0),
                                        client.stats, args.server_start_timeout)
        passes = {side: [] for side in ("offline", *DOORS)}
        order = ROUND * args.rounds
        for i, side in enumerate(order):
            done = run_offline(args, requests) if side == "offline" else one_pass(side, server, coordinator, requests)
            passes[side].append(done)
            print(f"  pass {i + 1}/{len(order)} ({side}): {done['seconds']:.2f} s", flush=True)
        latency = single_streams(args, server, requests) if args.latency_requests else {}
    finally:
        server.stop()  # Ctrl-C, as a user stops it
    return {"startup_s": startup_s, "passes": passes, "single_stream": latency}


# ---- report --------------------------------------------------------------------------------------
def main(argv=None) -> None:
    args = parse_args(argv)
    tokenizer, _ = workload.load_tokenizer_and_config()
    requests = workload.make_workload(tokenizer, args)
    prompt, generated = workload.useful_tokens(requests)
    print(f"workload: {len(requests)} requests, {prompt} prompt + {generated} generated tokens, {args.dtype}, "
          f"prefix caching off, {args.rounds} round(s) of {len(ROUND)} passes, stream interval {args.stream_interval}")
    served = run_passes(args, requests)

    rows = {}
    for side, passes in served["passes"].items():
        best = min(passes, key=lambda p: p["seconds"])  # the pass least disturbed by other load
        rows[side] = {"seconds": best["seconds"], "seconds_all": [p["seconds"] for p in passes]}
        if side != "offline":
            rows[side].update({key: statistics.median(p[key] for p in passes)
                               for key in ("coordinator_cpu_us_per_token", "client_cpu_us_per_token")})
    offline = served["passes"]["offline"][0]
    for row in rows.values():
        row["total_tokens_per_s"] = (prompt + generated) / row["seconds"]
        row["generated_tokens_per_s"] = generated / row["seconds"]
    expected_texts = [tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")  # held back by a stream
                      for ids in offline["token_ids"]]
    single = served["single_stream"]
    result = {
        "args": vars(args), "requests": len(requests), "prompt_tokens": prompt, "generated_tokens": generated,
        **rows,
        "http_over_grpc": rows["http"]["total_tokens_per_s"] / rows["grpc"]["total_tokens_per_s"],
        "grpc_over_offline": rows["grpc"]["total_tokens_per_s"] / rows["offline"]["total_tokens_per_s"],
        "http_over_offline": rows["http"]["total_tokens_per_s"] / rows["offline"]["total_tokens_per_s"],
        "http_coordinator_cpu_us_per_token_added": (rows["http"]["coordinator_cpu_us_per_token"]
                                                    - rows["grpc"]["coordinator_cpu_us_per_token"]),
        "http_wall_us_per_token_added": 1e6 * (rows["http"]["seconds"] - rows["grpc"]["seconds"]) / generated,
        "single_stream": single,
        "identical_outputs": {
            "grpc": sum(ids == expected for ids, expected in
                        zip(served["passes"]["grpc"][0]["token_ids"], offline["token_ids"])),
            "http": sum(text == expected for text, expected in
                        zip(served["passes"]["http"][0]["texts"], expected_texts))},
        "server_startup_s": served["startup_s"],
    }
    print_report(result)
    workload.write_json(result, args.result_json)


def print_report(r: dict) -> None:
    for name in ("offline", *DOORS):
        row = r[name]
        cpu = "" if name == "offline" else (f"  coordinator CPU {row['coordinator_cpu_us_per_token']:6.0f} us/tok"
                                            f"  client CPU {row['client_cpu_us_per_token']:5.0f} us/tok")
        print(f"  {name:8s} {row['seconds']:8.2f} s  {row['total_tokens_per_s']:8.1f} tok/s total  "
              f"{row['generated_tokens_per_s']:7.1f} gen tok/s{cpu}  (passes: "
              f"{', '.join(f'{s:.2f}' for s in row['seconds_all'])} s)")
    print(f"  http / grpc throughput: {r['http_over_grpc']:.3f} (target >= 0.95); grpc / offline "
          f"{r['grpc_over_offline']:.3f}; http / offline {r['http_over_offline']:.3f}")
    print(f"  the HTTP layer adds per streamed token: {r['http_coordinator_cpu_us_per_token_added']:.0f} us of "
          f"coordinator CPU, {r['http_wall_us_per_token_added']:.0f} us of wall time (best passes)")
    if r["single_stream"]:
        g, h = r["single_stream"]["grpc"]["mean_itl_ms"], r["single_stream"]["http"]["mean_itl_ms"]
        if g is not None and h is not None:
            print(f"  single stream inter-token latency: grpc {g:.2f} ms, http {h:.2f} ms ({1e3 * (h - g):+.0f} us)")
    same = r["identical_outputs"]
    print(f"  identical greedy outputs (vs offline): grpc {same['grpc']}, http {same['http']} of {r['requests']}")


if __name__ == "__main__":
    main()
