"""Cold start of `pagedserve serve`, measured: seconds from the command to its `serving` line.

The first start runs on an empty cache (a fresh `$PAGEDSERVE_CACHE`): it converts the GGUF
file's config, tokenizer and weights and caches them (workers/gguf_cache.py). The later starts
read that cache. Each start is split into its phases, from the lines `serve` prints: Ray up
("Started a local Ray instance"), bound (gRPC port open, model loading), serving (model loaded,
engine running). Every start is a new process with its own local Ray, stopped by SIGINT.

With --join-ray the cached starts join one Ray cluster started beforehand (`ray start --head`, as
a deployment with `ray up cluster.yaml` has) instead: `serve --address auto`, so that Ray's own
start (its GCS, raylet, dashboard and agents: most of a cached local start) is left out.

    .venv/bin/python benchmarks/cold_start.py                 # 1 uncached + 3 cached starts, ~2 minutes
    .venv/bin/python benchmarks/cold_start.py --join-ray      # and 3 starts joining a running Ray
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = {"ray_up": "Started a local Ray instance", "bound": "pagedserve: bound ", "serving": "serving "}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cached-starts", type=int, default=3)
    p.add_argument("--port", type=int, default=50097)
    p.add_argument("--join-ray", action="store_true",
                   help="also time cached starts that join a Ray cluster started beforehand")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cold_start.json"))
    return p.parse_args(argv)


def one_start(cache: str, port: int, address: str | None = None) -> dict:
    """Seconds from the command to each phase's line, then a clean stop. `address`: a running
    Ray cluster to join (no "ray_up" phase then), or None for a local Ray of its own."""
    command = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port),
               "--http-port", "0", "--metrics-port", "0"] + (["--address", address] if address else [])
    env = {**os.environ, "PAGEDSERVE_CACHE": cache, "TQDM_DISABLE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tempfile.gettempdir(), env=env)
    marks: dict[str, float] = {}
    try:
        for line in proc.stdout:
            for phase, prefix in PHASES.items():
                if phase not in marks and (line.startswith(prefix) or (phase == "ray_up" and prefix in line)):
                    marks[phase] = round(time.perf_counter() - t0, 2)
            if "serving" in marks:
                break
        else:
            raise RuntimeError(f"`pagedserve serve` exited ({proc.wait()}) before serving")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    marks["loading_s"] = round(marks["serving"] - marks["bound"], 2)
    return marks


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pagedserve-cache-") as cache:
        starts = [dict(one_start(cache, args.port), cached=False)]
        print("uncached:", starts[0], flush=True)
        for _ in range(args.cached_starts):
            time.sleep(2)  # the previous Ray's processes finish exiting
            starts.append(dict(one_start(cache, args.port), cached=True))
            print("cached:  ", starts[-1], flush=True)
        joined = _joined_starts(cache, args.port, args.cached_starts) if args.join_ray else []
    cached = [s for s in starts if s["cached"]]
    summary = {key: statistics.median(s[key] for s in cached) for key in ("ray_up", "bound", "serving", "loading_s")}
    summary["uncached_serving"] = starts[0]["serving"]
    summary["uncached_loading_s"] = starts[0]["loading_s"]
    summary["speedup"] = round(starts[0]["serving"] / summary["serving"], 2)
    summary["loading_speedup"] = round(starts[0]["loading_s"] / summary["loading_s"], 2)
    print(f"median cached start: serving after {summary['serving']:.2f} s (Ray up {summary['ray_up']:.2f} s, "
          f"bound {summary['bound']:.2f} s, loading {summary['loading_s']:.2f} s); uncached {starts[0]['serving']:.2f} s "
          f"(loading {starts[0]['loading_s']:.2f} s): {summary['speedup']}x, loading {summary['loading_speedup']}x")
    if joined:
        summary["joined_serving"] = statistics.median(s["serving"] for s in joined)
        summary["joined_loading_s"] = statistics.median(s["loading_s"] for s in joined)
        print(f"median cached start joining a running Ray: serving after {summary['joined_serving']:.2f} s "
              f"(loading {summary['joined_loading_s']:.2f} s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                                          "starts": starts, "joined_starts": joined, "summary": summary}, indent=2))


def _joined_starts(cache: str, port: int, count: int) -> list[dict]:
    """`count` cached starts joining one Ray head started here first (stopped after)."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    # The cluster's processes (the coordinator and workers that read the cache) take their
    # environment from `ray start`, not from `serve`: the cache is set there.
    subprocess.run([ray_cli, "start", "--head", f"--num-cpus={os.cpu_count() or 1}", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PAGEDSERVE_CACHE": cache})
    try:
        time.sleep(3)  # the head's agents finish starting: a deployment's Ray has been up a while
        joined = []
        for _ in range(count):
            joined.append(dict(one_start(cache, port, address="auto"), cached=True))
            print("joined:  ", joined[-1], flush=True)
            time.sleep(2)  # the previous server's actors finish exiting
        return joined
    finally:
        subprocess.run([ray_cli, "stop"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
