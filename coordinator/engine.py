"""LLMEngine wires the parts together and owns their lifecycle; each step is

    updates = core.step(stats)                          schedule -> execute -> scheduler bookkeeping
    stopped = output_processor.detokenize(updates)      text; which sequences a stop string ended
    scheduler.finish(seq) for seq in stopped            their blocks come back in this step
    outputs = output_processor.make_outputs(updates)    streaming deltas, finished requests
    metrics.record(stats); snapshot the scheduler       the figures stats() and /metrics read

It owns: the executor (built by the caller and passed in; `from_config` builds the usual one),
the KV pool's size, the KV store (started, watched, restarted), and the parts' wiring.

Worker faults: a step that raises `WorkerFailedError` (a worker died, hung past step_timeout, or
broke its collective group) is recovered when an `executor_factory` was given: the group is
replaced, the device pool starts empty, and every unfinished request recomputes from the tokens
the coordinator holds, so its stream goes on with nothing repeated or missing. The KV store
outlives the group: swapped groups swap back in and the CPU prefix tier stays (less what the
failed step was writing). More than max_worker_restarts within restart_window re-raises: the
engine fails for good. A poison request, in the batch of two consecutive faulted steps, is ended
with an error (finish reason "poison") so that the others resume; requests that shared both
faulted batches are first run one per step, so that the next fault names one of them
(scheduler.POISON_FAULTS).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from coordinator.cpu_block_pool import CpuBlockPool
from coordinator.engine_core import EngineCore
from coordinator.generation_defaults import GenerationDefaults, load_generation_defaults
from coordinator.input_processor import InputProcessor
from coordinator.kv_cache_manager import KVCacheManager
from coordinator.metrics import EngineMetrics
from coordinator.output_processor import OutputProcessor
from coordinator.outputs import RequestOutput
from coordinator.sampling_params import SamplingParams
from coordinator.scheduler import Scheduler
from coordinator.sequence import SequenceStatus
from coordinator.stats import IterationStats, SchedulerStats, engine_stats, scheduler_stats
from kvstore.store import StoreHandle
from pagedserve.config import EngineConfig, check_batched_tokens, resolve_model
from pagedserve.config import SpeculativeConfig
from workers.executor import Executor, WorkerFailedError
from workers.gguf_cache import load_tokenizer
from workers.model_config import ModelInfo, load_hf_config

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor, model: ModelInfo, tokenizer,
                 model_name: str = "", executor_factory: Callable[[Executor | None], Executor] | None = None,
                 generation_defaults: GenerationDefaults | None = None):
        """On a refused configuration the executor is shut down: no worker outlives it.
        `executor_factory(previous)` builds a replacement group after a worker fault, shutting the
        failed one (`previous`) down first and taking over what it can (None: no recovery).
        `generation_defaults`: the model's sampling defaults and extra EOS ids (none if None)."""
        self.config = config
        self.generation_defaults = generation_defaults or GenerationDefaults()
        self._executor_factory = executor_factory
        self._restart_times: list[float] = []  # of worker-group rebuilds, within restart_window
        # Told True when a rebuild starts and False when it ends, from the thread that steps.
        self.recovery_listeners: list[Callable[[bool], None]] = []
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.executor = executor
        self.kv_store: StoreHandle | None = None
        # Prefill/decode disaggregation: "prefill" or "decode" (set by the server), and the store
        # those replicas share (coordinator/kv_handoff.py) in place of a store of its own.
        self.role = ""
        self.handoff = None
        self._offered_handoff = None  # a new shared store for a dead one, taken up by the next step
        model = self.model_info = model.with_tokenizer_eos(tokenizer).with_eos(self.generation_defaults.eos_token_ids)
        try:
            _check_model(config, model)
            num_blocks = executor.num_available_blocks()
            self.max_model_len = _resolve_max_model_len(config, model, num_blocks)
            executor.init_cache(num_blocks)
            self.kv_pool_bytes = num_blocks * executor.block_bytes() * config.tensor_parallel_size
            self.swap_block_bytes = 0  # one block over every rank, as swapped
            self.kv_store, cpu_pool = self._open_kv_store()
        except BaseException:
            executor.shutdown()
            raise
        self.kv_store_restarts = 0
        kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, cpu_pool=cpu_pool)
        self.scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.scheduling_policy,
                                   config.preemption_mode, model.eos_token_ids, self.max_model_len,
                                   config.long_prefill_token_threshold, config.max_loaded_blocks_per_step,
                                   SpeculativeConfig.from_dict(config.speculative_config)
                                   if config.speculative_config is not None else None)
        self.core = EngineCore(self.scheduler, executor, config.block_size)
        self.input_processor = InputProcessor(tokenizer, model.vocab_size, self.max_model_len, model.eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer, config.stream_interval)
        self.metrics = EngineMetrics()
        self.scheduler_stats: SchedulerStats = scheduler_stats(self.scheduler)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        """Load the tokenizer and the model's config, start the workers `config` asks for."""
        from workers.executor import create_executor

        source = resolve_model(config.model)
        hf_config = load_hf_config(source)  # a GGUF file's cached snapshot: no transformers import
        model = ModelInfo.from_hf_config(hf_config)
        _check_model(config, model)  # before any worker starts
        defaults = load_generation_defaults(config.generation_config, config.override_generation_config,
                                            source.directory, source.gguf_file is not None)
        if defaults.sampling:
            log.info("sampling defaults from %s: %s (requests that set them override them)",
                     defaults.source or "override_generation_config", defaults.sampling)

        def build_executor(previous=None) -> Executor:
            return create_executor(config, source, config.max_model_len or model.max_context, hf_config, previous)

        # The tokenizer (seconds: it imports transformers and torch) loads in a thread while the
        # workers import torch and load the model: a cold start overlaps the two.
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, source, config.tokenizer)
            executor = build_executor()
            try:
                tokenizer = tokenizer.result()
            except BaseException:
                executor.shutdown()
                raise
        return cls(config, executor, model, tokenizer, source.name, executor_factory=build_executor,
                   generation_defaults=defaults)

    # ---- the KV store ------------------------------------------------------------------------
    def _open_kv_store(self, replacing_dead: bool = False) -> tuple[StoreHandle | None, CpuBlockPool | None]:
        """The CPU KV store of `swap_space` GiB and the allocator of its block ids, or (None, None)."""
        if self.config.swap_space <= 0:
            return None, None
        block_bytes = self.executor.block_bytes()
        tp = self.config.tensor_parallel_size
        num_cpu_blocks = int(self.config.swap_space * (1 << 30)) // (block_bytes * tp)
        # auto: shared memory when every rank shares the store's node (rank 0's), else gRPC.
        transport = self.config.kv_transport
        if transport == "auto":
            transport = "grpc" if self.executor.spans_nodes() else "shm"
        store = StoreHandle(num_cpu_blocks, tp, block_bytes, self.executor.node_id(), transport)
        self.swap_block_bytes = block_bytes * tp
        try:
            self.executor.attach_kv_store(store.layout, unlink_previous=replacing_dead)
        except BaseException:
            store.close()
            raise
        return store, CpuBlockPool(num_cpu_blocks)

    def use_handoff_store(self, handoff) -> None:
        """Make `handoff` (a coordinator.kv_handoff.HandoffStore, sharded by KV head) this engine's
        CPU store: its workers attach to it and the allocator takes a view of its pool. The engine
        must have no store of its own (swap_space 0); the store's owner closes it."""
        if self.kv_store is not None:
            raise ValueError("an engine with a KV store of its own (swap_space > 0) cannot share one")
        self.executor.attach_kv_store(handoff.layout)
        with handoff.lock:
            self.scheduler.kv.use_handoff_store(handoff)
        self.handoff = handoff
        self.swap_block_bytes = handoff.block_bytes

    def offer_handoff_store(self, handoff) -> None:
        """From any thread: the store that replaces a dead shared one. The next step attaches it
        (the workers are called from the stepping thread only)."""
        self._offered_handoff = handoff

    def _take_offered_handoff_store(self) -> None:
        offered, self._offered_handoff = self._offered_handoff, None
        if offered is self.handoff or not offered.alive():
            return
        if self.handoff is not None:  # the old one died before this engine's step noticed
            self._lose_handoff_store()
        try:
            self.use_handoff_store(offered)
        except WorkerFailedError:
            raise  # the step's recovery rebuilds the group, attached to the router's current store
        except Exception as e:  # noqa: BLE001 - the replica runs on without a CPU tier, as before
            log.error("attaching the restarted prefill/decode KV store failed: %s", e)
        else:
            log.warning("the prefill/decode KV store was restarted; this replica uses it again")

    def _lose_handoff_store(self) -> None:
        """The shared store died: swapped groups recompute and the engine runs without a CPU tier
        until its owner (the router) offers the store that replaces it."""
        with self.scheduler.kv.lock:
            moved = self.scheduler.recompute_swapped()
            self.scheduler.kv.replace_cpu_pool(None)
            self.scheduler.kv.handoff = None
        log.error("the KV store shared by prefill/decode replicas died; %d swapped sequences will recompute, "
                  "and this replica runs without a CPU tier until a new store is attached", moved)
        self.handoff = None

    def _restart_kv_store(self, why: str = "the KV store died") -> None:
        """Swapped groups recompute (same tokens), and a new store takes over. If none can be
        started, preemption recomputes from now on."""
        moved = self.scheduler.recompute_swapped()
        log.warning("%s; %d swapped sequences will recompute; restarting the KV store", why, moved)
        self.kv_store.close()
        self.kv_store_restarts += 1
        try:
            self.kv_store, cpu_pool = self._open_kv_store(replacing_dead=True)
        except Exception as e:  # the engine goes on without a store rather than stall or fail
            log.error("the KV store could not be restarted (%r); preemption recomputes from now on", e)
            self.kv_store, cpu_pool = None, None
        self.scheduler.kv.replace_cpu_pool(cpu_pool)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams, priority: int = 0, messages: list[dict] | None = None) -> None:
        """Queue a request, or raise ValueError (naming the field and limit) and change nothing."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_token_ids = self.input_processor.process(prompt, prompt_token_ids, params, priority, messages)
        self.add_processed_request(request_id, prompt, prompt_token_ids, params, priority)

    def add_processed_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                              params: SamplingParams, priority: int = 0, publish_kv: bool = False) -> None:
        """Queue a request that `input_processor.process` has accepted (a server checks it in
        another thread first). `publish_kv`: a prefill-only request of a prefill replica (its
        full prompt blocks go to the shared store, under a lease keyed by `request_id`)."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        grammar = None
        if params.structured_outputs is not None:  # compiled by `process`: copied, not compiled, here
            grammar = self.input_processor.grammars.start(params.structured_outputs, prompt_token_ids)
        group = self.scheduler.add_request(request_id, prompt_token_ids, params, priority, publish_kv)
        group.first.grammar = grammar
        self.output_processor.add_request(group, prompt)

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Abort a request in any state; every block of every sample comes back at once.
        `reason` is what the finished-requests counter records (abort, deadline)."""
        if self.handoff is not None:  # a prefill-only request's lease, if a step granted it one
            self.handoff.release(request_id)
        if request_id not in self.output_processor.requests:
            return None
        stats = IterationStats()
        with self.scheduler.kv.lock:
            self.scheduler.abort_request(request_id)
        out = self.output_processor.abort_request(request_id, stats, reason)
        self.metrics.record(stats)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if self.kv_store is not None and not self.kv_store.alive():
            self._restart_kv_store()
        if self.handoff is not None and not self.handoff.alive():
            self._lose_handoff_store()
        if self._offered_handoff is not None:
            self._take_offered_handoff_store()
        stats = IterationStats()
        try:
            updates = self.core.step(stats)
        except WorkerFailedError as error:
            poisoned = self._recover(error, stats)
            updates = []
        else:
            poisoned = []
        stopped = self.output_processor.detokenize(updates)
        if stopped:
            with self.scheduler.kv.lock:
                for seq in stopped:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        outputs = poisoned + self.output_processor.make_outputs(updates, stats)
        stats.step_seconds = time.perf_counter() - start
        self.metrics.record(stats)
        self.refresh_stats()
        return outputs

    def _recover(self, error: WorkerFailedError, stats: IterationStats) -> list[RequestOutput]:
        """Replace the failed worker group and resume every request, or re-raise `error` when
        there is no factory or the restart budget is spent. Returns the outputs of the poison
        requests it ended."""
        detected = time.perf_counter()
        self._spend_restart(error)
        stats.worker_restarts.append(error.cause)
        failed, self.core.in_flight = self.core.in_flight, None
        with self.scheduler.kv.lock:
            poison = self.scheduler.record_fault(failed)
        for listener in self.recovery_listeners:
            listener(True)
        try:
            previous = self.executor
            while True:
                try:
                    self.executor = self.core.executor = self._new_executor(previous)
                    break
                except WorkerFailedError as again:  # the new group lost a worker while it started
                    previous = None  # shut down already
                    self._spend_restart(again)
                    stats.worker_restarts.append(again.cause)
        finally:
            for listener in self.recovery_listeners:
                listener(False)
        with self.scheduler.kv.lock:
            moved = self.scheduler.reset_after_worker_loss(failed)
        poisoned = [self._end_poison_request(request_id, stats) for request_id in poison]
        resumed = len(self.scheduler.groups)
        stats.requests_resumed += resumed
        stats.recovery_seconds.append(time.perf_counter() - detected)
        log.warning("worker group rebuilt in %.2f s; %d requests (%d sequences recompute, %d swapped "
                    "keep their KV) resume", stats.recovery_seconds[-1], resumed, moved,
                    sum(len(group) for group in self.scheduler.swapped))
        return [out for out in poisoned if out is not None]

    def _end_poison_request(self, request_id: str, stats: IterationStats) -> RequestOutput | None:
        message = (f"request {request_id!r} was in the batch of {self.scheduler.fault_suspects[request_id]} "
                   "consecutive steps that crashed a worker; it was ended so that the other requests could resume")
        log.error("%s", message)
        with self.scheduler.kv.lock:
            self.scheduler.abort_request(request_id)
        out = self.output_processor.abort_request(request_id, stats, "poison")
        if out is not None:
            out.error = message
        return out

    def _spend_restart(self, error: WorkerFailedError) -> None:
        """Count one rebuild against max_worker_restarts within restart_window, or re-raise
        `error` when none is left (or there is no factory to rebuild with)."""
        now = time.monotonic()
        window = self.config.restart_window
        self._restart_times = [t for t in self._restart_times if now - t < window]
        if self._executor_factory is None or len(self._restart_times) >= self.config.max_worker_restarts:
            log.error("the worker group failed (%s) and no restart is left (%d within %g s): %s",
                      error.cause, len(self._restart_times), window, _first_line(error))
            raise error
        self._restart_times.append(now)
        log.error("the worker group failed (%s): %s; rebuilding it", error.cause, _first_line(error))

    def _new_executor(self, previous: Executor | None) -> Executor:
        """A replacement group for `previous` (shut down by the factory) with the scheduler's
        pool, attached to the surviving KV store."""
        num_blocks = self.scheduler.kv.num_blocks
        executor = self._executor_factory(previous)
        try:
            if executor.num_available_blocks() < num_blocks:
                raise RuntimeError(f"the rebuilt worker group holds fewer than the {num_blocks} KV blocks "
                                   "the scheduler manages")
            executor.init_cache(num_blocks)
            store = self.kv_store if self.kv_store is not None else self.handoff
            if store is not None:
                executor.attach_kv_store(store.layout)
        except BaseException:
            executor.shutdown()
            raise
        return executor

    def refresh_stats(self) -> None:
        """Take the scheduler's snapshot now (each step does; call it after adding or aborting
        requests between steps, from the thread that runs the steps)."""
        self.scheduler_stats = scheduler_stats(self.scheduler)

    def stats(self) -> dict:
        """The figures as of the latest snapshot: safe to call from any thread."""
        return engine_stats(self)

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.kv_store is not None:
            self.kv_store.close()
            self.kv_store = None


def _first_line(error: BaseException) -> str:
    """Ray's errors run to paragraphs; a log line needs their first line."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _check_model(config: EngineConfig, model: ModelInfo) -> None:
    model.check_tensor_parallel_size(config.tensor_parallel_size)
    if config.max_model_len is not None and config.max_model_len > model.max_context:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                         f"context ({model.max_context} tokens)")


def _resolve_max_model_len(config: EngineConfig, model: ModelInfo, num_blocks: int) -> int:
    """max_model_len within the KV pool of `num_blocks`: the longest sequence must fit the pool
    alone, or it could never finish."""
    pool_tokens = num_blocks * config.block_size
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory ({config.kv_cache_memory} bytes) holds no KV block; "
                         "raise it to at least one block")
    if config.max_model_len is None:
        max_model_len = min(model.max_context, pool_tokens)
        # EngineConfig checked an explicit max_model_len; this one it could not know.
        check_batched_tokens(config.max_num_batched_tokens, max_model_len, config.enable_chunked_prefill)
    elif config.max_model_len > pool_tokens:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the KV pool "
                         f"({num_blocks} blocks x {config.block_size} = {pool_tokens} tokens); "
                         "raise kv_cache_memory or lower max_model_len")
    else:
        max_model_len = config.max_model_len
    return max_model_len
