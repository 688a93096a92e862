"""PNG plots of a benchmark run: KV usage and requests by state over time, latency distributions."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedserve.bench.runner import RunResult


def write_plots(run: RunResult, plot_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    t = [p["t"] for p in run.timeline]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(t, [100 * p["kv_usage"] for p in run.timeline], label="device KV blocks used")
    if any(p["cpu_kv_usage"] for p in run.timeline):
        top.plot(t, [100 * p["cpu_kv_usage"] for p in run.timeline], label="CPU KV store blocks used")
    top.set_ylabel("KV usage (%)")
    top.set_ylim(0, 105)
    top.legend(loc="upper right")
    top.grid(alpha=0.3)
    for key, label in (("num_requests_running", "running"), ("num_requests_waiting", "waiting"),
                       ("num_requests_swapped", "swapped")):
        bottom.step(t, [p[key] for p in run.timeline], where="post", label=label)
    bottom.set_ylabel("requests")
    bottom.set_xlabel("seconds since the first request")
    bottom.legend(loc="upper right")
    bottom.grid(alpha=0.3)
    fig.suptitle("KV cache usage and requests over time")
    fig.tight_layout()
    paths.append(str(out / "kv_usage_over_time.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    ok = [r for r in run.results if r.error is None]
    series = (("time to first token", [1000 * r.ttft for r in ok if r.ttft is not None]),
              ("inter-token latency", [1000 * x for r in ok for x in r.inter_token_latencies()]),
              ("end-to-end latency", [1000 * r.e2e for r in ok]))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (name, values) in zip(axes, series):
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 3)), color="tab:blue", alpha=0.8)
            for q, style in ((50, "-"), (99, "--")):
                v = float(np.percentile(values, q))  # as the table computes them
                ax.axvline(v, color="tab:red", linestyle=style, label=f"p{q} {v:,.0f} ms")
            ax.legend()
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(str(out / "latency_distributions.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
