"""Send a workload to a server and time every request: Poisson arrivals (or all at once), a cap on
requests in flight, a progress bar, and the server's own figures sampled over time. How a request
travels (gRPC or the OpenAI HTTP API) is the backend's business (backends.py)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import pagedserve
from pagedserve.bench.dataset import BenchRequest

# The server's figures sampled over time (for the plots): GetStats keys.
TIMELINE_KEYS = ("kv_usage", "cpu_kv_usage", "num_requests_running", "num_requests_waiting", "num_requests_swapped",
                 "kv_metadata_bytes")


@dataclass
class RequestResult:
    prompt_len: int
    max_tokens: int
    send_time: float = 0.0  # seconds since the run started
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each chunk
    token_ids: list[int] = field(default_factory=list)  # when the backend sees them (gRPC)
    text: str = ""
    end_time: float = 0.0
    error: str | None = None

    @property
    def output_len(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    def inter_token_latencies(self) -> list[float]:
        """The gap before each chunk after the first, spread over the chunk's tokens (a chunk
        may carry several tokens: a stop string held back, or a slow reader)."""
        out = []
        for prev, t, n in zip(self.chunk_times, self.chunk_times[1:], self.chunk_tokens[1:]):
            out += [(t - prev) / n] * n
        return out


@dataclass
class RunResult:
    results: list[RequestResult]
    duration: float
    timeline: list[dict]  # {"t": seconds, key: value for TIMELINE_KEYS}
    stats_before: dict  # empty without a stats client
    stats_after: dict
    backend: str = "grpc"


def arrival_times(num: int, request_rate: float, seed: int) -> list[float]:
    """Send times: all at 0 for an infinite rate, else a Poisson process of that rate."""
    if request_rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(request_rate)
    return times


async def _poll(client, start: float, interval: float, timeline: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            stats = await client.stats()
        except pagedserve.ServingError:
            stats = None
        if stats is not None:
            timeline.append({"t": time.perf_counter() - start, **{k: stats.get(k, 0.0) for k in TIMELINE_KEYS}})
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def run_workload(backend, requests: list[BenchRequest], request_rate: float = float("inf"),
                       max_concurrency: int | None = None, seed: int = 0, temperature: float = 0.0,
                       poll_interval: float = 0.25, progress: bool = True,
                       poller: pagedserve.AsyncClient | None = None) -> RunResult:
    """`backend`: a backends.GrpcBackend or OpenAIBackend (closed here). `poller`: a gRPC client of
    the same server (its own channel: polls never queue behind the streams) for its stats, or
    None to go without them."""
    from tqdm.auto import tqdm

    try:
        await backend.warm_up()
        stats_before = await poller.stats() if poller is not None else {}
        results = [RequestResult(len(r.prompt_ids), r.max_tokens) for r in requests]
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, dynamic_ncols=True)
        timeline: list[dict] = []
        stop = asyncio.Event()
        start = time.perf_counter()
        polling = asyncio.create_task(_poll(poller, start, poll_interval, timeline, stop)) if poller else None

        async def send(i: int, at: float) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            if gate is not None:
                async with gate:
                    await backend.send(requests[i], results[i], start, temperature)
            else:
                await backend.send(requests[i], results[i], start, temperature)
            bar.update(1)

        try:
            await asyncio.gather(*(send(i, at) for i, at in
                                   enumerate(arrival_times(len(requests), request_rate, seed))))
        finally:
            duration = time.perf_counter() - start
            stop.set()
            if polling is not None:
                await polling
            bar.close()
        stats_after = await poller.stats() if poller is not None else {}
    finally:
        await backend.close()
        if poller is not None:
            await poller.close()
    return RunResult(results, duration, timeline, stats_before, stats_after, backend.label)
