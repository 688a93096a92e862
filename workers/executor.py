"""The one interface the engine runs workers through, whatever runs them: `InProcessExecutor`
(one worker in this process, TP=1) or `RayExecutor` (a worker actor per tensor-parallel rank).

Torch-free on purpose: the coordinator imports this module, never the workers behind it.
Subclasses implement `collective_rpc` (call one Worker method on every rank) and `execute`;
the cache and store set-up are written once here in terms of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedserve.config import EngineConfig, ModelSource
from workers.step_plan import StepOutput, StepPlan


class WorkerFailedError(RuntimeError):
    """A worker died, hung, or raised inside a step: the group's state can no longer be trusted.
    Raised by every executor for every lost or failed worker, with the original as `__cause__`.
    `cause`: "death" (a process is gone), "hang" (no result within step_timeout) or "error"."""

    def __init__(self, message: str, cause: str = "error"):
        super().__init__(message)
        self.cause = cause


class Executor(ABC):
    @abstractmethod
    def collective_rpc(self, method: str, *args) -> list:
        """Call `Worker.<method>(*args)` on every rank; their results in rank order."""

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step on every rank; rank 0's output (the sampled tokens), with every rank's
        corrupt CPU blocks (`merge_rank_outputs`)."""

    @abstractmethod
    def node_id(self) -> str | None:
        """The Ray node of rank 0 (where the KV store lives), or None in process."""

    def spans_nodes(self) -> bool:
        """Whether the ranks run on more than one node (the KV store is then reached over gRPC)."""
        return False

    @abstractmethod
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks (for operators and fault tests)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers; safe to call twice."""

    def num_available_blocks(self) -> int:
        # Every rank holds the same number of blocks (its KV heads of each): the smallest pool wins.
        return min(self.collective_rpc("num_available_blocks"))

    def init_cache(self, num_blocks: int) -> None:
        self.collective_rpc("init_cache", num_blocks)

    def block_bytes(self) -> int:
        """Bytes of one block on one rank (every rank's shard is the same size)."""
        return self.collective_rpc("block_bytes")[0]

    def attach_kv_store(self, layout, unlink_previous: bool = False) -> None:
        self.collective_rpc("attach_kv_store", layout, unlink_previous)


def merge_rank_outputs(outputs: list[StepOutput]) -> StepOutput:
    """Rank 0's output, reporting the CPU blocks whose checksum failed on any rank (each rank
    checks only its own shard, and one bad shard spoils the block) and whether any rank's weights
    were still moving onto huge pages."""
    merged = outputs[0]
    merged.corrupt_cpu_blocks = sorted({c for out in outputs for c in out.corrupt_cpu_blocks})
    merged.weights_moving = any(out.weights_moving for out in outputs)
    return merged


def create_executor(config: EngineConfig, source: ModelSource, max_model_len: int, hf_config=None,
                    previous: Executor | None = None) -> Executor:
    """The executor `distributed_executor_backend` asks for: Ray for `ray`, or `auto` with more
    than one rank; in process otherwise. `hf_config` spares the workers a second parse.
    `previous`: a failed group this one replaces, shut down first (a Ray group's warm spares
    are taken over)."""
    backend = config.distributed_executor_backend
    if backend == "ray" or (backend == "auto" and config.tensor_parallel_size > 1):
        from workers.ray_executor import RayExecutor

        return RayExecutor(config, source, max_model_len, hf_config, previous)
    if previous is not None:
        previous.shutdown()
    from workers.inprocess_executor import InProcessExecutor

    return InProcessExecutor(config, source, max_model_len, hf_config)
