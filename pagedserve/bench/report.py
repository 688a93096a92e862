"""The figures of a benchmark run: throughput, latency percentiles, what the server did (from its
stats before and after), and the table printed at the end."""

from __future__ import annotations

import numpy as np

from pagedserve.bench.runner import RunResult

PERCENTILES = (50, 90, 99)


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {f"p{q}": None for q in PERCENTILES} | {"mean": None}
    arr = np.asarray(values) * 1000.0  # ms
    return {f"p{q}": float(np.percentile(arr, q)) for q in PERCENTILES} | {"mean": float(arr.mean())}


def summarize(run: RunResult) -> dict:
    ok = [r for r in run.results if r.error is None]
    failed = [r for r in run.results if r.error is not None]
    before, after = run.stats_before, run.stats_after

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    queries = delta("prefix_cache_queries")
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    usage = [p["kv_usage"] for p in run.timeline]
    # The engine keeps one peak for its lifetime: when it rose in this run it is this run's peak,
    # which a poll every 0.25 s misses in a run shorter than that.
    engine_peak = (after.get("kv_blocks_peak_used", 0.0) / max(after.get("kv_blocks_total", 1.0), 1.0)
                   if delta("kv_blocks_peak_used") > 0 else None)
    return {
        "backend": run.backend,
        "server_stats": bool(after),  # False: no stats client; the server's figures below mean nothing
        "requests": len(run.results), "completed": len(ok), "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:5],
        "duration_s": run.duration,
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "request_throughput": len(ok) / run.duration,
        "output_token_throughput": output_tokens / run.duration,
        "total_token_throughput": (input_tokens + output_tokens) / run.duration,
        "ttft_ms": _percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _percentiles([x for r in ok for x in r.inter_token_latencies()]),
        "e2e_ms": _percentiles([r.e2e for r in ok]),
        "preemptions": int(delta("num_preemptions")),
        "swap_preemptions": int(delta("num_swap_preemptions")),
        "prefix_cache_hit_rate": delta("prefix_cache_hits") / queries if queries else 0.0,
        "cpu_prefix_cache_hit_tokens": int(delta("cpu_prefix_cache_hits")),
        # The polled peak, or the engine's own (blocks, read every step) where it rose in this run
        # (an earlier, higher one says nothing here), whichever is higher; and the engine's alone.
        "peak_kv_usage": max(usage + ([engine_peak] if engine_peak is not None else []), default=0.0),
        "peak_kv_usage_engine": engine_peak,
        "block_allocation_latency_us_p99": after.get("alloc_latency_us_p99", 0.0),
        # Block tables, hashes and allocator state at their polled peak, over the KV pool's bytes.
        "peak_kv_metadata_share": max((p["kv_metadata_bytes"] for p in run.timeline), default=0.0)
        / max(after.get("kv_pool_bytes", 1.0), 1.0),
        "kv_fragmentation_at_end": after.get("kv_fragmentation", 0.0),
    }


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def format_table(s: dict, baseline: dict | None = None) -> str:
    rows = [
        ("backend", s["backend"]),
        ("requests completed / failed", f"{s['completed']} / {s['failed']}"),
        ("duration", f"{s['duration_s']:.2f} s"),
        ("request throughput", f"{s['request_throughput']:.3f} req/s"),
        ("output token throughput", f"{s['output_token_throughput']:.1f} tok/s"),
        ("total token throughput", f"{s['total_token_throughput']:.1f} tok/s"),
    ]
    for name, key in (("time to first token", "ttft_ms"), ("inter-token latency", "itl_ms"),
                      ("end-to-end latency", "e2e_ms")):
        p = s[key]
        rows.append((f"{name} p50 / p90 / p99", f"{_ms(p['p50'])} / {_ms(p['p90'])} / {_ms(p['p99'])} ms"))
    if s["server_stats"]:  # what the server did, from its stats
        cpu_tier = s["cpu_prefix_cache_hit_tokens"]
        engine_peak = s["peak_kv_usage_engine"]
        rows += [
            ("preemptions (of which swaps)", f"{s['preemptions']} ({s['swap_preemptions']})"),
            ("prefix cache hit rate", f"{100 * s['prefix_cache_hit_rate']:.1f}%"
             + (f" ({cpu_tier} tokens from the CPU tier)" if cpu_tier else "")),
            ("peak KV usage", f"{100 * s['peak_kv_usage']:.1f}%"
             + (f" (engine peak {100 * engine_peak:.1f}%)" if engine_peak is not None else "")),
            ("block allocation p99", f"{s['block_allocation_latency_us_p99']:.2f} us"),
            ("block tables + allocator / KV pool", f"{100 * s['peak_kv_metadata_share']:.3f}% at peak"),
        ]
    if baseline is not None:
        rows += [
            ("transformers baseline", f"{baseline['seconds']:.2f} s, {baseline['output_token_throughput']:.1f} "
                                      f"output tok/s (static batches of {baseline['batch_size']})"),
            ("pagedserve / transformers", f"{baseline['speedup']:.2f}x output token throughput"),
        ]
        if baseline.get("identical_outputs") is not None:
            rows.append(("identical greedy outputs", f"{baseline['identical_outputs']} of {s['requests']}"))
    width = max(len(name) for name, _ in rows)
    lines = ["=" * (width + 40)] + [f"{name:<{width}}  {value}" for name, value in rows] + ["=" * (width + 40)]
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)
