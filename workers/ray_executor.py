"""RayExecutor: one worker actor per tensor-parallel rank, all in one STRICT_PACK placement group
(one bundle per rank: a GPU each where there are GPUs, one CPU otherwise),
joined by a torch.distributed group (gloo on CPU, NCCL on GPU) whose address and port rank 0
picks at run time. Every step sends the same plan to every rank; rank 0's output has the tokens,
and every rank's reports the CPU blocks whose shard failed its checksum on that rank.

Spares (CPU groups): beside each rank waits a spare actor in the same bundle, holding no CPU of
its own, with its imports done (torch, the model code: seconds of a cold actor's start). After
a worker fault the replacement group takes over the placement group and the spares
(`previous=`), so a rebuild costs a model load and a collective init, not a process start; new
spares then warm up behind it.

Once a group is set up, the executor's calls (every step, and collective_rpc) go over a socket
of their own to each rank (workers/step_channel.py): ~1 ms a step where Ray's actor calls took
~3.5 ms. Ray still watches the workers: the channel's serving tasks end when their process does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.config import EngineConfig, ModelSource
from workers import fault_hook
from workers.executor import Executor, WorkerFailedError, merge_rank_outputs
from workers.model_config import ConfigSnapshot
from workers.local_ray import init_local_ray
from workers.priority import lower_this_threads_priority, raise_to_normal_priority, return_idle_threads_to_normal_policy
from workers.step_channel import ChannelClosed, ChannelListener, ChannelTimeout, StepChannel
from workers.step_channel import serve as serve_channel
from workers.step_plan import StepOutput, StepPlan

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120
# "0": the executor's calls go as Ray actor calls, not over the step channel (to measure one
# against the other, or to rule the channel out).
STEP_CHANNEL_ENV = "PAGEDSERVE_STEP_CHANNEL"
LIVENESS_CHECK_S = 1.0
PEER_DEATH_GRACE_S = 0.5  # after a rank failed a step, how long its peers may take to show a death


class _Importer:
    """A thread importing torch and the worker's modules; `wait()` joins it and raises what the
    import raised (a worker that cannot import is not ready)."""

    def __init__(self, lower_priority: bool):
        self._failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(lower_priority,), name="worker-imports",
                                        daemon=True)
        self._thread.start()

    def _run(self, lower_priority: bool) -> None:
        if lower_priority:
            lower_this_threads_priority()
        try:
            import torch  # noqa: F401

            import workers.worker  # noqa: F401
        except BaseException as e:
            self._failed.append(e)

    def wait(self) -> None:
        self._thread.join()
        if self._failed:
            raise self._failed[0]


@ray.remote(concurrency_groups={"control": 1})
class WorkerActor:
    """Hosts one rank's Worker. Created empty, so that rank 0 can name the group's address first.

    Its methods run on one thread of Ray's (the default concurrency group), so setup, the torch
    thread pool it sizes and pins, and every step share one OpenMP team; the step channel's serving
    task holds that thread while the group serves. The "control" methods (pid, cores, node) run
    on a thread of their own, so operators and tests may ask them at any time."""

    def __init__(self, preload: bool = False):
        """`preload`: start importing what setup needs now, on a thread, so that the import (a
        second or more of a cold start) overlaps the executor's calls that lead up to setup. A
        spare does not: it imports later at the lowest priority (`warm`)."""
        self.worker = None
        self.cores = None  # the cores its torch threads are pinned to, if they are
        self._importer = _Importer(lower_priority=False) if preload else None
        self._listener = None  # the step channel, between open_step_channel and serve_step_channel
        self._setup_thread = None  # the OS thread setup ran on: steps must run on it too
        self._parent = os.getppid()  # the raylet that started this worker

    def _exit_if_orphaned(self) -> None:
        """A worker whose raylet died (its node lost to Ray) is ended by Ray's own check within a
        second; until then it would go on answering the step channel, serving for a node Ray has
        given up, and a group could even be rebuilt onto such a spare. It ends at once instead:
        the executor sees a dead worker and rebuilds where Ray can still place it."""
        if os.getppid() != self._parent:
            os._exit(1)

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a port free right now, for the process group's TCP store."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, config: dict, source: ModelSource, max_model_len: int, rank: int, size: int,
              address: tuple[str, int], hf_config=None) -> None:
        self._exit_if_orphaned()
        raise_to_normal_priority()  # before torch's thread pools start: they inherit it
        self._setup_thread = threading.get_native_id()  # its OpenMP team is the one sized and pinned
        if self._importer is not None:
            self._importer.wait()
        import torch
        import torch.distributed as dist

        from workers.cpu_binding import bind_worker
        from workers.parallel import TensorParallel
        from workers.worker import Worker

        config = EngineConfig(**config)
        if config.device == "cpu":
            # With worker_cpus, as many threads as CPUs reserved (replicas split a node's cores).
            # Else the bundle reserves one logical CPU so that servers can share a node, and the
            # threads take this rank's share of the node's cores (all of them at TP 1). Then
            # each thread pinned to a core of its own (workers/cpu_binding.py).
            threads = config.worker_cpus or max(1, (os.cpu_count() or 1) // size)
            torch.set_num_threads(threads)
            self.cores = bind_worker(config.cpu_threads_bind, rank, threads)
        if size > 1:
            _gloo_interface_of(ray.util.get_node_ip_address())
            backend = "nccl" if config.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{address[0]}:{address[1]}",
                                    rank=rank, world_size=size)
        self.worker = Worker(config, source, max_model_len, TensorParallel(rank, size), hf_config)
        self.worker.node_id = ray.get_runtime_context().get_node_id()

    def warm(self) -> None:
        """A spare's head start: the imports setup needs, done by a thread of the lowest CPU
        priority. A spare warms up beside a serving group whose every step waits for its slowest
        thread: at normal priority its 2-3 CPU-seconds of imports, taken from the group's cores,
        cost the group more than that in stalled steps. Only the importing thread is lowered (it
        ends with the imports) and any thread it started is raised again, so the spare serves at
        normal priority once it takes over."""
        try:
            _Importer(lower_priority=True).wait()
        finally:
            return_idle_threads_to_normal_policy()

    def call(self, method: str, *args):
        """Run `Worker.<method>(*args)` on this rank (every executor call goes through here)."""
        return getattr(self.worker, method)(*args)

    def open_step_channel(self) -> tuple[tuple[str, int], bytes]:
        """Listen for the executor's step channel: (this node's address, a port) and the token
        its first message must be (workers/step_channel.py)."""
        self._listener = ChannelListener(ray.util.get_node_ip_address())
        return self._listener.address, self._listener.token

    def serve_step_channel(self) -> None:
        """Answer the executor's calls over the channel until it closes it (one long task)."""
        listener, self._listener = self._listener, None
        if threading.get_native_id() != self._setup_thread:  # a Ray whose default group is no longer one thread
            listener.close()
            raise RuntimeError("the step channel would run steps on another thread than setup's: its torch "
                               "threads would be a new, unpinned OpenMP team")
        connection = listener.accept()
        if connection is not None:
            serve_channel(connection, self._serve_call)

    def _serve_call(self, method: str, args: tuple):
        self._exit_if_orphaned()  # a getppid() a call: well under a microsecond
        return self.call(method, *args)

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def bound_cores(self) -> list[int] | None:
        return self.cores

    @ray.method(concurrency_group="control")
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.worker = None


def _fits_one_node(size: int, bundle: dict) -> bool:
    """Whether some live node of the cluster has `size` bundles' worth of each resource in all."""
    for node in ray.nodes():
        if node.get("Alive") and all(node.get("Resources", {}).get(name, 0) >= size * amount
                                     for name, amount in bundle.items()):
            return True
    return False


def _gloo_interface_of(ip: str) -> None:
    """Point gloo at the interface that holds this node's `ip`. Gloo otherwise binds the address
    the host name resolves to, which on a host with several network namespaces (or NICs) may be
    one the peers cannot reach."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int, hf_config=None,
                 previous: Executor | None = None):
        """`previous`: the failed group this one replaces; it is shut down first, and its placement
        group and warm spares are taken over when they are still there."""
        size = config.tensor_parallel_size
        self.step_timeout = config.step_timeout
        self.placement_group = None
        self.workers: list = []
        self._spares: list = []
        self._spares_warm: list = []  # ObjectRefs of the spares' `warm` calls
        self.channel: StepChannel | None = None  # None: every call goes through Ray
        self._serving: list = []  # ObjectRefs of the workers' serve_step_channel tasks
        self._channel_lock = threading.Lock()  # one call on the channel at a time
        self._liveness_checked = 0.0  # when execute last asked Ray whether every rank lives
        taken = previous.take_spares() if isinstance(previous, RayExecutor) else None
        if previous is not None:
            previous.shutdown()
        if not ray.is_initialized():
            # A local cluster, as the offline API with tensor_parallel_size > 1 expects, with a
            # logical CPU per rank even where the ranks outnumber the cores.
            init_local_ray(num_cpus=max(os.cpu_count() or 1, size), log_to_driver=False)
        self.device = config.device
        gpu = config.device == "cuda"
        cpus = config.worker_cpus or 1
        bundle = {"GPU": 1, "CPU": cpus} if gpu else {"CPU": cpus}
        try:
            # Parsed once by the engine (a GGUF file's takes seconds); sent as a snapshot, whose
            # unpickling imports nothing (a transformers config class imports seconds' worth).
            config_ref = ray.put(ConfigSnapshot.of(hf_config) if hf_config is not None else None)
            if taken is not None:
                self.placement_group, self.workers = taken
            else:
                self.placement_group = self._place(size, bundle, config.placement_node)
                self.workers = [self._actor(rank, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), preload=True)
                                for rank in range(size)]
            address = ray.get(self.workers[0].rendezvous_address.remote())
            config_dict = dataclasses.asdict(config)
            ray.get([w.setup.remote(config_dict, source, max_model_len, rank, size, address, config_ref)
                     for rank, w in enumerate(self.workers)])
            if os.environ.get(STEP_CHANNEL_ENV, "1") != "0":
                self._open_channel()
        except ray.exceptions.RayActorError as e:  # a new worker died while it started
            self.shutdown()
            raise WorkerFailedError(f"a worker died while the group started: {e}", cause="death") from e
        except BaseException:
            self.shutdown()
            raise

    def init_cache(self, num_blocks: int) -> None:
        super().init_cache(num_blocks)
        # The spares start once the group is ready to serve: warming up (a process start, torch's
        # import) beside the group's start took the cores its KV pool was allocated on, and
        # delayed serving by a second on 2 cores.
        if self.device != "cuda" and not self._spares:  # a spare holds no GPU of its own: CPU groups only
            self._spares = [self._actor(rank, num_cpus=0) for rank in range(len(self.workers))]
            self._spares_warm = [spare.warm.remote() for spare in self._spares]

    @staticmethod
    def _place(size: int, bundle: dict, target_node: str = ""):
        """The group's placement group: every rank on one node (STRICT_PACK, on `target_node` if
        it fits there) when some node could hold them all, else packed on as few nodes as Ray can
        (PACK): ranks on other nodes than rank 0 reach the KV store over gRPC."""
        one_node = _fits_one_node(size, bundle)
        if not one_node:
            log.warning("no node of the Ray cluster holds %d bundles of %s: the tensor-parallel ranks span "
                        "nodes", size, bundle)
        group = placement_group([dict(bundle) for _ in range(size)], strategy="STRICT_PACK" if one_node else "PACK",
                                _soft_target_node_id=(target_node or None) if one_node else None)
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(group)
            raise RuntimeError(
                f"tensor_parallel_size={size} needs {size} bundles of {bundle}; the "
                f"Ray cluster could not place them in {PLACEMENT_TIMEOUT_S} s "
                f"(cluster resources: {ray.cluster_resources()})")
        return group

    def _actor(self, rank: int, num_cpus: float, num_gpus: float = 0, preload: bool = False):
        test_env = fault_hook.forwarded_env()
        return WorkerActor.options(
            num_cpus=num_cpus, num_gpus=num_gpus,
            runtime_env={"env_vars": test_env} if test_env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=rank)).remote(preload=preload)

    def take_spares(self) -> tuple | None:
        """(placement group, warm spares) for a replacement group, detached from this one, or
        None when there are none or one of them died with the fault (a lost node)."""
        if not self._spares or self.placement_group is None:
            return None
        try:
            ready, _ = ray.wait(self._spares_warm, num_returns=len(self._spares_warm),
                                timeout=PLACEMENT_TIMEOUT_S)
            ray.get(ready)
        except ray.exceptions.RayError:
            return None
        if len(ready) < len(self._spares_warm):
            return None
        taken = self.placement_group, self._spares
        self.placement_group, self._spares, self._spares_warm = None, [], []
        return taken

    def _open_channel(self) -> None:
        """Steps over the step channel from now on; Ray calls where a worker cannot listen (a
        RayTaskError: logged). A rank that cannot be reached once it listens is a failed start."""
        try:
            opened = ray.get([w.open_step_channel.remote() for w in self.workers])
        except ray.exceptions.RayTaskError as e:
            log.warning("a worker could not open its step channel; steps go as Ray calls: %s", e)
            return
        self._serving = [w.serve_step_channel.remote() for w in self.workers]
        try:
            self.channel = StepChannel([address for address, _ in opened], [token for _, token in opened],
                                       alive=self._gone_rank)
        except OSError as e:
            raise WorkerFailedError(f"a worker's step channel could not be reached: {e}", cause="death") from e

    def _check_liveness(self) -> None:
        """Raises for a rank Ray holds dead, asked at most once a second. A worker on a node that
        Ray lost (its raylet gone) may run on and answer its channel; Ray has already given up on
        it, and so must the engine, which rebuilds the group where Ray can still place it."""
        now = time.monotonic()
        if now - self._liveness_checked < LIVENESS_CHECK_S:
            return
        self._liveness_checked = now
        gone = self._gone_rank()
        if gone is not None:
            raise WorkerFailedError(f"Ray reports rank {gone}'s worker gone", cause="death")

    def _gone_rank(self) -> int | None:
        """A rank whose serving task ended (Ray saw its worker die, or it stopped serving)."""
        done, _ = ray.wait(self._serving, num_returns=len(self._serving), timeout=0)
        return self._serving.index(done[0]) if done else None

    def collective_rpc(self, method: str, *args) -> list:
        if self.channel is not None:
            with self._channel_lock:
                try:
                    return self.channel.call(method, args)  # an error raised by the method passes as it is
                except ChannelClosed as e:
                    raise WorkerFailedError(f"a worker died in {method}: {e}", cause="death") from e
        try:
            return ray.get([w.call.remote(method, *args) for w in self.workers])
        except ray.exceptions.RayActorError as e:  # an error raised by the method passes as it is
            raise WorkerFailedError(f"a worker died in {method}: {e}", cause="death") from e

    def execute(self, plan: StepPlan) -> StepOutput:
        """Rank 0's output, with every rank's corrupt CPU blocks (the other ranks' outputs are
        otherwise empty: small). Results are taken as they come, so that one failed rank is seen
        at once, not after its peers give up waiting for it in a collective; a step with no result
        within step_timeout counts as a hang."""
        if self.channel is not None:
            with self._channel_lock:
                self._check_liveness()
                try:
                    # A failed step ends the group; its peers get a moment only to show whether
                    # one of them died (a rank raises in a collective whose peer was killed).
                    outputs = self.channel.call("execute", (plan,), timeout=self.step_timeout,
                                                drain_after_error=PEER_DEATH_GRACE_S)
                    return merge_rank_outputs(outputs)
                except ChannelTimeout as e:
                    raise WorkerFailedError(f"no step result within step_timeout ({self.step_timeout} s): "
                                            f"a worker hangs ({e})", cause="hang") from e
                except ChannelClosed as e:
                    raise WorkerFailedError(f"a worker died during a step: {e}", cause="death") from e
                except Exception as e:
                    raise WorkerFailedError(f"a worker failed a step: {e}") from e
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
            return merge_rank_outputs(ray.get(refs))
        except ray.exceptions.RayActorError as e:
            raise WorkerFailedError(f"a worker died during a step: {e}", cause="death") from e
        except ray.exceptions.RayError as e:
            # A rank raises in a collective whose peer was killed, often before Ray reports the
            # death: a peer's death, if one shows within the grace, is the cause.
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_DEATH_GRACE_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as death:
                    raise WorkerFailedError(f"a worker died during a step: {death}", cause="death") from death
                except ray.exceptions.RayError:
                    pass
            raise WorkerFailedError(f"a worker failed a step: {e}") from e

    def node_id(self) -> str:
        """Rank 0's node: where the KV store lives."""
        return ray.get(self.workers[0].node_id.remote())

    def spans_nodes(self) -> bool:
        return len(set(ray.get([w.node_id.remote() for w in self.workers]))) > 1

    def worker_pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in self.workers])  # a control method: answered while serving

    def spare_pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in self._spares])

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel, self._serving = None, []
        for w in self.workers + self._spares:
            ray.kill(w)
        self.workers, self._spares, self._spares_warm = [], [], []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
