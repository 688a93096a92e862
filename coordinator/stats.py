"""The engine's figures, taken per step rather than counted in the hot paths.

Each step the scheduler takes a `SchedulerStats` snapshot (queues, pools, prefix cache,
preemptions: gauges and lifetime counters) and the step fills an `IterationStats` (what it did:
token counts, latencies, timings) that `EngineMetrics.record` folds into counters and
histograms. `engine_stats` turns both into the one flat dict that `LLM.stats()`, GetStats and
the Prometheus collector read. A snapshot is an immutable object replaced whole, so a reader on
another thread (a scrape) never sees a half-updated one. Only `kv_metadata_bytes` still walks the
live tables when read (over copies of the lists: safe beside a running step, though not as of
one instant), since a walk over every block table each step would cost more than it tells.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field

from coordinator.sequence import SequenceStatus

_INT_BYTES = 28  # a block id as a Python int object (counted as if none were shared)
_HASH_BYTES = sys.getsizeof(b"x" * 16)  # a 16-byte block hash as a bytes object


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int = 0  # sequences (samples and beams count one each)
    num_waiting: int = 0
    num_swapped: int = 0  # groups
    num_requests_running: int = 0  # requests, each once: running if any sequence runs,
    num_requests_waiting: int = 0  # else swapped if any is swapped out, else waiting
    num_requests_swapped: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_peak_used: int = 0
    kv_fragmentation: float = 0.0
    cpu_blocks_total: int = 0
    cpu_blocks_used: int = 0
    cpu_blocks_cached: int = 0  # CPU prefix tier (free blocks too)
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens, from either tier
    cpu_prefix_cache_hits: int = 0  # tokens loaded from the KV store
    cpu_prefix_cache_saved_blocks: int = 0
    cpu_prefix_cache_loaded_blocks: int = 0
    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    num_steps: int = 0


@dataclass(slots=True)
class IterationStats:
    """What one step (or an abort between steps) did, for EngineMetrics.record."""

    num_prompt_tokens: int = 0  # of requests whose first token came this step
    num_generation_tokens: int = 0
    num_scheduled_tokens: int = 0
    queue_times: list[float] = field(default_factory=list)
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)  # of requests that ended
    alloc_latencies_ns: list[int] = field(default_factory=list)  # sampled block allocations
    step_seconds: float = 0.0  # 0: not a step
    execute_seconds: float = 0.0  # executor.execute as the engine sees it
    worker_seconds: float = 0.0  # of which rank 0 computed; the rest is dispatch overhead
    swap_seconds: float = 0.0  # of which its swaps and CPU-tier transfers took
    weights_moving: bool = False  # a rank's weights were still being copied onto huge pages
    worker_restarts: list[str] = field(default_factory=list)  # causes: death, hang, error
    requests_resumed: int = 0
    recovery_seconds: list[float] = field(default_factory=list)  # fault detected to workers back
    kv_checksum_failures: int = 0  # CPU blocks read back with a bad checksum (their holders recompute)
    # Prefill/decode handoffs through the shared store: (blocks published, their seconds, blocks
    # loaded, their seconds) of a step that moved any.
    pd_transfers: list[tuple[int, float, int, float]] = field(default_factory=list)
    # Speculative decoding: drafts verified, how many were accepted, and in how many sequence-steps.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0


def scheduler_stats(scheduler) -> SchedulerStats:
    """A snapshot of the scheduler's queues and pools (called from the engine's own thread)."""
    kv, pool, cpu = scheduler.kv, scheduler.kv.pool, scheduler.kv.cpu_pool
    requests = {"running": 0, "waiting": 0, "swapped": 0}
    for group in scheduler.groups.values():
        states = {seq.status for seq in group.seqs}
        if SequenceStatus.RUNNING in states:
            requests["running"] += 1
        elif SequenceStatus.SWAPPED in states:
            requests["swapped"] += 1
        else:
            requests["waiting"] += 1
    prefix = kv.prefix_stats
    return SchedulerStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting), num_swapped=len(scheduler.swapped),
        num_requests_running=requests["running"], num_requests_waiting=requests["waiting"],
        num_requests_swapped=requests["swapped"],
        kv_blocks_total=pool.num_blocks, kv_blocks_used=pool.num_used, kv_blocks_cached=pool.num_cached,
        kv_blocks_peak_used=scheduler.peak_blocks_used, kv_fragmentation=kv.fragmentation(scheduler.running),
        cpu_blocks_total=cpu.num_blocks if cpu else 0, cpu_blocks_used=cpu.num_used if cpu else 0,
        cpu_blocks_cached=cpu.num_cached if cpu else 0,
        prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits, cpu_prefix_cache_hits=prefix.cpu_hits,
        cpu_prefix_cache_saved_blocks=prefix.cpu_saved_blocks,
        cpu_prefix_cache_loaded_blocks=prefix.cpu_loaded_blocks,
        num_preemptions=scheduler.num_preemptions, num_swap_preemptions=scheduler.num_swap_preemptions,
        swap_out_blocks=scheduler.swap_out_blocks, swap_in_blocks=scheduler.swap_in_blocks,
        num_steps=scheduler.num_steps)


def kv_metadata_bytes(scheduler) -> int:
    """What the coordinator holds to manage the KV pool: every live sequence's block table and
    block hashes, and the allocator's per-block arrays, free queue and hash index."""
    pool = scheduler.kv.pool
    total = sum(sys.getsizeof(x) for x in (pool.ref_counts, pool.block_hash, pool.free_queue, pool.cached))
    total += pool.num_cached * (_HASH_BYTES + _INT_BYTES)
    for group in list(scheduler.groups.values()):
        for seq in list(group.seqs):
            total += sys.getsizeof(seq.block_table) + _INT_BYTES * len(seq.block_table)
            total += sys.getsizeof(seq.block_hashes) + _HASH_BYTES * len(seq.block_hashes)
    return total


def engine_stats(engine) -> dict:
    """The flat dict of LLM.stats() and GetStats, from the latest snapshot and the metrics."""
    s = engine.scheduler_stats
    metrics = engine.metrics
    return {
        **asdict(s),
        "kv_usage": s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
        "kv_blocks_free": s.kv_blocks_total - s.kv_blocks_used,
        "cpu_kv_usage": s.cpu_blocks_used / s.cpu_blocks_total if s.cpu_blocks_total else 0.0,
        "num_recompute_preemptions": s.num_preemptions - s.num_swap_preemptions,
        "swap_out_bytes": s.swap_out_blocks * engine.swap_block_bytes,
        "swap_in_bytes": s.swap_in_blocks * engine.swap_block_bytes,
        "kv_pool_bytes": engine.kv_pool_bytes,
        "kv_metadata_bytes": kv_metadata_bytes(engine.scheduler),
        "kv_store_restarts": engine.kv_store_restarts,
        "worker_restarts": sum(metrics.worker_restarts.values()),
        **{f"worker_restarts_{cause}": metrics.worker_restarts[cause] for cause in ("death", "hang", "error")},
        "requests_resumed": metrics.requests_resumed,
        "kv_checksum_failures_total": metrics.kv_checksum_failures,
        "spec_draft_tokens_total": metrics.spec["draft"],
        "spec_accepted_tokens_total": metrics.spec["accepted"],
        # accepted / drafted; and tokens gained per speculating sequence-step (accepted + 1 each)
        "spec_acceptance_rate": metrics.spec["accepted"] / metrics.spec["draft"] if metrics.spec["draft"] else 0.0,
        "spec_mean_accepted_length": ((metrics.spec["accepted"] + metrics.spec["steps"]) / metrics.spec["steps"]
                                      if metrics.spec["steps"] else 0.0),
        "pd_transfer_blocks_published": metrics.pd_blocks["publish"],
        "pd_transfer_blocks_loaded": metrics.pd_blocks["load"],
        "pd_transfer_bytes_published": metrics.pd_blocks["publish"] * engine.swap_block_bytes,
        "pd_transfer_bytes_loaded": metrics.pd_blocks["load"] * engine.swap_block_bytes,
        **{f"pd_transfer_seconds_{direction}_{key}": value for direction, h in metrics.pd_seconds.items()
           for key, value in (("count", h.count), ("sum", h.sum), ("p50", h.quantile(0.5)),
                              ("p99", h.quantile(0.99)))},
        "prompt_tokens": metrics.num_prompt_tokens,
        "generation_tokens": metrics.num_generation_tokens,
        # What the executor adds per step beyond rank 0's own work (Ray calls, serialization).
        "executor_overhead_us_per_step": (
            1e6 * (metrics.execute_seconds - metrics.worker_seconds) / max(1, s.num_steps)),
        # Rank 0's own compute over all steps: against wall time, what the model's work took.
        "worker_compute_seconds": metrics.worker_seconds,
        # 1 while the last step ran beside the weights' copy onto huge pages (workers/huge_pages.py):
        # the engine is not yet at full speed. Over replicas: how many.
        "weights_moving_to_huge_pages": int(metrics.weights_moving),
        **metrics.summary(),
    }


def combine_replica_stats(engines: list) -> dict:
    """The cluster's figures over several replicas' LLMEngines, keyed as engine_stats: counts and
    sizes add up; usage ratios are recomputed from the sums, fragmentation is weighted by blocks
    in use, and percentiles come from the replicas' histograms merged (never averaged)."""
    from coordinator.metrics import Histogram, _nearest_rank

    if not engines:
        return {}
    each = [engine_stats(e) for e in engines]
    total = {key: sum(s[key] for s in each) for key in each[0]}
    used, blocks = total["kv_blocks_used"], total["kv_blocks_total"]
    total["kv_usage"] = used / blocks if blocks else 0.0
    total["cpu_kv_usage"] = total["cpu_blocks_used"] / total["cpu_blocks_total"] if total["cpu_blocks_total"] else 0.0
    total["kv_fragmentation"] = (sum(s["kv_fragmentation"] * s["kv_blocks_used"] for s in each) / used) if used else 0.0
    total["executor_overhead_us_per_step"] = total["executor_overhead_us_per_step"] / len(each)
    def merged(histograms) -> Histogram:
        out = Histogram(histograms[0].bounds)
        for h in histograms:
            out.counts = [a + b for a, b in zip(out.counts, h.counts)]
            out.count += h.count
            out.sum += h.sum
        return out

    for name in engines[0].metrics.histograms:
        h = merged([e.metrics.histograms[name] for e in engines])
        for q in (50, 90, 99):
            total[f"{name}_p{q}"] = h.quantile(q / 100)
    for direction in engines[0].metrics.pd_seconds:
        h = merged([e.metrics.pd_seconds[direction] for e in engines])
        for q in (50, 99):
            total[f"pd_transfer_seconds_{direction}_p{q}"] = h.quantile(q / 100)
    samples = sorted(ns for e in engines for ns in e.metrics.recent_alloc_latency_ns)
    total["alloc_latency_us_p50"] = _nearest_rank(samples, 0.50) / 1000.0
    total["alloc_latency_us_p99"] = _nearest_rank(samples, 0.99) / 1000.0
    return total
