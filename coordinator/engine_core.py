"""The engine loop, and nothing else:

    out = scheduler.schedule()                          which sequences run, which blocks move
    output = executor.execute(build_step_plan(out))     the workers: transfers, forward, sampling
    updates = scheduler.update_from_output(out, output) the scheduler's own bookkeeping

Torch-free: the executor is reached only through the `Executor` interface, and a lost or failed
worker surfaces as its `WorkerFailedError`. Text, stop strings and outputs are the output
processor's; the model, the tokenizer and the KV store's lifecycle are LLMEngine's.
"""

from __future__ import annotations

import time

from coordinator.plan_builder import build_step_plan
from coordinator.scheduler import Scheduler, SchedulerOutput
from coordinator.sequence import GroupUpdate
from coordinator.stats import IterationStats
from workers.executor import Executor


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, block_size: int):
        self.scheduler = scheduler
        self.executor = executor
        self.block_size = block_size
        # The step the executor is running; left set when it raised, for the engine's recovery
        # to read what the failed step was doing (its batch, its writes into the CPU store).
        self.in_flight: SchedulerOutput | None = None

    def step(self, stats: IterationStats) -> list[GroupUpdate]:
        """One step; what it did goes to `stats` (its duration is the caller's to measure)."""
        scheduler = self.scheduler
        lock = scheduler.kv.lock  # a store shared with other replicas: their steps schedule too
        with lock:
            out = self.in_flight = scheduler.schedule()
        stats.queue_times += out.queue_times
        stats.num_scheduled_tokens = out.num_tokens
        plan = build_step_plan(out, self.block_size, scheduler.take_finished_seq_ids(), scheduler.eos_token_ids)
        executed = time.perf_counter()
        try:
            output = self.executor.execute(plan)
        except BaseException:
            with lock:
                scheduler.kv.end_step(succeeded=False)  # the CPU blocks the step held or wrote
            raise
        self.in_flight = None
        stats.execute_seconds = time.perf_counter() - executed
        stats.worker_seconds = output.worker_seconds
        stats.swap_seconds = output.swap_seconds
        stats.weights_moving = output.weights_moving
        if out.publish or (out.load and scheduler.kv.handoff is not None):
            stats.pd_transfers.append((len(out.publish), output.publish_seconds, len(out.load), output.load_seconds))
        with lock:
            scheduler.kv.end_step()
            updates = scheduler.update_from_output(out, output, stats)
        stats.alloc_latencies_ns = scheduler.kv.pool.take_latency_samples()
        return updates
