"""Chaos: the served cluster under steady load while its worker processes are SIGKILLed.

One run, one seeded workload (the offline benchmark's: windows of real English text, greedy,
EOS ignored), sent twice to one `pagedserve serve` (started as a user starts it) by an
`AsyncClient` keeping `--concurrency` streams open:

- **fault-free**: nothing is killed;
- **chaos**: every `--kill-every` seconds a random worker actor process (`ray::WorkerActor`,
  found with psutil) is SIGKILLed while streams are in flight.

It reports requests completed / sent, greedy outputs identical to the fault-free run, tokens lost
or duplicated (each stream's tokens against its fault-free tokens: a missing tail is lost, an
extra one duplicated), the server's restarts and recovery time (fault detected to a rebuilt
worker group: p50 and max over the run's restarts), the longest gap between two tokens of one
stream, and throughput against the fault-free run.

    .venv/bin/python benchmarks/chaos.py                                  # 64 requests, a kill every 15 s
    .venv/bin/python benchmarks/chaos.py --num-requests 16 --output-len-max 32 --kill-every 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

import offline_throughput as workload  # noqa: E402  (the same workload and stopwatch)
import serving_throughput as serving  # noqa: E402  (the same server flags)
import pagedserve  # noqa: E402
from pagedserve.bench.embedded import EmbeddedServer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload.add_workload_args(p)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=32, help="streams kept open at once")
    p.add_argument("--kill-every", type=float, default=15.0, help="seconds between worker kills")
    p.add_argument("--max-worker-restarts", type=int, default=100, help="the server's restart budget")
    p.add_argument("--server-start-timeout", type=float, default=300.0)
    p.add_argument("--result-json", default="benchmarks/results/chaos.json")
    return workload.check_workload_args(p, p.parse_args(argv))


def worker_processes(server_pid: int) -> list[psutil.Process]:
    """The server's worker actors: processes titled ray::WorkerActor under its session."""
    found = []
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            if "WorkerActor" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


async def stream_one(client, request, gaps: list[float]) -> list[int]:
    tokens, last = [], None
    async for chunk in client.stream(request.prompt_ids, max_tokens=request.max_tokens, temperature=0.0,
                                     ignore_eos=True):
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        last = now
        tokens += chunk.token_ids
    return tokens


async def send_all(target: str, requests, concurrency: int) -> tuple[list, list[float]]:
    """Every request through at most `concurrency` open streams; a failed stream's entry is its
    exception."""
    client = pagedserve.AsyncClient(target, timeout=600)
    gaps: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def one(request):
        async with gate:
            try:
                return await stream_one(client, request, gaps)
            except pagedserve.ServingError as e:
                return e

    try:
        return await asyncio.gather(*(one(r) for r in requests)), gaps
    finally:
        await client.close()


async def kill_workers(target: str, server_pid: int, every: float, stop: asyncio.Event, kills: list[float],
                       rng) -> None:
    """Every `every` seconds of serving, SIGKILL a random worker: the clock restarts once the
    server is SERVING again, so each fault meets a running group, not one still starting."""
    with pagedserve.Client(target, timeout=5) as client:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every)
                return
            except TimeoutError:
                pass
            while not stop.is_set() and not await asyncio.to_thread(client.health):
                await asyncio.sleep(0.2)
            await kill_one(server_pid, kills, rng)


async def kill_one(server_pid: int, kills: list[float], rng) -> None:
    victims = worker_processes(server_pid)
    if victims:
        victim = rng.choice(victims)
        try:
            os.kill(victim.pid, signal.SIGKILL)
            kills.append(time.monotonic())
        except ProcessLookupError:
            pass


async def chaos_run(target: str, server_pid: int, requests, args) -> tuple[list, list[float], int]:
    stop, kills = asyncio.Event(), []
    killer = asyncio.create_task(kill_workers(target, server_pid, args.kill_every, stop, kills,
                                              random.Random(args.seed)))
    try:
        outputs, gaps = await send_all(target, requests, args.concurrency)
    finally:
        stop.set()
        await killer
    return outputs, gaps, len(kills)


def compare(expected: list[list[int]], got: list) -> dict:
    lost = duplicated = identical = completed = 0
    for want, have in zip(expected, got):
        if isinstance(have, Exception):
            lost += len(want)
            continue
        completed += 1
        identical += have == want
        common = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        lost += max(0, len(want) - len(have))
        duplicated += max(0, len(have) - len(want))
        if common < min(len(want), len(have)):  # a changed token counts as one lost and one extra
            lost += 1
            duplicated += 1
    return {"completed": completed, "identical": identical, "tokens_lost": lost, "tokens_duplicated": duplicated}


def main(argv=None) -> None:
    args = parse_args(argv)
    tokenizer, _ = workload.load_tokenizer_and_config()
    requests = workload.make_workload(tokenizer, args)
    prompt, generated = workload.useful_tokens(requests)
    flags = {**serving.engine_flags(args), "max_worker_restarts": args.max_worker_restarts}
    server = EmbeddedServer(flags)
    try:
        startup_s = server.wait_healthy(args.server_start_timeout)
        loop = asyncio.new_event_loop()
        with workload.Stopwatch() as calm_watch:
            calm, calm_gaps = loop.run_until_complete(send_all(server.target, requests, args.concurrency))
        assert not any(isinstance(o, Exception) for o in calm), "the fault-free run failed a request"
        with pagedserve.Client(server.target, timeout=30) as client:
            before = client.stats()
        with workload.Stopwatch() as chaos_watch:
            stormy, gaps, kills = loop.run_until_complete(chaos_run(server.target, server.process.pid, requests, args))
        loop.close()
        with pagedserve.Client(server.target, timeout=60) as client:
            deadline = time.monotonic() + 60
            while not client.health() and time.monotonic() < deadline:
                time.sleep(0.5)
            stats = client.stats()
    finally:
        server.stop()
    restarts = int(stats["worker_restarts"] - before["worker_restarts"])
    recovery = float(stats["recovery_seconds_sum"] - before["recovery_seconds_sum"])
    result = {
        "args": vars(args), "requests": len(requests), "prompt_tokens": prompt, "generated_tokens": generated,
        "server_startup_s": startup_s, "kills": kills, "worker_restarts": restarts,
        "recovery_seconds_mean": recovery / restarts if restarts else 0.0,
        "recovery_seconds_p50": stats["recovery_seconds_p50"], "recovery_seconds_p99": stats["recovery_seconds_p99"],
        "fault_free_seconds": calm_watch.seconds, "chaos_seconds": chaos_watch.seconds,
        "throughput_vs_fault_free": calm_watch.seconds / chaos_watch.seconds,
        "longest_gap_fault_free_s": max(calm_gaps, default=0.0), "longest_gap_chaos_s": max(gaps, default=0.0),
        **compare(calm, stormy),
    }
    print(f"workload: {len(requests)} requests, {prompt} prompt + {generated} generated tokens, "
          f"{args.concurrency} streams, tensor_parallel_size={args.tensor_parallel_size}, "
          f"a worker killed every {args.kill_every:g} s")
    print(f"  completed {result['completed']} / {len(requests)}; identical to fault-free {result['identical']}; "
          f"tokens lost {result['tokens_lost']}, duplicated {result['tokens_duplicated']}")
    print(f"  kills {kills}, restarts {restarts}; recovery mean {result['recovery_seconds_mean']:.2f} s "
          f"(histogram p50 {result['recovery_seconds_p50']:.2f} s, p99 {result['recovery_seconds_p99']:.2f} s)")
    print(f"  fault-free {calm_watch.seconds:.1f} s, chaos {chaos_watch.seconds:.1f} s: throughput "
          f"{100 * result['throughput_vs_fault_free']:.0f}% of fault-free; longest token gap "
          f"{result['longest_gap_fault_free_s']:.2f} s fault-free, {result['longest_gap_chaos_s']:.2f} s chaos")
    workload.write_json(result, args.result_json)


if __name__ == "__main__":
    main()
