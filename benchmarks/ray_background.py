"""What an idle Ray cluster costs a compute-bound step on the same cores.

The served / offline target (issue 17: >= 0.95) compares the cluster against the offline API in
one process, where no Ray runs at all. On this 2-core machine a served run's worker computes its
steps ~10% slower than the same engine in process, though the server's other processes use
little CPU. This benchmark isolates Ray's share of that: the same GEMMs (SmolLM2's MLP shape, 64
rows, 30 weights, every thread of torch's pool) timed
- before any Ray runs ("no Ray"),
- with a local Ray cluster up and idle, started as pagedserve starts one ("Ray idle"),
- with that cluster's processes stopped by SIGSTOP ("Ray stopped"), which leaves its memory and
  sockets as they are and takes away only its threads' wakeups,
- with every thread of the cluster's processes at SCHED_IDLE ("Ray SCHED_IDLE"), which lets them
  run only where a core would otherwise idle,
alternating the last three over `--rounds`. It also counts the cluster's wakeups per second
(voluntary context switches of all its threads).

    .venv/bin/python benchmarks/ray_background.py            # ~2 minutes on quiet cores
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import offline_throughput as workload  # noqa: E402  (write_json)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0, help="per timing")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--result-json", default=str(ROOT / "benchmarks" / "results" / "ray_background.json"))
    return p.parse_args(argv)


def time_gemms(rows: int, seconds: float) -> float:
    """Milliseconds per pass over 30 weights of SmolLM2's MLP shape (576 -> 1536)."""
    weights = [torch.randn(1536, 576) for _ in range(30)]
    x = torch.randn(rows, 576)
    for _ in range(3):
        for w in weights:
            F.linear(x, w)
    passes, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for w in weights:
            F.linear(x, w)
        passes += 1
    return (time.perf_counter() - start) / passes * 1e3


def thread_ids(procs: list[psutil.Process]) -> set[int]:
    tids = set()
    for proc in procs:
        try:
            tids.update(thread.id for thread in proc.threads())
        except psutil.NoSuchProcess:
            pass
    return tids


def wakeups_per_second(tids: set[int], seconds: float = 5.0) -> float:
    """Voluntary context switches of these threads a second (/proc has them per thread only)."""
    def voluntary_switches() -> int:
        total = 0
        for tid in tids:
            try:
                status = Path(f"/proc/{tid}/status").read_text()
            except OSError:
                continue  # a thread that ended meanwhile
            total += next(int(line.split()[1]) for line in status.splitlines()
                          if line.startswith("voluntary_ctxt_switches"))
        return total
    before = voluntary_switches()
    time.sleep(seconds)
    return (voluntary_switches() - before) / seconds


def suspend(procs: list[psutil.Process], stop: bool) -> None:
    """SIGSTOP (`stop`) or SIGCONT to each process still there (Ray may end an idle worker)."""
    for proc in procs:
        try:
            proc.suspend() if stop else proc.resume()
        except psutil.NoSuchProcess:
            pass


def set_policy(tids: set[int], policy: int) -> None:
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:
            pass  # a thread that ended meanwhile


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    times: dict[str, list[float]] = {"no Ray": [time_gemms(args.rows, args.seconds)]}

    from workers.local_ray import init_local_ray
    import ray
    this = psutil.Process()
    torch_threads = thread_ids([this])  # the main thread and torch's pool, started by the timing above
    init_local_ray(address="local", num_cpus=os.cpu_count(), log_to_driver=False)
    time.sleep(3)  # past the cluster's start
    # The cluster this process started (its GCS and raylet are children, the raylet's are the agents
    # and workers; no other cluster is touched), and the threads Ray started in this process.
    cluster = this.children(recursive=True)
    own_ray_threads = thread_ids([this]) - torch_threads
    wakeups = wakeups_per_second(thread_ids(cluster))
    try:
        for _ in range(args.rounds):
            times.setdefault("Ray idle", []).append(time_gemms(args.rows, args.seconds))
            suspend(cluster, True)
            try:
                times.setdefault("Ray stopped", []).append(time_gemms(args.rows, args.seconds))
            finally:
                suspend(cluster, False)
            cluster_threads = thread_ids(cluster) | own_ray_threads
            set_policy(cluster_threads, os.SCHED_IDLE)
            try:
                times.setdefault("Ray SCHED_IDLE", []).append(time_gemms(args.rows, args.seconds))
            finally:
                set_policy(cluster_threads, os.SCHED_OTHER)
    finally:
        ray.shutdown()
    time.sleep(2)
    times["no Ray"].append(time_gemms(args.rows, args.seconds))

    baseline = statistics.median(times["no Ray"])
    print(f"{args.rows}-row GEMMs, 30 weights 576 -> 1536, {torch.get_num_threads()} threads; "
          f"the idle cluster's processes woke {wakeups:.0f} times a second")
    result = {"args": vars(args), "ray_wakeups_per_s": wakeups, "machine": {"platform": platform.platform(),
              "cpus": os.cpu_count()}, "variants": {}}
    for name, values in times.items():
        median = statistics.median(values)
        result["variants"][name] = {"ms_per_pass": values, "median_ms": median, "x_no_ray": median / baseline}
        print(f"  {name:15s} {median:7.2f} ms a pass (median of {len(values)}), {median / baseline:.3f}x no Ray")
    workload.write_json(result, args.result_json)


if __name__ == "__main__":
    main()
