"""InProcessExecutor: one worker in this process (TP=1): unit tests and the offline API."""

from __future__ import annotations

import os

from pagedserve.config import EngineConfig, ModelSource, threads_bind_cores
from workers.executor import Executor, WorkerFailedError
from workers.step_plan import StepOutput, StepPlan
from workers.worker import Worker


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int, hf_config=None):
        if config.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 needs the Ray executor; InProcessExecutor runs one rank")
        cores = threads_bind_cores(config.cpu_threads_bind)
        if cores is not None and config.device == "cpu":
            # Named cores only: 'auto' leaves the caller's process (its own threads) unpinned.
            from kernels.cpu import pin_omp_threads

            if not pin_omp_threads(cores[0]):
                raise ValueError(f"cpu_threads_bind: cannot pin this process's threads to cores {cores[0]} "
                                 f"(allowed: {sorted(os.sched_getaffinity(0))})")
        self.worker: Worker | None = Worker(config, source, max_model_len, hf_config=hf_config)

    def collective_rpc(self, method: str, *args) -> list:
        return [getattr(self.worker, method)(*args)]

    def execute(self, plan: StepPlan) -> StepOutput:
        try:
            return self.worker.execute(plan)
        except Exception as e:
            raise WorkerFailedError(f"the worker failed a step: {e!r}") from e

    def node_id(self) -> None:
        return None

    def worker_pids(self) -> list[int]:
        return [os.getpid()]

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.detach_kv_store()
        self.worker = None
