"""RayExecutor: one worker actor per tensor-parallel rank, all in one STRICT_PACK placement group
(one bundle per rank: a GPU each where there are GPUs, one CPU otherwise),
joined by a torch.distributed group (gloo on CPU, NCCL on GPU) whose address and port rank 0
picks at run time. Every step sends the same plan to every rank; rank 0's output has the tokens.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.config import EngineConfig, ModelSource
from workers.executor import Executor, WorkerFailedError
from workers.step_plan import StepOutput, StepPlan

PLACEMENT_TIMEOUT_S = 120


@ray.remote
class WorkerActor:
    """Hosts one rank's Worker. Created empty, so that rank 0 can name the group's address first."""

    def __init__(self):
        self.worker = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a port free right now, for the process group's TCP store."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, config: dict, source: ModelSource, max_model_len: int, rank: int, size: int,
              address: tuple[str, int], hf_config=None) -> None:
        import torch
        import torch.distributed as dist

        from workers.parallel import TensorParallel
        from workers.worker import Worker

        config = EngineConfig(**config)
        if config.device == "cpu":
            # The bundle reserves one logical CPU so that servers can share a node; the threads
            # take this rank's share of the node's cores (all of them at tensor_parallel_size 1).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        if size > 1:
            backend = "nccl" if config.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{address[0]}:{address[1]}",
                                    rank=rank, world_size=size)
        self.worker = Worker(config, source, max_model_len, TensorParallel(rank, size), hf_config)

    def call(self, method: str, *args):
        """Run `Worker.<method>(*args)` on this rank (every executor call goes through here)."""
        return getattr(self.worker, method)(*args)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.worker = None


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int, hf_config=None):
        size = config.tensor_parallel_size
        self.step_timeout = config.step_timeout
        if not ray.is_initialized():
            # A local cluster, as the offline API with tensor_parallel_size > 1 expects, with a
            # logical CPU per rank even where the ranks outnumber the cores.
            ray.init(num_cpus=max(os.cpu_count() or 1, size), log_to_driver=False)
        gpu = config.device == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.placement_group = placement_group([dict(bundle) for _ in range(size)], strategy="STRICT_PACK")
        self.workers: list = []
        try:
            ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise RuntimeError(
                    f"tensor_parallel_size={size} needs {size} bundles of {bundle} on one node; the "
                    f"Ray cluster could not place them in {PLACEMENT_TIMEOUT_S} s "
                    f"(cluster resources: {ray.cluster_resources()})")
            self.workers = [
                WorkerActor.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement_group, placement_group_bundle_index=rank)).remote()
                for rank in range(size)]
            address = ray.get(self.workers[0].rendezvous_address.remote())
            config_dict = dataclasses.asdict(config)
            config_ref = ray.put(hf_config)  # parsed once by the engine: a GGUF file's takes seconds
            ray.get([w.setup.remote(config_dict, source, max_model_len, rank, size, address, config_ref)
                     for rank, w in enumerate(self.workers)])
        except ray.exceptions.RayActorError as e:  # a new worker died while it started
            self.shutdown()
            raise WorkerFailedError(f"a worker died while the group started: {e}", cause="death") from e
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(self, method: str, *args) -> list:
        try:
            return ray.get([w.call.remote(method, *args) for w in self.workers])
        except ray.exceptions.RayActorError as e:  # an error raised by the method passes as it is
            raise WorkerFailedError(f"a worker died in {method}: {e}", cause="death") from e

    def execute(self, plan: StepPlan) -> StepOutput:
        """Rank 0's output. Results are taken as they come, so that one failed rank is seen at
        once, not after its peers give up waiting for it in a collective; a step with no result
        within step_timeout counts as a hang."""
        ref = ray.put(plan) if len(self.workers) > 1 else plan  # serialized once, read by every rank
        refs = [w.call.remote("execute", ref) for w in self.workers]
        deadline = time.monotonic() + self.step_timeout
        pending = refs
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise WorkerFailedError(f"no step result within step_timeout ({self.step_timeout} s): "
                                            "a worker hangs", cause="hang")
                ray.get(ready[0])  # raises at once for a rank that failed
            return ray.get(refs[0])
        except ray.exceptions.RayActorError as e:
            raise WorkerFailedError(f"a worker died during a step: {e}", cause="death") from e
        except ray.exceptions.RayError as e:
            raise WorkerFailedError(f"a worker failed a step: {e}") from e

    def node_id(self) -> str:
        """The node every rank runs on (STRICT_PACK): where the KV store must live."""
        return ray.get(self.workers[0].node_id.remote())

    def worker_pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
