"""The engine's latency and count metrics: fixed-bucket histograms and counters by label.

Recorded by the engine loop as it steps (a bisect and two adds per observation), read by
`GetStats` (counts, sums, percentiles) and by the Prometheus endpoint (`coordinator/prometheus.py`,
cumulative buckets). Plain Python, no Prometheus dependency here: the offline API records them too.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

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
}


class EngineMetrics:
    def __init__(self):
        self.histograms = {name: Histogram(buckets) for name, (buckets, _) in HISTOGRAMS.items()}
        self.finished: Counter[str] = Counter()  # requests by finish reason: stop, length, abort

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def summary(self) -> dict:
        """Flat figures for GetStats: count, sum and p50/p90/p99 of each histogram."""
        out = {}
        for name, h in self.histograms.items():
            out[f"{name}_count"] = h.count
            out[f"{name}_sum"] = h.sum
            for q in (50, 90, 99):
                out[f"{name}_p{q}"] = h.quantile(q / 100)
        for reason in ("stop", "length", "abort"):
            out[f"requests_finished_{reason}"] = self.finished[reason]
        return out
