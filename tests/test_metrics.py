"""The Prometheus endpoint of a running server: scraped during a run, names and types checked, and
the invariants between the figures; the same figures through GetStats."""

from __future__ import annotations

import asyncio
import threading
import urllib.request

import grpc
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

import pagedserve
from pagedserve.config import EngineConfig
from tests.serving import running_coordinator

NUM_REQUESTS = 24
# A small pool (32 blocks of 16) and 8 sequences at most: requests wait and get preempted.
ENGINE = dict(kv_cache_memory=32 * 2 * 2 * 16 * 2 * 16 * 4, max_num_seqs=8, swap_space=0.01)

EXPECTED_TYPES = {
    "pagedserve_num_requests": "gauge",
    "pagedserve_kv_cache_usage_ratio": "gauge",
    "pagedserve_kv_cache_fragmentation_ratio": "gauge",
    "pagedserve_kv_blocks": "gauge",
    "pagedserve_kv_blocks_capacity": "gauge",
    "pagedserve_cpu_kv_blocks": "gauge",
    "pagedserve_prompt_tokens": "counter",
    "pagedserve_generation_tokens": "counter",
    "pagedserve_prefix_cache_queries": "counter",
    "pagedserve_prefix_cache_hits": "counter",
    "pagedserve_prompt_tokens_cached": "counter",
    "pagedserve_preemptions": "counter",
    "pagedserve_cpu_tier_blocks": "counter",
    "pagedserve_swapped_out_bytes": "counter",
    "pagedserve_swapped_in_bytes": "counter",
    "pagedserve_requests_finished": "counter",
    "pagedserve_requests_rejected": "counter",
    "pagedserve_time_to_first_token_seconds": "histogram",
    "pagedserve_inter_token_latency_seconds": "histogram",
    "pagedserve_e2e_request_latency_seconds": "histogram",
    "pagedserve_request_queue_time_seconds": "histogram",
    "pagedserve_block_allocation_latency_microseconds": "histogram",
    "pagedserve_step_duration_seconds": "histogram",
    "pagedserve_tokens_per_step": "histogram",
    "pagedserve_swap_transfer_seconds": "histogram",
    "pagedserve_recovery_seconds": "histogram",
    "pagedserve_worker_restarts": "counter",
    "pagedserve_requests_resumed": "counter",
}


@pytest.fixture(scope="module")
def server(ray_session, tiny_llama):
    config = EngineConfig(model=tiny_llama, distributed_executor_backend="ray", **ENGINE)
    with running_coordinator(config, metrics_port=0) as (actor, target):
        status = ray.get(actor.status.remote())
        yield target, f"http://127.0.0.1:{status['metrics_port']}/metrics"


def scrape(url: str) -> dict[str, dict]:
    """name -> {"type": ..., "samples": {(sample name, labels without model_name): value}}; each
    engine series is summed over its `replica` label (one replica here: its own value)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        samples = {}
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name")  # every series is labelled with the model
            labels.pop("replica", None)
            key = (s.name, tuple(sorted(labels.items())))
            samples[key] = samples.get(key, 0.0) + s.value
        out[family.name] = {"type": family.type, "samples": samples}
    return out


def value(metrics, family: str, sample: str | None = None, **labels) -> float:
    return metrics[family]["samples"][(sample or family, tuple(sorted(labels.items())))]


def check_invariants(m) -> None:
    assert value(m, "pagedserve_prefix_cache_hits", "pagedserve_prefix_cache_hits_total") <= \
        value(m, "pagedserve_prefix_cache_queries", "pagedserve_prefix_cache_queries_total")
    capacity = value(m, "pagedserve_kv_blocks_capacity")
    assert value(m, "pagedserve_kv_blocks", state="used") + value(m, "pagedserve_kv_blocks", state="free") == capacity
    assert value(m, "pagedserve_kv_blocks", state="cached") <= capacity
    assert 0.0 <= value(m, "pagedserve_kv_cache_usage_ratio", tier="device") <= 1.0
    assert 0.0 <= value(m, "pagedserve_kv_cache_fragmentation_ratio") <= 1.0
    for name, kind in EXPECTED_TYPES.items():
        if kind != "histogram":
            continue
        buckets = sorted(((float(dict(labels)["le"]), v) for (sample, labels), v in m[name]["samples"].items()
                          if sample == name + "_bucket"))
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")
        assert buckets[-1][1] == value(m, name, name + "_count")


def finished(m) -> float:
    return sum(value(m, "pagedserve_requests_finished", "pagedserve_requests_finished_total", reason=r)
               for r in ("stop", "length", "abort"))


def in_flight(m) -> float:
    return sum(value(m, "pagedserve_num_requests", state=s) for s in ("running", "waiting", "swapped"))


def test_scraped_during_a_run_names_types_and_invariants_hold(server):
    target, url = server
    done = 0
    lock = threading.Lock()

    async def one(client, i):
        nonlocal done
        prompt = [3 + (7 * i + j) % 4000 for j in range(20 + 3 * i)]
        tokens = []
        async for chunk in client.stream(prompt, max_tokens=24, temperature=0.0, ignore_eos=True):
            tokens += chunk.token_ids
        with lock:
            done += 1
        return tokens

    async def run():
        client = pagedserve.AsyncClient(target, timeout=300)
        try:
            tasks = [asyncio.create_task(one(client, i)) for i in range(NUM_REQUESTS)]
            # Once every request is in the engine, each scrape bounds the in-flight count.
            while True:
                m = await asyncio.to_thread(scrape, url)
                if in_flight(m) + done >= NUM_REQUESTS or done == NUM_REQUESTS:
                    break
                await asyncio.sleep(0.05)
            scrapes = 0
            while done < NUM_REQUESTS:
                with lock:
                    before = done
                m = await asyncio.to_thread(scrape, url)
                # Requests the engine has finished may not have reached the client yet, so the
                # lower bound uses the server's own count (read after the states: never below N).
                assert in_flight(m) + finished(m) >= NUM_REQUESTS
                assert in_flight(m) <= NUM_REQUESTS - before
                check_invariants(m)
                scrapes += 1
                await asyncio.sleep(0.05)
            return await asyncio.gather(*tasks), scrapes
        finally:
            await client.close()

    results, scrapes = asyncio.run(run())
    assert all(len(tokens) == 24 for tokens in results) and scrapes > 0
    m = scrape(url)
    for name, kind in EXPECTED_TYPES.items():
        assert m[name]["type"] == kind, name
    check_invariants(m)
    assert in_flight(m) == 0
    assert value(m, "pagedserve_requests_finished", "pagedserve_requests_finished_total", reason="length") \
        == NUM_REQUESTS
    assert value(m, "pagedserve_time_to_first_token_seconds", "pagedserve_time_to_first_token_seconds_count") \
        == NUM_REQUESTS
    assert value(m, "pagedserve_inter_token_latency_seconds", "pagedserve_inter_token_latency_seconds_count") \
        == NUM_REQUESTS * 23
    assert value(m, "pagedserve_generation_tokens", "pagedserve_generation_tokens_total") == NUM_REQUESTS * 24
    assert value(m, "pagedserve_block_allocation_latency_microseconds",
                 "pagedserve_block_allocation_latency_microseconds_count") > 0
    preemptions = sum(value(m, "pagedserve_preemptions", "pagedserve_preemptions_total", mode=mode)
                      for mode in ("swap", "recompute"))
    assert preemptions > 0  # the small pool forced some
    if value(m, "pagedserve_preemptions", "pagedserve_preemptions_total", mode="swap"):
        assert value(m, "pagedserve_swapped_out_bytes", "pagedserve_swapped_out_bytes_total") > 0

    # The same figures under vLLM's names, for dashboards and autoscalers made for vLLM.
    for ours, theirs in [("pagedserve_generation_tokens_total", "vllm:generation_tokens_total"),
                         ("pagedserve_prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("pagedserve_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")]:
        assert value(m, ours.removesuffix("_total"), ours) == value(m, theirs.removesuffix("_total"), theirs)
    assert value(m, "vllm:num_preemptions", "vllm:num_preemptions_total") == preemptions
    assert value(m, "vllm:num_requests_running") == value(m, "vllm:num_requests_waiting") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == value(m, "pagedserve_kv_cache_usage_ratio", tier="device")
    assert value(m, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == NUM_REQUESTS
    assert m["vllm:time_to_first_token_seconds"]["type"] == "histogram"
    assert value(m, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == NUM_REQUESTS * 23
    assert value(m, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") == \
        value(m, "pagedserve_tokens_per_step", "pagedserve_tokens_per_step_count")

    # GetStats carries the same figures.
    with pagedserve.Client(target, timeout=30) as client:
        stats = client.stats()
    assert stats["time_to_first_token_seconds_count"] == NUM_REQUESTS
    assert stats["requests_finished_length"] == NUM_REQUESTS
    assert stats["generation_tokens"] == value(m, "pagedserve_generation_tokens", "pagedserve_generation_tokens_total")
    assert stats["num_swap_preemptions"] + stats["num_recompute_preemptions"] == preemptions


def test_refused_requests_are_counted_by_reason(server):
    target, url = server
    before = value(scrape(url), "pagedserve_requests_rejected", "pagedserve_requests_rejected_total",
                   reason="invalid_argument")
    with pagedserve.Client(target, timeout=30) as client:
        with pytest.raises(pagedserve.ServingError) as err:
            client.generate([1, 2, 3], max_tokens=4, temperature=-1.0)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        stats = client.stats()
    after = value(scrape(url), "pagedserve_requests_rejected", "pagedserve_requests_rejected_total",
                  reason="invalid_argument")
    assert after == before + 1 and stats["requests_rejected_invalid_argument"] == after


def test_a_second_server_on_the_machine_takes_another_metrics_port(ray_session, tiny_llama):
    config = EngineConfig(model=tiny_llama, distributed_executor_backend="ray", kv_cache_memory=1 << 22)
    with running_coordinator(config, default_metrics=True) as (first, _), \
            running_coordinator(config, default_metrics=True) as (second, _):
        ports = [ray.get(a.status.remote())["metrics_port"] for a in (first, second)]
        assert ports[0] != ports[1]
        for port in ports:
            assert "pagedserve_kv_blocks_capacity" in scrape(f"http://127.0.0.1:{port}/metrics")
        # Asked for explicitly, a taken port is an error that names the flag.
        with pytest.raises(ray.exceptions.RayTaskError, match="choose another --metrics-port"):
            with running_coordinator(config, metrics_port=ports[0]):
                pass
