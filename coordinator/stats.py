"""The engine's figures as one flat dict (LLM.stats(), GetStats)."""

from __future__ import annotations

import math
import sys

from coordinator.sequence import SequenceStatus

_INT_BYTES = 28  # a block id as a Python int object (counted as if none were shared)
_HASH_BYTES = sys.getsizeof(b"x" * 16)  # a 16-byte block hash as a bytes object


def _percentile_us(samples_ns, q: float) -> float:
    if not samples_ns:
        return 0.0
    ordered = sorted(samples_ns)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] / 1000.0  # nearest rank


def request_states(engine) -> dict[str, int]:
    """Requests in flight by state, each counted once: running if any of its sequences runs,
    else swapped if any is swapped out, else waiting."""
    counts = {"running": 0, "waiting": 0, "swapped": 0}
    for req in list(engine.requests.values()):
        states = {c.seq.status for c in req.completions}
        if all(s.finished for s in states) and not req.seq.fork_ids:
            continue  # counted as finished already, about to leave the table
        if SequenceStatus.RUNNING in states:
            counts["running"] += 1
        elif SequenceStatus.SWAPPED in states:
            counts["swapped"] += 1
        else:
            counts["waiting"] += 1
    return counts


def kv_metadata_bytes(engine) -> int:
    """What the coordinator holds to manage the KV pool: every live sequence's block table and
    block hashes, and the allocator's per-block arrays, free queue and hash index."""
    kv, pool = engine.kv, engine.kv.pool
    total = sum(sys.getsizeof(x) for x in (pool.ref_counts, pool.block_hash, pool.free_queue, pool.cached,
                                            kv.block_fill))
    total += pool.num_cached * (_HASH_BYTES + _INT_BYTES)
    for req in list(engine.requests.values()):
        for completion in req.completions:
            seq = completion.seq
            total += sys.getsizeof(seq.block_table) + _INT_BYTES * len(seq.block_table)
            total += sys.getsizeof(seq.block_hashes) + _HASH_BYTES * len(seq.block_hashes)
    return total


def engine_stats(engine) -> dict:
    kv, pool, sched = engine.kv, engine.kv.pool, engine.scheduler
    cpu = sched.cpu  # read once: a store restart may replace it meanwhile (a scrape's thread)
    requests = request_states(engine)
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
        "num_running": len(sched.running),  # sequences (samples and beams count one each)
        "num_waiting": len(sched.waiting),
        "num_swapped": len(sched.swapped),  # groups
        "num_requests_running": requests["running"],
        "num_requests_waiting": requests["waiting"],
        "num_requests_swapped": requests["swapped"],
        "kv_blocks_free": pool.num_free,
        "kv_pool_bytes": engine.kv_pool_bytes,
        "kv_metadata_bytes": kv_metadata_bytes(engine),
        "cpu_kv_usage": cpu.num_used / cpu.num_blocks if cpu else 0.0,
        "num_swap_preemptions": sched.num_swap_preemptions,
        "num_recompute_preemptions": sched.num_preemptions - sched.num_swap_preemptions,
        "num_steps": engine.num_steps,
        "swap_out_blocks": sched.swap_out_blocks,
        "swap_in_blocks": sched.swap_in_blocks,
        "swap_out_bytes": sched.swap_out_blocks * engine.swap_block_bytes,
        "swap_in_bytes": sched.swap_in_blocks * engine.swap_block_bytes,
        "cpu_blocks_total": cpu.num_blocks if cpu else 0,
        "cpu_blocks_used": cpu.num_used if cpu else 0,
        "cpu_blocks_cached": cpu.num_cached if cpu else 0,  # CPU prefix tier (free too)
        "kv_store_restarts": engine.kv_store_restarts,
        # What the executor adds per step beyond rank 0's own work (Ray calls, serialization).
        "executor_overhead_us_per_step": (
            1e6 * (engine.execute_seconds - engine.worker_seconds) / max(1, engine.num_steps)),
        **engine.metrics.summary(),
    }
