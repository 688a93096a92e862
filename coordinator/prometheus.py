"""The Prometheus endpoint: `/metrics` over HTTP, names prefixed `pagedserve_`, labelled with the
model name; counters end in `_total`. The series that vLLM's dashboards, alerts and autoscalers
read also come under vLLM's names (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, ...;
VLLM_NAMES), with the same `model_name` label, so that those work unchanged.

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
CLUSTER_COUNTERS = {  # the router's, when there is one
    "requests_failed_over": "Requests moved to another replica after theirs stopped",
    "pd_handoffs": "Requests whose prompt a prefill replica computed for a decode replica",
    "pd_fallback_recomputes": "Requests routed for prefill/decode whose decode replica computed the whole "
                              "prompt instead (the prefill replica failed, or the lease expired first)",
    "pd_store_restarts": "Times the KV store shared by prefill and decode replicas died and was replaced",
}


# vLLM's name (after its `vllm:` prefix) -> (type, help, the value from (stats, engine)); counters
# get `_total` on the wire.
VLLM_NAMES = {
    "num_requests_running": ("gauge", "Requests running", lambda s, e: s["num_requests_running"]),
    "num_requests_waiting": ("gauge", "Requests waiting", lambda s, e: s["num_requests_waiting"]),
    "num_requests_swapped": ("gauge", "Requests swapped out", lambda s, e: s["num_requests_swapped"]),
    "kv_cache_usage_perc": ("gauge", "Share of KV blocks in use (0..1)", lambda s, e: s["kv_usage"]),
    "prompt_tokens": ("counter", "Prompt tokens", lambda s, e: s["prompt_tokens"]),
    "generation_tokens": ("counter", "Generated tokens", lambda s, e: s["generation_tokens"]),
    "num_preemptions": ("counter", "Preemptions",
                        lambda s, e: s["num_swap_preemptions"] + s["num_recompute_preemptions"]),
    "prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache",
                             lambda s, e: s["prefix_cache_queries"]),
    "prefix_cache_hits": ("counter", "Prompt tokens found in the prefix cache", lambda s, e: s["prefix_cache_hits"]),
    "spec_decode_num_draft_tokens": ("counter", "Speculative draft tokens",
                                     lambda s, e: s["spec_draft_tokens_total"]),
    "spec_decode_num_accepted_tokens": ("counter", "Speculative draft tokens accepted",
                                        lambda s, e: s["spec_accepted_tokens_total"]),
}
VLLM_HISTOGRAMS = {  # vLLM's name (after `vllm:`) -> ours (metrics.HISTOGRAMS)
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_token_latency_seconds": "inter_token_latency_seconds",
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "request_queue_time_seconds": "request_queue_time_seconds",
    "iteration_tokens_total": "tokens_per_step",
}


class PagedserveCollector:
    """`engines()` returns [(replica label, LLMEngine)] of the running engines (empty while
    loading); `rejected()` the server's refusals by reason. Every engine series carries a
    `replica` label ("0" with one replica): the cluster's figure is their sum."""

    def __init__(self, model_name: str, engines: Callable, rejected: Callable[[], dict],
                 cluster: Callable[[], dict] = dict):
        """`cluster()`: the router's own counters (failovers, P/D fallbacks), {} without one."""
        self.model_name = model_name
        self._engines = engines
        self._rejected = rejected
        self._cluster = cluster

    def describe(self):
        return []  # no fixed set before the first scrape: skip the registry's duplicate check

    def _family(self, cls, name: str, doc: str, labels=(), prefix: str = PREFIX, **kw):
        return cls(prefix + name, doc, labels=["model_name", *labels], **kw)

    def collect(self):
        model = [self.model_name]
        rejected = self._family(CounterMetricFamily, "requests_rejected", "Requests refused, by reason",
                                ["reason"])
        counts = self._rejected()
        for reason in REJECT_REASONS:
            rejected.add_metric(model + [reason], counts.get(reason, 0))
        yield rejected
        cluster = self._cluster()
        for name, doc in CLUSTER_COUNTERS.items():
            if name in cluster:
                family = self._family(CounterMetricFamily, name, doc)
                family.add_metric(model, cluster[name])
                yield family
        engines = self._engines()
        if engines:
            yield from self._engine_families(engines)

    def _engine_families(self, engines):
        from coordinator.stats import engine_stats

        replicas = [([self.model_name, label], engine, engine_stats(engine)) for label, engine in engines]

        def simple(cls, name, doc, value_of, prefix=PREFIX):
            f = self._family(cls, name, doc, ["replica"], prefix)
            for labels, engine, s in replicas:
                f.add_metric(labels, value_of(s, engine))
            return f

        def labelled(cls, name, doc, label, values_of, prefix=PREFIX):
            f = self._family(cls, name, doc, ["replica", label], prefix)
            for labels, engine, s in replicas:
                for key, value in values_of(s, engine).items():
                    f.add_metric(labels + [key], value)
            return f

        G, C = GaugeMetricFamily, CounterMetricFamily
        yield labelled(G, "num_requests", "Requests in flight, by state", "state",
                       lambda s, e: {"running": s["num_requests_running"], "waiting": s["num_requests_waiting"],
                                     "swapped": s["num_requests_swapped"]})
        yield labelled(G, "kv_cache_usage_ratio", "Share of KV blocks in use (0..1)", "tier",
                       lambda s, e: {"device": s["kv_usage"], "cpu": s["cpu_kv_usage"]})
        yield simple(G, "kv_cache_fragmentation_ratio",
                     "Allocated-but-empty KV slots over allocated slots (internal fragmentation)",
                     lambda s, e: s["kv_fragmentation"])
        yield labelled(G, "kv_blocks", "Device KV blocks by state (used + free = capacity; "
                       "cached: blocks, used or free, that hold a prefix-cache entry)", "state",
                       lambda s, e: {"used": s["kv_blocks_used"], "free": s["kv_blocks_free"],
                                     "cached": s["kv_blocks_cached"]})
        yield simple(G, "kv_blocks_capacity", "Device KV blocks in the pool", lambda s, e: s["kv_blocks_total"])
        yield labelled(G, "cpu_kv_blocks", "KV store blocks by state", "state",
                       lambda s, e: {"used": s["cpu_blocks_used"], "cached": s["cpu_blocks_cached"],
                                     "capacity": s["cpu_blocks_total"]})
        yield simple(C, "prompt_tokens", "Prompt tokens of requests that produced a token",
                     lambda s, e: s["prompt_tokens"])
        yield simple(C, "generation_tokens", "Generated tokens", lambda s, e: s["generation_tokens"])
        yield simple(C, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                     lambda s, e: s["prefix_cache_queries"])
        yield simple(C, "prefix_cache_hits", "Prompt tokens found in the prefix cache (either tier)",
                     lambda s, e: s["prefix_cache_hits"])
        yield labelled(C, "prompt_tokens_cached", "Prompt tokens served from the prefix "
                       "cache instead of computed, by tier", "tier",
                       lambda s, e: {"device": s["prefix_cache_hits"] - s["cpu_prefix_cache_hits"],
                                     "cpu": s["cpu_prefix_cache_hits"]})
        yield labelled(C, "preemptions", "Preemptions, by mode", "mode",
                       lambda s, e: {"swap": s["num_swap_preemptions"], "recompute": s["num_recompute_preemptions"]})
        yield labelled(C, "cpu_tier_blocks", "Blocks moved by the prefix cache's CPU tier "
                       "(saved before eviction, loaded on a hit); swapped_*_bytes count preemption swaps", "direction",
                       lambda s, e: {"saved": s["cpu_prefix_cache_saved_blocks"],
                                     "loaded": s["cpu_prefix_cache_loaded_blocks"]})
        yield simple(C, "swapped_out_bytes", "Bytes swapped out to the KV store", lambda s, e: s["swap_out_bytes"])
        yield simple(C, "swapped_in_bytes", "Bytes swapped in from the KV store", lambda s, e: s["swap_in_bytes"])
        yield labelled(C, "worker_restarts", "Worker groups rebuilt after a fault, by cause", "cause",
                       lambda s, e: {cause: s[f"worker_restarts_{cause}"] for cause in ("death", "hang", "error")})
        yield simple(C, "requests_resumed", "Requests resumed on a rebuilt worker group",
                     lambda s, e: s["requests_resumed"])
        yield simple(C, "kv_checksum_failures", "KV store blocks whose checksum failed when read back (what "
                     "they held was recomputed, never served)", lambda s, e: s["kv_checksum_failures_total"])
        yield simple(C, "spec_draft_tokens", "Speculative draft tokens verified",
                     lambda s, e: s["spec_draft_tokens_total"])
        yield simple(C, "spec_accepted_tokens", "Speculative draft tokens accepted",
                     lambda s, e: s["spec_accepted_tokens_total"])
        yield labelled(C, "requests_finished", "Requests finished, by reason", "reason",
                       lambda s, e: {reason: e.metrics.finished[reason] for reason in FINISH_REASONS})
        yield labelled(G, "replica_role", "1 for the replica's prefill/decode role (colocated: both)", "role",
                       lambda s, e: {e.role or "colocated": 1})
        yield labelled(C, "pd_transfer_blocks", "KV blocks handed from prefill to decode replicas through the "
                       "shared store, by direction (publish: written by a prefill replica; load: read by a "
                       "decode replica)", "direction",
                       lambda s, e: {"publish": s["pd_transfer_blocks_published"], "load": s["pd_transfer_blocks_loaded"]})
        yield labelled(C, "pd_transfer_bytes", "Bytes of pd_transfer_blocks", "direction",
                       lambda s, e: {"publish": s["pd_transfer_bytes_published"], "load": s["pd_transfer_bytes_loaded"]})
        f = self._family(HistogramMetricFamily, "pd_transfer_seconds", "Rank 0's time moving one step's P/D "
                         "handoff blocks (a load step's: all its store transfers)", ["replica", "direction"])
        for labels, engine, _ in replicas:
            for direction, h in engine.metrics.pd_seconds.items():
                f.add_metric(labels + [direction], _buckets(h), h.sum)
        yield f
        for name, (_, doc) in HISTOGRAMS.items():
            yield self._histogram(name, doc, replicas, lambda e, name=name: e.metrics.histograms[name])
        yield self._histogram("block_allocation_latency_microseconds",
                              "Latency of one KV block allocation (one in ALLOC_SAMPLE_EVERY is timed)",
                              replicas, lambda e: e.metrics.alloc_latency_us)
        # The same figures under vLLM's (v1) names, for what reads vLLM's.
        for name, (kind, doc, value_of) in VLLM_NAMES.items():
            yield simple(G if kind == "gauge" else C, name, doc, value_of, prefix="vllm:")
        yield labelled(C, "request_success", "Requests finished, by reason", "finished_reason",
                       lambda s, e: {r: e.metrics.finished[r] for r in ("stop", "length", "abort")}, prefix="vllm:")
        for name, ours in VLLM_HISTOGRAMS.items():
            yield self._histogram(name, HISTOGRAMS[ours][1], replicas,
                                  lambda e, ours=ours: e.metrics.histograms[ours], prefix="vllm:")

    def _histogram(self, name: str, doc: str, replicas, histogram_of, prefix: str = PREFIX) -> HistogramMetricFamily:
        family = self._family(HistogramMetricFamily, name, doc, ["replica"], prefix)
        for labels, engine, _ in replicas:
            h: Histogram = histogram_of(engine)
            family.add_metric(labels, _buckets(h), h.sum)
        return family


def _buckets(h: Histogram) -> list[tuple[str, int]]:
    """Cumulative buckets; read before the sum: an observation landing in between leaves the
    count (the +Inf bucket) consistent with the buckets, as Prometheus requires."""
    return [("+Inf" if bound == float("inf") else repr(float(bound)), count) for bound, count in h.cumulative()]


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
