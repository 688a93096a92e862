"""Executors run a step plan on every worker. InProcessExecutor: one worker in this process (TP=1)."""

from __future__ import annotations

from pagedserve.config import EngineConfig, ModelSource
from workers.step_plan import StepOutput, StepPlan
from workers.worker import Worker


class InProcessExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        if config.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 needs the Ray executor; InProcessExecutor runs one rank")
        self.worker = Worker(config, source, max_model_len)

    def num_available_blocks(self) -> int:
        return self.worker.num_available_blocks()

    def init_cache(self, num_blocks: int) -> None:
        self.worker.init_cache(num_blocks)

    def block_bytes(self) -> int:
        return self.worker.block_bytes()

    def attach_kv_store(self, layout, unlink_previous: bool = False) -> None:
        self.worker.attach_kv_store(layout, unlink_previous)

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.worker.execute(plan)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.worker = None
