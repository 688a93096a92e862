"""The engine loop: schedule -> execute -> process, one step at a time.

    plan = build_step_plan(scheduler.schedule())   (pure Python, no tensors)
    output = executor.execute(plan)                 (the workers: forward pass and sampling)
    self._process(...)                              (append tokens, stop, free, stream)
"""

from __future__ import annotations

import itertools
import logging
import operator
import time

from coordinator.detokenizer import IncrementalDetokenizer
from coordinator.beam_search import beam_step
from coordinator.cpu_block_pool import CpuBlockPool
from coordinator.kv_cache_manager import KVCacheManager
from coordinator.metrics import EngineMetrics
from coordinator.outputs import RequestOutput
from coordinator.plan_builder import build_step_plan
from coordinator.request_state import Completion, RequestState
from coordinator.sampling_params import SamplingParams
from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence, SequenceStatus
from coordinator.stats import engine_stats
from pagedserve.config import EngineConfig, resolve_model
from workers.executor import InProcessExecutor
from workers.model_loader import load_hf_config
from kvstore.store import StoreHandle
from workers.parallel import check_tensor_parallel_size


log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor_cls=None):
        self.config = config
        source = resolve_model(config.model)
        self.model_name = source.name
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
        hf_config = load_hf_config(source)
        self.vocab_size = hf_config.vocab_size
        model_max_len = hf_config.max_position_embeddings
        window = getattr(hf_config, "sliding_window", None)
        if isinstance(window, int) and 0 < window < model_max_len:
            # Attention here is full, not windowed: it equals the model's only within the window.
            model_max_len = window
        if config.max_model_len is not None and config.max_model_len > model_max_len:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                             f"context ({model_max_len} tokens)")
        check_tensor_parallel_size(hf_config, config.tensor_parallel_size)
        executor_cls = executor_cls or _executor_class(config)
        self.executor = executor_cls(config, source, config.max_model_len or model_max_len)
        try:
            num_blocks = self._size_kv_pool(model_max_len)
            self.executor.init_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()  # no worker actor outlives a refused configuration
            raise
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_pool_bytes = num_blocks * self.executor.block_bytes() * config.tensor_parallel_size
        self.swap_block_bytes = 0  # one block over every rank, as swapped
        self.kv_store_restarts = 0
        try:
            self.kv_store, cpu = self._open_kv_store()
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.scheduling_policy, cpu,
                                   config.preemption_mode)
        self.eos_token_ids = frozenset(_eos_ids(self.tokenizer, hf_config))
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        self._finished_seq_ids: list[int] = []
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.peak_blocks_used = 0
        self.num_steps = 0
        self.metrics = EngineMetrics()
        self.execute_seconds = 0.0  # executor.execute as the engine sees it
        self.worker_seconds = 0.0  # of which rank 0 computed; the difference is dispatch overhead

    def _open_kv_store(self, replacing_dead: bool = False):
        """The CPU KV store of `swap_space` GiB and the allocator of its block ids, or (None, None)."""
        if self.config.swap_space <= 0:
            return None, None
        block_bytes = self.executor.block_bytes()
        tp = self.config.tensor_parallel_size
        num_cpu_blocks = int(self.config.swap_space * (1 << 30)) // (block_bytes * tp)
        node_id = self.executor.node_id() if hasattr(self.executor, "node_id") else None
        # auto: shared memory, since the store is always placed on the workers' node.
        transport = "grpc" if self.config.kv_transport == "grpc" else "shm"
        store = StoreHandle(num_cpu_blocks, tp, block_bytes, node_id, transport)
        self.swap_block_bytes = block_bytes * tp
        try:
            self.executor.attach_kv_store(store.layout, unlink_previous=replacing_dead)
        except BaseException:
            store.close()
            raise
        return store, CpuBlockPool(num_cpu_blocks)

    def _restart_kv_store(self) -> None:
        """The store died: swapped groups recompute (same tokens), and a new store takes over.
        If none can be started, preemption recomputes from now on."""
        moved = self.scheduler.recompute_swapped()
        log.warning("the KV store died; %d swapped sequences will recompute; restarting it", moved)
        self.kv_store.close()
        self.kv_store_restarts += 1
        try:
            self.kv_store, cpu = self._open_kv_store(replacing_dead=True)
        except Exception as e:  # the engine goes on without a store rather than stall or fail
            log.error("the KV store could not be restarted (%r); preemption recomputes from now on", e)
            self.kv_store, cpu = None, None
        self.scheduler.replace_cpu(cpu)

    def _size_kv_pool(self, model_max_len: int) -> int:
        """The pool's block count from the workers; sets max_model_len within it."""
        config = self.config
        num_blocks = self.executor.num_available_blocks()
        pool_tokens = num_blocks * config.block_size
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory ({config.kv_cache_memory} bytes) holds no KV block; "
                             "raise it to at least one block")
        if config.max_model_len is None:
            # The longest sequence must fit the pool alone, or it could never finish.
            self.max_model_len = min(model_max_len, pool_tokens)
        elif config.max_model_len > pool_tokens:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the KV pool "
                             f"({num_blocks} blocks x {config.block_size} = {pool_tokens} tokens); "
                             "raise kv_cache_memory or lower max_model_len")
        else:
            self.max_model_len = config.max_model_len
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
                             f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is off")
        return num_blocks

    # ---- requests ----------------------------------------------------------------------------
    def check_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        """The prompt's token ids, or ValueError naming the field and limit. Changes nothing, so
        a server can call it while a step runs."""
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string; got {type(prompt).__name__}")
            prompt_token_ids = self.tokenizer.encode(prompt)
        try:  # numpy and torch integers are welcome; floats and strings are not
            prompt_token_ids = [operator.index(t) for t in prompt_token_ids]
        except TypeError:
            raise ValueError("prompt_token_ids must be a list of integers") from None
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids must lie in [0, {self.vocab_size}); got {bad[0]!r}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; it must be shorter than "
                             f"max_model_len ({self.max_model_len}) to leave room for one new token")
        return prompt_token_ids

    def check_request(self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams,
                      priority: int) -> list[int]:
        """Everything add_request could refuse, checked without changing anything (a server calls
        it before queueing, so that the engine loop never raises on a request); the token ids."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer; got {priority!r}")
        prompt_token_ids = self.check_prompt(prompt, prompt_token_ids)
        params.check_token_ids(self.vocab_size)
        return prompt_token_ids

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template, ready for a reply."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt or token ids")
        return list(self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                       return_dict=False))

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams, priority: int = 0) -> None:
        """Queue a request, or raise ValueError (naming the field and limit) and change nothing."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_token_ids = self.check_request(prompt, prompt_token_ids, params, priority)
        seq = Sequence(next(self._seq_ids), request_id, prompt_token_ids, params)
        if not params.use_beam_search:  # beams fork as the search goes
            seq.fork_ids = [next(self._seq_ids) for _ in range(params.best_of - 1)]
        seq.priority = priority
        self.requests[request_id] = RequestState(request_id, prompt, params, self._completion(seq), self.tokenizer)
        self.scheduler.add(seq)

    def _completion(self, seq: Sequence) -> Completion:
        detok = IncrementalDetokenizer(self.tokenizer, seq.num_prompt_tokens, seq.params.skip_special_tokens)
        return Completion(seq, detok)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request in any state; every block of every sample comes back at once."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.metrics.finished["abort"] += 1  # before it leaves `requests` (see _process)
        self.metrics.observe("e2e_request_latency_seconds", time.monotonic() - req.first.arrival_time)
        del self.requests[request_id]
        req.seq.fork_ids = []
        for c in req.completions:
            if not c.seq.status.finished:
                self._finish(c.seq, SequenceStatus.FINISHED_ABORTED)
        if req.beam is not None:
            req.beam.done = True  # the hypotheses so far are the answer
        return req.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        step_start = time.monotonic()
        if self.kv_store is not None and not self.kv_store.alive():
            self._restart_kv_store()
        sched = self.scheduler.schedule()
        now = time.monotonic()
        for seq, _ in sched.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                if seq.num_preemptions == 0 and seq is self.requests[seq.request_id].first:
                    self.metrics.observe("request_queue_time_seconds", now - seq.arrival_time)
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        plan = build_step_plan(sched, self.config.block_size, finished, self.eos_token_ids)
        start = time.perf_counter()
        try:
            output = self.executor.execute(plan)
        finally:
            self.scheduler.end_step()  # the CPU blocks the step held, whatever happened
        self.execute_seconds += time.perf_counter() - start
        self.worker_seconds += output.worker_seconds
        self.num_steps += 1
        self.peak_blocks_used = max(self.peak_blocks_used, self.kv.pool.num_used)
        outputs = self._process(sched, output)
        metrics = self.metrics
        if sched.num_tokens:
            metrics.observe("tokens_per_step", sched.num_tokens)
        if output.swap_seconds:
            metrics.observe("swap_transfer_seconds", output.swap_seconds)
        metrics.observe("step_duration_seconds", time.monotonic() - step_start)
        return outputs

    def _process(self, sched, output) -> list[RequestOutput]:
        sampled = dict(zip(output.seq_ids, output.token_ids.tolist()))
        logprobs = dict(zip(output.seq_ids, output.logprobs)) if output.logprobs else {}
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        if output.prompt_logprobs:
            by_id = {seq.seq_id: seq for seq, _ in sched.scheduled}
            for seq_id, (position, entries) in output.prompt_logprobs.items():
                self.requests[by_id[seq_id].request_id].record_prompt_logprobs(position, entries)
        for seq, n in sched.scheduled:
            old = seq.num_computed_tokens
            seq.num_computed_tokens = old + n
            self.kv.commit_computed(seq, old)
            if seq.seq_id not in sampled:
                continue  # a prefill chunk that is not the last
            req = self.requests[seq.request_id]
            if seq.last_token_time is not None:
                self.metrics.observe("inter_token_latency_seconds", now - seq.last_token_time)
            seq.last_token_time = now
            if seq.first_token_time is None:
                seq.first_token_time = now
                if seq is req.first:
                    self.num_prompt_tokens += seq.num_prompt_tokens
                    self.metrics.observe("time_to_first_token_seconds", now - seq.arrival_time)
            touched[req.request_id] = req
            if req.beam is not None:
                req.pending_beam_logprobs[seq.seq_id] = logprobs[seq.seq_id]
                continue
            new = [seq] + (self._fork(req, seq) if seq.fork_ids else [])
            for s in new:
                self._append_token(req, s, sampled[s.seq_id], logprobs.get(s.seq_id))
        outputs = []
        for req in touched.values():
            if req.beam is not None:
                self._advance_beams(req)
            out = req.output()
            if req.finished:
                # Counted before it leaves `requests`: a scrape between the two never misses it.
                reason = out.outputs[0].finish_reason if out is not None and out.outputs else None
                self.metrics.finished[reason or "abort"] += 1
                self.metrics.observe("e2e_request_latency_seconds", now - req.first.arrival_time)
                del self.requests[req.request_id]
            if out is not None:
                outputs.append(out)
        return outputs

    def _fork(self, req: RequestState, parent: Sequence) -> list[Sequence]:
        """The parent's prompt is computed: fork the other samples onto its blocks (ref counts,
        no copy; the first write into the shared partial block copies it)."""
        children = [self._spawn(parent, fork_id) for fork_id in parent.fork_ids]
        req.completions += [self._completion(child) for child in children]
        parent.fork_ids = []
        return children

    def _spawn(self, parent: Sequence, seq_id: int) -> Sequence:
        """A new sample or beam continuing `parent`: its tokens and timings, its blocks shared."""
        child = Sequence(seq_id, parent.request_id, parent.prompt_token_ids, parent.params)
        child.token_ids = list(parent.token_ids)
        child.priority, child.arrival_time = parent.priority, parent.arrival_time
        child.first_scheduled_time, child.first_token_time = parent.first_scheduled_time, parent.first_token_time
        child.last_token_time = parent.last_token_time
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        if parent.status == SequenceStatus.RUNNING:
            self.kv.fork(parent, child)
            self.scheduler.add_running(child)
        else:  # the parent was preempted: the child recomputes (or re-finds) its context too
            self.scheduler.add(child)
        return child

    def _advance_beams(self, req: RequestState) -> None:
        """Once every running beam has its candidates, take one beam-search step: beams chosen
        twice or more fork, beams chosen by none are freed at once."""
        beams = [c.seq for c in req.completions]
        if any(b.seq_id not in req.pending_beam_logprobs for b in beams):
            return  # a preempted beam is still catching up
        p = req.params
        eos = frozenset() if p.ignore_eos else self.eos_token_ids
        step = beam_step(req.beam, beams, req.pending_beam_logprobs, eos, p.max_tokens, self.max_model_len)
        req.pending_beam_logprobs.clear()
        chosen: dict[int, list[tuple[int, float]]] = {}
        for parent, token, score in step.continuations:
            chosen.setdefault(parent.seq_id, []).append((token, score))
        survivors, scores = [], {}
        for parent in beams:
            picks = chosen.get(parent.seq_id)
            if not picks:
                self._finish(parent, SequenceStatus.FINISHED_ABORTED)  # dropped: its blocks come back now
                continue
            children = [self._spawn(parent, next(self._seq_ids)) for _ in picks[1:]]  # before the parent moves on
            for seq, (token, score) in zip([parent] + children, picks):
                seq.token_ids.append(token)
                self.num_generation_tokens += 1
                survivors.append(seq)
                scores[seq.seq_id] = score
        req.beam.scores = scores
        req.completions = [self._completion(s) for s in survivors]
        if req.beam.done:
            req.first.finish_time = time.monotonic()

    def _append_token(self, req: RequestState, seq: Sequence, token: int, logprobs) -> None:
        completion = next(c for c in req.completions if c.seq is seq)
        seq.token_ids.append(token)
        self.num_generation_tokens += 1
        if logprobs is not None:
            completion.record_logprobs(logprobs, self.tokenizer, keep=req.params.logprobs is not None)
        completion.detok.step(seq.token_ids)
        status = self._stop_status(completion, token)
        if status is not None:
            self._finish(seq, status)

    def _stop_status(self, completion: Completion, token: int) -> SequenceStatus | None:
        seq, p = completion.seq, completion.seq.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
            if p.stop and completion.truncate_at_stop_string():
                return SequenceStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)
        seq.finish_time = time.monotonic()
        self._finished_seq_ids.append(seq.seq_id)

    def stats(self) -> dict:
        return engine_stats(self)

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.kv_store is not None:
            self.kv_store.close()
            self.kv_store = None


def _executor_class(config: EngineConfig):
    backend = config.distributed_executor_backend
    if backend == "ray" or (backend == "auto" and config.tensor_parallel_size > 1):
        from workers.ray_executor import RayExecutor

        return RayExecutor
    return InProcessExecutor


def _eos_ids(tokenizer, hf_config) -> set[int]:
    ids = set()
    for value in (tokenizer.eos_token_id, getattr(hf_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
