"""The engine's figures as one flat dict (LLM.stats(), GetStats)."""

from __future__ import annotations


def _percentile_us(samples_ns, q: float) -> float:
    if not samples_ns:
        return 0.0
    ordered = sorted(samples_ns)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def engine_stats(engine) -> dict:
    kv, pool, sched = engine.kv, engine.kv.pool, engine.scheduler
    return {
        "kv_blocks_total": pool.num_blocks,
        "kv_blocks_used": pool.num_used,
        "kv_blocks_cached": pool.num_cached,
        "kv_blocks_peak_used": engine.peak_blocks_used,
        "kv_usage": pool.num_used / pool.num_blocks,
        "kv_fragmentation": kv.fragmentation(),
        "prefix_cache_queries": kv.prefix_cache_queries,
        "prefix_cache_hits": kv.prefix_cache_hits,  # tokens, from either tier
        "cpu_prefix_cache_hits": kv.cpu_prefix_cache_hits,  # tokens loaded from the KV store
        "cpu_prefix_cache_saved_blocks": kv.cpu_tier_saved_blocks,
        "cpu_prefix_cache_loaded_blocks": kv.cpu_tier_loaded_blocks,
        "num_preemptions": sched.num_preemptions,
        "alloc_latency_us_p50": _percentile_us(pool.alloc_latency_ns, 0.50),
        "alloc_latency_us_p99": _percentile_us(pool.alloc_latency_ns, 0.99),
        "prompt_tokens": engine.num_prompt_tokens,
        "generation_tokens": engine.num_generation_tokens,
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting),
        "num_swapped": len(sched.swapped),
        "num_steps": engine.num_steps,
        "swap_out_blocks": sched.swap_out_blocks,
        "swap_in_blocks": sched.swap_in_blocks,
        "swap_out_bytes": sched.swap_out_blocks * engine.swap_block_bytes,
        "swap_in_bytes": sched.swap_in_blocks * engine.swap_block_bytes,
        "cpu_blocks_total": sched.cpu.num_blocks if sched.cpu else 0,
        "cpu_blocks_used": sched.cpu.num_used if sched.cpu else 0,
        "cpu_blocks_cached": sched.cpu.num_cached if sched.cpu else 0,  # CPU prefix tier (free too)
        "kv_store_restarts": engine.kv_store_restarts,
        # What the executor adds per step beyond rank 0's own work (Ray calls, serialization).
        "executor_overhead_us_per_step": (
            1e6 * (engine.execute_seconds - engine.worker_seconds) / max(1, engine.num_steps)),
    }
