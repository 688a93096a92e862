"""Chaos: the served cluster under steady load while its worker processes are SIGKILLed.

One run, one seeded workload (the offline benchmark's: windows of real English text, greedy,
EOS ignored), sent twice to one `pagedserve serve` (started as a user starts it) by an
`AsyncClient` keeping `--concurrency` streams open:

- **fault-free**: nothing is killed;
- **chaos**: every `--kill-every` seconds the process of a random rank of the serving worker
  group (the coordinator's `worker_pids`, asked through the server's Ray cluster; not its idle
  spares) is SIGKILLed while streams are in flight.

It reports requests completed / sent, greedy outputs identical to the fault-free run, tokens lost
or duplicated (each stream's tokens against its fault-free tokens: a missing tail is lost, an
extra one duplicated), per kill the detection time (kill to health NOT_SERVING) and the recovery
time (kill to health SERVING again, as a client sees it; p50 and max), the server's own recovery
histogram (fault detected to a rebuilt group), the longest gap between two tokens of one stream,
and throughput against the fault-free run.

    .venv/bin/python benchmarks/chaos.py                                  # 64 requests, a kill every 15 s
    .venv/bin/python benchmarks/chaos.py --num-requests 16 --output-len-max 32 --kill-every 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
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


def gcs_address(server_pid: int) -> str:
    """The address of the server's own Ray cluster (other clusters may run on this machine):
    from its gcs_server process's command line."""
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            args = proc.cmdline()
        except psutil.Error:
            continue
        if args and "gcs_server" in args[0]:
            pairs = (a[2:].split("=", 1) for a in args[1:] if a.startswith("--") and "=" in a)
            flags = {key.replace("-", "_"): value for key, value in pairs}
            # The port is picked at start and written into the session folder.
            port_file = next(Path(flags["log_dir"]).parent.glob("gcs_server_port_*"))
            return f"{flags['node_ip_address']}:{port_file.read_text().strip()}"
    raise RuntimeError("the server's gcs_server process was not found")


def serving_worker_pids(server_pid: int) -> list[int]:
    """The ranks of the server's worker group, from its coordinator actor (spares excluded)."""
    import ray

    from coordinator.actor import ACTOR_NAME, NAMESPACE

    if not ray.is_initialized():
        from pagedserve.serve_command import _ray_token_auth_env

        address = gcs_address(server_pid)
        _ray_token_auth_env(address)  # the cluster's token, as `pagedserve status` sends it
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    return ray.get(ray.get_actor(ACTOR_NAME).worker_pids.remote(), timeout=30)


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
    client = pagedserve.AsyncClient(target, timeout=3600)
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


async def kill_workers(target: str, server_pid: int, every: float, stop: asyncio.Event, faults: list[dict],
                       rng) -> None:
    """Every `every` seconds of serving, SIGKILL a random rank and time, by polling health, the
    detection (NOT_SERVING) and the recovery (SERVING again); the next kill waits `every` from
    there, so each fault meets a running group."""
    with pagedserve.Client(target, timeout=5) as client:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every)
                return
            except TimeoutError:
                pass
            pid = rng.choice(await asyncio.to_thread(serving_worker_pids, server_pid))
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            fault = {"detected_s": None, "recovered_s": None}
            faults.append(fault)
            while time.monotonic() - killed < 120:
                serving = await asyncio.to_thread(client.health)
                now = time.monotonic() - killed
                if not serving and fault["detected_s"] is None:
                    fault["detected_s"] = now
                if serving and fault["detected_s"] is not None:
                    fault["recovered_s"] = now
                    break
                if serving and now > 10:  # never seen down: the engine was idle, nothing to detect
                    break
                await asyncio.sleep(0.02)


async def chaos_run(target: str, server_pid: int, requests, args) -> tuple[list, list[float], list[dict]]:
    stop, faults = asyncio.Event(), []
    killer = asyncio.create_task(kill_workers(target, server_pid, args.kill_every, stop, faults,
                                              random.Random(args.seed)))
    try:
        outputs, gaps = await send_all(target, requests, args.concurrency)
    finally:
        stop.set()
        await killer
    return outputs, gaps, faults


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


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
            stormy, gaps, faults = loop.run_until_complete(chaos_run(server.target, server.process.pid, requests, args))
        loop.close()
        with pagedserve.Client(server.target, timeout=60) as client:
            deadline = time.monotonic() + 60
            while not client.health() and time.monotonic() < deadline:
                time.sleep(0.5)
            stats = client.stats()
    finally:
        server.stop()
    kills = len(faults)
    detected = [f["detected_s"] for f in faults if f["detected_s"] is not None]
    recovered = [f["recovered_s"] for f in faults if f["recovered_s"] is not None]
    restarts = int(stats["worker_restarts"] - before["worker_restarts"])
    recovery = float(stats["recovery_seconds_sum"] - before["recovery_seconds_sum"])
    result = {
        "args": vars(args), "requests": len(requests), "prompt_tokens": prompt, "generated_tokens": generated,
        "server_startup_s": startup_s, "kills": kills, "worker_restarts": restarts, "faults": faults,
        "detection_seconds_p50": _p50(detected), "detection_seconds_max": max(detected, default=0.0),
        "recovery_seen_seconds_p50": _p50(recovered), "recovery_seen_seconds_max": max(recovered, default=0.0),
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
    print(f"  kills {kills}, restarts {restarts}; kill to NOT_SERVING p50 {result['detection_seconds_p50']:.2f} s "
          f"(max {result['detection_seconds_max']:.2f}); kill to SERVING again p50 "
          f"{result['recovery_seen_seconds_p50']:.2f} s (max {result['recovery_seen_seconds_max']:.2f}); "
          f"server's rebuild mean {result['recovery_seconds_mean']:.2f} s")
    print(f"  fault-free {calm_watch.seconds:.1f} s, chaos {chaos_watch.seconds:.1f} s: throughput "
          f"{100 * result['throughput_vs_fault_free']:.0f}% of fault-free; longest token gap "
          f"{result['longest_gap_fault_free_s']:.2f} s fault-free, {result['longest_gap_chaos_s']:.2f} s chaos")
    workload.write_json(result, args.result_json)


if __name__ == "__main__":
    main()
