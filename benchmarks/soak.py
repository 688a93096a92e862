"""Soak: the served cluster under steady load for a long run, 1% of requests cancelled mid-stream.

`pagedserve serve` (started as a user starts it) gets the offline benchmark's workload over and
over through `--concurrency` open streams for `--duration` seconds; one request in
`--cancel-every` is cancelled after its first token. Every `--sample-every` seconds it samples
each of the server's processes (by role: the coordinator, the worker actors, the KV store): RSS
and open file descriptors, and the shared-memory segments of KV stores in /dev/shm.

It reports, per role, memory growth in MB/h (least-squares slope over the samples after the
first quarter of the run, the warm-up), file descriptors and segments at the start and the end,
and whether the KV pool's free blocks (device and CPU) come back to the idle baseline once the
load stops.

    .venv/bin/python benchmarks/soak.py --duration 600
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

import offline_throughput as workload  # noqa: E402  (the same workload)
import serving_throughput as serving  # noqa: E402  (the same server flags)
import pagedserve  # noqa: E402
from pagedserve.bench.embedded import EmbeddedServer  # noqa: E402

ROLES = {"CoordinatorActor": "coordinator", "WorkerActor": "workers", "KVStore": "kv_store"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload.add_workload_args(p)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--swap-space", type=float, default=0.25, help="GiB of CPU KV store (0: none)")
    p.add_argument("--concurrency", type=int, default=16, help="streams kept open at once")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--cancel-every", type=int, default=100, help="cancel one request in this many")
    p.add_argument("--sample-every", type=float, default=10.0)
    p.add_argument("--server-start-timeout", type=float, default=300.0)
    p.add_argument("--result-json", default="benchmarks/results/soak.json")
    return workload.check_workload_args(p, p.parse_args(argv))


def kv_segments() -> int:
    return sum(1 for name in os.listdir("/dev/shm") if name.startswith("pagedserve-kv-"))


def sample(server_pid: int) -> dict:
    """RSS (MB) and open fds summed per role over the server's processes, and the KV segments."""
    out = {role: {"rss_mb": 0.0, "fds": 0, "processes": 0} for role in ROLES.values()}
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
            role = next((r for name, r in ROLES.items() if name in cmdline), None)
            if role is None:
                continue
            out[role]["rss_mb"] += proc.memory_info().rss / 1e6
            out[role]["fds"] += proc.num_fds()
            out[role]["processes"] += 1
        except psutil.Error:
            pass
    return {"t": time.monotonic(), "segments": kv_segments(), **out}


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB), in MB per hour."""
    if len(points) < 3:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 3600 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


async def load(target: str, requests, args, counts: dict) -> None:
    """Send the workload round and round until `duration` passes; cancel one in `cancel_every`."""
    client = pagedserve.AsyncClient(target, timeout=600)
    end = time.monotonic() + args.duration
    numbered = itertools.count()
    cycle = itertools.cycle(requests)

    async def stream_loop() -> None:
        while time.monotonic() < end:
            request, n = next(cycle), next(numbered)
            cancel = n % args.cancel_every == args.cancel_every - 1
            try:
                async for _ in client.stream(request.prompt_ids, max_tokens=request.max_tokens,
                                             temperature=0.0, ignore_eos=True):
                    if cancel:
                        break  # the stream closes: the server aborts the request
                counts["cancelled" if cancel else "completed"] += 1
            except pagedserve.ServingError:
                counts["failed"] += 1

    try:
        await asyncio.gather(*(stream_loop() for _ in range(args.concurrency)))
    finally:
        await client.close()


async def sampler(server_pid: int, every: float, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(await asyncio.to_thread(sample, server_pid))
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


async def soak(server: EmbeddedServer, requests, args) -> tuple[list, dict]:
    samples, counts, stop = [], {"completed": 0, "cancelled": 0, "failed": 0}, asyncio.Event()
    watcher = asyncio.create_task(sampler(server.process.pid, args.sample_every, samples, stop))
    try:
        await load(server.target, requests, args, counts)
    finally:
        stop.set()
        await watcher
    return samples, counts


def idle_stats(target: str, seconds: float = 30.0) -> dict:
    """The server's stats once nothing runs (cancelled requests' blocks come back within a step)."""
    with pagedserve.Client(target, timeout=30) as client:
        deadline = time.monotonic() + seconds
        stats = client.stats()
        while (stats["num_running"] or stats["num_waiting"]) and time.monotonic() < deadline:
            time.sleep(0.2)
            stats = client.stats()
        return stats


def main(argv=None) -> None:
    args = parse_args(argv)
    tokenizer, _ = workload.load_tokenizer_and_config()
    requests = workload.make_workload(tokenizer, args)
    flags = {**serving.engine_flags(args), "swap_space": args.swap_space}
    server = EmbeddedServer(flags)
    try:
        server.wait_healthy(args.server_start_timeout)
        baseline = idle_stats(server.target)
        first = sample(server.process.pid)
        samples, counts = asyncio.run(soak(server, requests, args))
        after = idle_stats(server.target)
        last = sample(server.process.pid)
    finally:
        server.stop()
    warm = samples[len(samples) // 4:]
    growth = {role: slope_per_hour([(s["t"] - warm[0]["t"], s[role]["rss_mb"]) for s in warm])
              for role in ROLES.values()}
    result = {
        "args": vars(args), "requests": counts,
        "memory_growth_mb_per_hour": growth,
        "rss_mb_start": {role: first[role]["rss_mb"] for role in ROLES.values()},
        "rss_mb_end": {role: last[role]["rss_mb"] for role in ROLES.values()},
        "fds_start": {role: first[role]["fds"] for role in ROLES.values()},
        "fds_end": {role: last[role]["fds"] for role in ROLES.values()},
        "kv_segments_start": first["segments"], "kv_segments_end": last["segments"],
        "kv_blocks_used_idle_before": baseline["kv_blocks_used"], "kv_blocks_used_idle_after": after["kv_blocks_used"],
        "cpu_blocks_used_idle_before": baseline.get("cpu_blocks_used", 0),
        "cpu_blocks_used_idle_after": after.get("cpu_blocks_used", 0),
        "samples": samples,
    }
    print(f"soak: {args.duration:g} s, {args.concurrency} streams, 1 in {args.cancel_every} cancelled: "
          f"{counts['completed']} completed, {counts['cancelled']} cancelled, {counts['failed']} failed")
    for role in ROLES.values():
        print(f"  {role:<12} RSS {first[role]['rss_mb']:.0f} -> {last[role]['rss_mb']:.0f} MB, growth "
              f"{growth[role]:+.1f} MB/h after warm-up; fds {first[role]['fds']} -> {last[role]['fds']}")
    print(f"  KV segments {first['segments']} -> {last['segments']}; device blocks used when idle "
          f"{baseline['kv_blocks_used']} -> {after['kv_blocks_used']}; CPU blocks used when idle "
          f"{result['cpu_blocks_used_idle_before']} -> {result['cpu_blocks_used_idle_after']}")
    workload.write_json(result, args.result_json)


if __name__ == "__main__":
    main()
