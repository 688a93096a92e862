"""The engine's latency and count metrics: fixed-bucket histograms and counters by label.

Folded in from each step's IterationStats (a bisect and two adds per observation), read by
`GetStats` (counts, sums, percentiles) and by the Prometheus endpoint (`coordinator/prometheus.py`,
cumulative buckets). Plain Python, no Prometheus dependency here: the offline API records them too.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter, deque

from coordinator.stats import IterationStats

# Seconds: from a decode step on a GPU (ms) to a long queue on a CPU (minutes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
ALLOCATION_US_BUCKETS = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 50.0, 100.0, 1000.0)
TOKENS_PER_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Histogram:
    """Counts of observations per bucket (`le` upper bounds, Prometheus style), with sum and count."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it), ending with (inf, count)."""
        out, total = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), list(self.counts)):
            total += n
            out.append((bound, total))
        return out

    def quantile(self, q: float) -> float:
        """An estimate, interpolated linearly inside the bucket that holds the q-th observation
        (as Prometheus' histogram_quantile); 0 when empty, the top bound when beyond it."""
        if self.count == 0:
            return 0.0
        rank = q * self.count
        lower, seen = 0.0, 0
        for bound, n in zip(self.bounds, self.counts):
            if n and seen + n >= rank:
                return lower + (bound - lower) * (rank - seen) / n
            seen += n
            lower = bound
        return self.bounds[-1]


HISTOGRAMS = {  # name -> (buckets, help)
    "time_to_first_token_seconds": (LATENCY_BUCKETS, "Time from arrival to the first generated token"),
    "inter_token_latency_seconds": (LATENCY_BUCKETS, "Time between two tokens of one sequence"),
    "e2e_request_latency_seconds": (LATENCY_BUCKETS, "Time from arrival to the end of a request"),
    "request_queue_time_seconds": (LATENCY_BUCKETS, "Time from arrival to the first scheduled step"),
    "step_duration_seconds": (LATENCY_BUCKETS, "Duration of one engine step (schedule, execute, process)"),
    "tokens_per_step": (TOKENS_PER_STEP_BUCKETS, "Tokens computed in one engine step"),
    "swap_transfer_seconds": (LATENCY_BUCKETS, "Time of one step's swap and CPU-tier transfers on rank 0"),
    "recovery_seconds": (LATENCY_BUCKETS, "Time from a worker fault detected to a rebuilt worker group"),
}


FINISH_REASONS = ("stop", "length", "abort", "deadline", "poison")
# Recent sampled block allocations kept for the p50/p99 in the stats.
_ALLOC_LATENCY_SAMPLES = 65536


class EngineMetrics:
    """Lifetime counters and histograms, folded in from each step's IterationStats."""

    def __init__(self):
        self.histograms = {name: Histogram(buckets) for name, (buckets, _) in HISTOGRAMS.items()}
        self.alloc_latency_us = Histogram(ALLOCATION_US_BUCKETS)
        self.recent_alloc_latency_ns: deque[int] = deque(maxlen=_ALLOC_LATENCY_SAMPLES)
        self.finished: Counter[str] = Counter()  # requests by finish reason (FINISH_REASONS)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.execute_seconds = 0.0
        self.worker_seconds = 0.0
        self.weights_moving = False  # as of the last step: see StepOutput.weights_moving
        self.worker_restarts: Counter[str] = Counter()  # by cause: death, hang, error
        self.requests_resumed = 0
        self.kv_checksum_failures = 0  # CPU blocks whose checksum failed when read back
        self.spec = Counter(draft=0, accepted=0, steps=0)  # speculative decoding's totals
        # Prefill/decode handoffs: blocks this replica published to (or loaded from) the shared
        # store, and the seconds of each step's transfers, by direction.
        self.pd_blocks: Counter[str] = Counter(publish=0, load=0)
        self.pd_seconds = {"publish": Histogram(LATENCY_BUCKETS), "load": Histogram(LATENCY_BUCKETS)}

    def record(self, it: IterationStats) -> None:
        observe = self.histograms
        self.num_prompt_tokens += it.num_prompt_tokens
        self.num_generation_tokens += it.num_generation_tokens
        for name, values in (("request_queue_time_seconds", it.queue_times),
                             ("time_to_first_token_seconds", it.time_to_first_tokens),
                             ("inter_token_latency_seconds", it.inter_token_latencies),
                             ("e2e_request_latency_seconds", it.e2e_latencies)):
            for value in values:
                observe[name].observe(value)
        # Recorded before the step's snapshot replaces the one that still counts these requests in
        # flight: a scrape in between may count one twice, never miss one.
        self.finished.update(it.finish_reasons)
        self.worker_restarts.update(it.worker_restarts)
        self.requests_resumed += it.requests_resumed
        self.kv_checksum_failures += it.kv_checksum_failures
        if it.spec_verify_steps:
            self.spec.update(draft=it.spec_draft_tokens, accepted=it.spec_accepted_tokens, steps=it.spec_verify_steps)
        for value in it.recovery_seconds:
            observe["recovery_seconds"].observe(value)
        for published, publish_seconds, loaded, load_seconds in it.pd_transfers:
            for direction, blocks, seconds in (("publish", published, publish_seconds), ("load", loaded, load_seconds)):
                if blocks:
                    self.pd_blocks[direction] += blocks
                    self.pd_seconds[direction].observe(seconds)
        for ns in it.alloc_latencies_ns:
            self.alloc_latency_us.observe(ns / 1000)
        self.recent_alloc_latency_ns.extend(it.alloc_latencies_ns)
        if it.step_seconds:
            self.execute_seconds += it.execute_seconds
            self.worker_seconds += it.worker_seconds
            self.weights_moving = it.weights_moving
            if it.num_scheduled_tokens:
                observe["tokens_per_step"].observe(it.num_scheduled_tokens)
            if it.swap_seconds:
                observe["swap_transfer_seconds"].observe(it.swap_seconds)
            observe["step_duration_seconds"].observe(it.step_seconds)

    def summary(self) -> dict:
        """Flat figures for GetStats: count, sum and p50/p90/p99 of each histogram."""
        out = {}
        for name, h in self.histograms.items():
            out[f"{name}_count"] = h.count
            out[f"{name}_sum"] = h.sum
            for q in (50, 90, 99):
                out[f"{name}_p{q}"] = h.quantile(q / 100)
        for reason in FINISH_REASONS:
            out[f"requests_finished_{reason}"] = self.finished[reason]
        samples = sorted(self.recent_alloc_latency_ns)
        out["alloc_latency_us_p50"] = _nearest_rank(samples, 0.50) / 1000.0
        out["alloc_latency_us_p99"] = _nearest_rank(samples, 0.99) / 1000.0
        return out


def _nearest_rank(ordered: list[int], q: float) -> float:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0
