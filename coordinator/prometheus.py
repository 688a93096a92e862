"""The Prometheus endpoint: `/metrics` over HTTP, names prefixed `pagedserve_`, labelled with the
model name; counters end in `_total`.

A custom collector reads the engine's figures when scraped, from the HTTP server's thread: the
latest per-step snapshot and the metrics' counters and histograms (plain ints and floats).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from coordinator.metrics import FINISH_REASONS, HISTOGRAMS, Histogram

log = logging.getLogger("pagedserve.metrics")

PREFIX = "pagedserve_"
REJECT_REASONS = ("invalid_argument", "queue_full", "unavailable", "unauthenticated")


class PagedserveCollector:
    """`engine()` returns the running LLMEngine or None (still loading); `rejected()` the
    server's refusals by reason."""

    def __init__(self, model_name: str, engine: Callable, rejected: Callable[[], dict]):
        self.model_name = model_name
        self._engine = engine
        self._rejected = rejected

    def describe(self):
        return []  # no fixed set before the first scrape: skip the registry's duplicate check

    def _family(self, cls, name: str, doc: str, labels=(), **kw):
        return cls(PREFIX + name, doc, labels=["model_name", *labels], **kw)

    def collect(self):
        model = [self.model_name]
        rejected = self._family(CounterMetricFamily, "requests_rejected", "Requests refused, by reason",
                                ["reason"])
        counts = self._rejected()
        for reason in REJECT_REASONS:
            rejected.add_metric(model + [reason], counts.get(reason, 0))
        yield rejected
        engine = self._engine()
        if engine is None:
            return
        yield from self._engine_families(engine, model)

    def _engine_families(self, engine, model):
        from coordinator.stats import engine_stats

        s = engine_stats(engine)

        def gauge(name, doc, value):
            g = self._family(GaugeMetricFamily, name, doc)
            g.add_metric(model, value)
            return g

        def counter(name, doc, value):
            c = self._family(CounterMetricFamily, name, doc)
            c.add_metric(model, value)
            return c

        def labelled(cls, name, doc, label, values: dict):
            f = self._family(cls, name, doc, [label])
            for key, value in values.items():
                f.add_metric(model + [key], value)
            return f

        yield labelled(GaugeMetricFamily, "num_requests", "Requests in flight, by state", "state",
                       {"running": s["num_requests_running"], "waiting": s["num_requests_waiting"],
                        "swapped": s["num_requests_swapped"]})
        yield labelled(GaugeMetricFamily, "kv_cache_usage_ratio", "Share of KV blocks in use (0..1)", "tier",
                       {"device": s["kv_usage"], "cpu": s["cpu_kv_usage"]})
        yield gauge("kv_cache_fragmentation_ratio",
                    "Allocated-but-empty KV slots over allocated slots (internal fragmentation)",
                    s["kv_fragmentation"])
        yield labelled(GaugeMetricFamily, "kv_blocks", "Device KV blocks by state (used + free = capacity; "
                       "cached: blocks, used or free, that hold a prefix-cache entry)", "state",
                       {"used": s["kv_blocks_used"], "free": s["kv_blocks_free"], "cached": s["kv_blocks_cached"]})
        yield gauge("kv_blocks_capacity", "Device KV blocks in the pool", s["kv_blocks_total"])
        yield labelled(GaugeMetricFamily, "cpu_kv_blocks", "KV store blocks by state", "state",
                       {"used": s["cpu_blocks_used"], "cached": s["cpu_blocks_cached"],
                        "capacity": s["cpu_blocks_total"]})
        yield counter("prompt_tokens", "Prompt tokens of requests that produced a token", s["prompt_tokens"])
        yield counter("generation_tokens", "Generated tokens", s["generation_tokens"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      s["prefix_cache_queries"])
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (either tier)",
                      s["prefix_cache_hits"])
        yield labelled(CounterMetricFamily, "prompt_tokens_cached", "Prompt tokens served from the prefix "
                       "cache instead of computed, by tier", "tier",
                       {"device": s["prefix_cache_hits"] - s["cpu_prefix_cache_hits"],
                        "cpu": s["cpu_prefix_cache_hits"]})
        yield labelled(CounterMetricFamily, "preemptions", "Preemptions, by mode", "mode",
                       {"swap": s["num_swap_preemptions"], "recompute": s["num_recompute_preemptions"]})
        yield labelled(CounterMetricFamily, "cpu_tier_blocks", "Blocks moved by the prefix cache's CPU tier "
                       "(saved before eviction, loaded on a hit); swapped_*_bytes count preemption swaps", "direction",
                       {"saved": s["cpu_prefix_cache_saved_blocks"], "loaded": s["cpu_prefix_cache_loaded_blocks"]})
        yield counter("swapped_out_bytes", "Bytes swapped out to the KV store", s["swap_out_bytes"])
        yield counter("swapped_in_bytes", "Bytes swapped in from the KV store", s["swap_in_bytes"])
        yield labelled(CounterMetricFamily, "worker_restarts", "Worker groups rebuilt after a fault, by cause",
                       "cause", {cause: s[f"worker_restarts_{cause}"] for cause in ("death", "hang", "error")})
        yield counter("requests_resumed", "Requests resumed on a rebuilt worker group", s["requests_resumed"])
        yield counter("kv_checksum_failures", "KV store blocks whose checksum failed when read back (what "
                      "they held was recomputed, never served)", s["kv_checksum_failures_total"])
        yield labelled(CounterMetricFamily, "requests_finished", "Requests finished, by reason", "reason",
                       {reason: engine.metrics.finished[reason] for reason in FINISH_REASONS})
        for name, (_, doc) in HISTOGRAMS.items():
            yield self._histogram(name, doc, engine.metrics.histograms[name], model)
        yield self._histogram("block_allocation_latency_microseconds",
                              "Latency of one KV block allocation (one in ALLOC_SAMPLE_EVERY is timed)",
                              engine.metrics.alloc_latency_us, model)

    def _histogram(self, name: str, doc: str, h: Histogram, model) -> HistogramMetricFamily:
        family = self._family(HistogramMetricFamily, name, doc)
        buckets = [("+Inf" if bound == float("inf") else repr(float(bound)), count) for bound, count in h.cumulative()]
        # The sum is read after the buckets: an observation landing in between leaves the
        # count (the +Inf bucket) consistent with the buckets, as Prometheus requires.
        family.add_metric(model, buckets, h.sum)
        return family


def make_registry(collector: PagedserveCollector) -> CollectorRegistry:
    """The one registry of a server: this endpoint and the HTTP API's /metrics both serve it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


class MetricsServer:
    """`/metrics` on host:port (port 0 picks a free one) in a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self.registry = registry
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}; "
                          "choose another --metrics-port") from None
        self.host, self.port = host, self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
