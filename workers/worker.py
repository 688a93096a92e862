"""A worker: holds the model and the KV cache, executes step plans, samples on rank 0."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

import kernels
from kvstore.swap_space import open_swap_space
from pagedserve.config import EngineConfig, ModelSource
from workers import fault_hook
from workers.huge_pages import HugePageMove
from workers.kernel_choice import kept_f32_kernel_rows, tune_f32_kernel_rows
from workers.kv_cache import KVCacheSpec, copy_blocks
from workers.model_config import load_hf_config
from workers.model_loader import load_model, resolve_dtype, resolve_kv_cache_dtype
from workers.parallel import TensorParallel
from workers.sampler import Sampler, apply_token_bitmask, token_logprobs
from workers.step_heap import keep_freed_memory_for_steps
from workers.step_plan import StepOutput, StepPlan

log = logging.getLogger(__name__)

GATHER_BYTES = 8 << 20


def _plain_greedy(p) -> bool:
    """Argmax of the raw logits is this sequence's token: nothing to process, no logprobs."""
    return (p.temperature == 0.0 and p.num_logprobs < 0 and not p.has_penalties and not p.logit_bias
            and p.allowed_token_ids is None and not p.banned_token_ids)


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing the array's memory; a copy when the array is read-only (a plan that came
    through Ray arrives in read-only buffers, which torch must not alias)."""
    return torch.from_numpy(array if array.flags.writeable else array.copy())


class Worker:
    """One tensor-parallel rank. Every rank runs the same plan; only rank 0 samples."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int,
                 tp: TensorParallel = TensorParallel(), hf_config=None):
        self.config = config
        self.tp = tp
        self.device = config.device
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.attn_backend = kernels.get_backend(config.attention_backend, self.device, self.kv_dtype)
        # The caller's copy when it has one (parsing a GGUF file's config takes seconds).
        self.hf_config = hf_config if hf_config is not None else load_hf_config(source)
        torch.manual_seed(config.seed)
        self.model = load_model(source, self.hf_config, self.dtype, self.device, max_model_len, tp,
                                config.quantization)
        # A few-row step streams every weight: on huge pages it walks far fewer page tables. The
        # copy runs beside the rest of the start, and is taken up between two steps (the lock).
        self._step_lock = threading.Lock()
        self._weights_move = HugePageMove(self.model, self._step_lock) if self.device == "cpu" else None
        # Up to how many rows fp32 layers take the C kernel (workers/kernel_choice.py): kept from an
        # earlier start, or measured once the weights are where they stay, between two steps.
        with self._step_lock:  # a kept answer may re-pack weights the move is about to re-point
            self._kernels_chosen = self.device != "cpu" or kept_f32_kernel_rows(self.model) is not None
        attn = self.model.layers[0].self_attn
        self.cache_spec = KVCacheSpec(self.hf_config.num_hidden_layers, config.block_size,
                                      attn.num_kv_heads, attn.head_dim, self.kv_dtype)
        self.kv_cache: torch.Tensor | None = None
        self.swap_space = None  # kvstore.swap_space.SwapSpace (shared memory or gRPC), or None
        # Attention groups whose gathered K/V stay within this many bytes per layer are read back
        # from the CPU cache, not DRAM.
        token_bytes = self.cache_spec.block_bytes // (self.cache_spec.num_layers * config.block_size)
        self._max_gather_tokens = max(config.block_size, GATHER_BYTES // token_bytes)
        self.max_model_len = max_model_len
        # CUDA graphs of decode steps: on a GPU, with the Triton kernels, one rank (an all-reduce
        # inside a graph needs NCCL set up for capture), unless enforce_eager.
        self._use_graphs = (self.device == "cuda" and self.attn_backend.name == "triton" and tp.size == 1
                            and not config.enforce_eager)
        self._graphs = None
        self.sampler = Sampler(config.seed)
        self._crash_token = fault_hook.armed_token()  # None unless a test armed the hook
        self._crash_in_publish = fault_hook.armed_in_publish()
        self.node_id = ""  # its Ray node, set by a worker actor (a shared KV store maps by node)

    def num_available_blocks(self) -> int:
        """CPU: `kv_cache_memory` bytes. GPU: what `gpu_memory_utilization` leaves after the weights,
        the largest step's activations and the CUDA graphs, all measured (workers/gpu_memory.py)."""
        if self.device != "cuda":
            return self.cache_spec.num_blocks_for(self.config.kv_cache_memory)
        from workers import gpu_memory
        from workers.cuda_graphs import graph_batch_sizes

        graph_batch = graph_batch_sizes(self.config.max_num_seqs)[-1] if self._use_graphs else 0
        found = gpu_memory.profile(self, self.config.max_num_batched_tokens, self.config.max_num_seqs, graph_batch)
        return gpu_memory.kv_blocks_for(found, self.config.gpu_memory_utilization, self.cache_spec.block_bytes)

    def init_cache(self, num_blocks: int) -> None:
        self.kv_cache = self.cache_spec.allocate(num_blocks, self.device)
        if self.device == "cpu" and self.dtype == torch.bfloat16:
            keep_freed_memory_for_steps()  # steps come next: their activations reuse freed pages
        if self._use_graphs:
            from workers.cuda_graphs import DecodeGraphs

            self._graphs = DecodeGraphs(self.attn_backend, self.model, self.kv_cache, self.config.max_num_seqs,
                                        self.max_model_len, self.config.block_size)

    def _metadata(self, query_lens, context_lens, block_tables, slot_mapping):
        """The attention backend's per-step metadata, from CPU tensors."""
        return self.attn_backend.build_metadata(query_lens, context_lens, block_tables, slot_mapping,
                                                self.config.block_size, self._max_gather_tokens)

    @torch.inference_mode()
    def dummy_step(self, cache: torch.Tensor, num_seqs: int, query_len: int, logits_rows: int) -> None:
        """A step of `num_seqs` fresh sequences of `query_len` tokens on a scratch `cache`, and the
        logits of `logits_rows` rows: the memory profile's largest steps."""
        bs = self.config.block_size
        per_seq = -(-query_len // bs)
        tables = torch.arange(num_seqs * per_seq, dtype=torch.int32).view(num_seqs, per_seq) % cache.shape[0]
        lens = torch.full((num_seqs,), query_len, dtype=torch.int32)
        pos = torch.arange(query_len).repeat(num_seqs)
        slots = (tables.long().repeat_interleave(bs, dim=1)[:, :query_len] * bs + torch.arange(query_len) % bs).flatten()
        meta = self._metadata(lens, lens, tables, slots)
        with self._step_lock:
            hidden = self.model(pos.to(self.device) % 7, pos.to(self.device), cache, meta)
            if logits_rows:
                self.model.compute_logits(hidden[torch.arange(logits_rows, device=self.device) % hidden.shape[0]])

    def block_bytes(self) -> int:
        """Bytes of one block of this rank's cache (its KV heads)."""
        return self.cache_spec.block_bytes

    def attach_kv_store(self, layout, unlink_previous: bool = False) -> None:
        """Open this rank's swap space onto the store, over the layout's transport. A restarted
        store's replaces the old one, whose segment name rank 0 removes when the old store died
        without doing so (the workers share its node)."""
        previous = self.swap_space.layout.segment if self.swap_space is not None else None
        self.detach_kv_store()
        if previous and unlink_previous and self.tp.rank == 0:
            from kvstore.store import unlink_segment

            unlink_segment(previous)
        num_kv_heads = self.hf_config.num_key_value_heads
        heads = self.tp.kv_heads(num_kv_heads)
        # A KV head replicated on several ranks is written to a head-sharded store by its first.
        writes = self.tp.size <= num_kv_heads or self.tp.rank % (self.tp.size // num_kv_heads) == 0
        self.swap_space = open_swap_space(layout, self.tp.rank, self.kv_cache, heads, writes, self.node_id)

    def detach_kv_store(self) -> None:
        """Let go of the store; its pool stays (the store owns it)."""
        if self.swap_space is not None:
            self.swap_space.close()
            self.swap_space = None

    def wait_for_weights(self) -> int:
        """Wait for the weights' copy onto huge pages (workers/huge_pages.py); the bytes moved, 0
        where nothing moves. Between steps only: the copy ends by taking the step lock."""
        moved = self._weights_move.wait() if self._weights_move is not None else 0
        with self._step_lock:
            self._choose_kernels()
        return moved

    def _choose_kernels(self) -> None:
        """Where no earlier start kept the few-row crossover: measured once the weights' move is
        done, before the step that finds it done (workers/kernel_choice.py)."""
        if self._kernels_chosen or (self._weights_move is not None and self._weights_move.running()):
            return
        self._kernels_chosen = True
        try:
            tune_f32_kernel_rows(self.model)
        except Exception:  # the defaults serve as they did
            log.exception("measuring the few-row kernels failed; the defaults stay")

    def execute(self, plan: StepPlan) -> StepOutput:
        with self._step_lock:  # the weights are not re-pointed during a step
            self._choose_kernels()
            return self._execute_step(plan)

    def _execute_step(self, plan: StepPlan) -> StepOutput:
        start = time.perf_counter()
        if self._crash_token is not None:  # armed by tests only: see workers/fault_hook.py
            fault_hook.crash_if_present(plan.input_ids, self._crash_token)
        transfers = bool(plan.swap_out or plan.swap_in or plan.load or plan.publish)
        transfer_seconds, load_seconds, corrupt = self._transfer(plan)
        output = self._execute(plan)
        output.corrupt_cpu_blocks = corrupt
        output.load_seconds = load_seconds
        if plan.publish:  # prompt blocks the forward pass just completed, for a decode replica
            published = time.perf_counter()
            if self._crash_in_publish:  # armed by tests only: dies with half the blocks written
                self.swap_space.swap_out(plan.publish[:len(plan.publish) // 2])
                fault_hook.crash()
            self.swap_space.swap_out(plan.publish)
            output.publish_seconds = time.perf_counter() - published
            transfer_seconds += output.publish_seconds
        if transfers:  # a GPU's copies ran beside the forward pass: wait for them
            waited = time.perf_counter()
            self.swap_space.finish()
            waited = time.perf_counter() - waited
            transfer_seconds += waited
            if plan.load:  # the copies are not told apart on a GPU: the wait counts for the loads
                output.load_seconds += waited
        output.worker_seconds = time.perf_counter() - start
        output.weights_moving = self._weights_move is not None and self._weights_move.running()
        output.swap_seconds = transfer_seconds if transfers else 0.0
        return output

    def _transfer(self, plan: StepPlan) -> tuple[float, float, list[int]]:
        """The step's swaps and CPU-tier transfers, in the order the scheduler relies on: swap-outs
        first (a block they read may be a copy's or a swap-in's destination in the same step: a
        block freed by a swap-out, or a cached block evicted and saved), then the copy-on-write
        copies, then swap-ins; then the forward pass may run. Returns the seconds they took, the
        seconds of which the loads took, and the CPU blocks read back whose checksum failed.

        A failed swap-in is harmless here: its sequences run from the next step on, and the
        coordinator recomputes them first. A failed load is read by this very forward pass; the
        coordinator then discards what the step computed for the sequences that hold it (their
        sampled token included), so bad data is never served and the step needs no second pass."""
        start = time.perf_counter()
        corrupt: list[int] = []
        if plan.swap_out:
            self.swap_space.swap_out(plan.swap_out)
        copy_blocks(self.kv_cache, plan.copy)
        if plan.swap_in:
            corrupt += self.swap_space.swap_in(plan.swap_in)
        load_seconds = 0.0
        if plan.load:
            loading = time.perf_counter()
            corrupt += self.swap_space.swap_in(plan.load, release=False)
            load_seconds = time.perf_counter() - loading
        return time.perf_counter() - start, load_seconds, corrupt

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> StepOutput:
        if plan.num_tokens == 0:
            return StepOutput([], np.zeros(0, dtype=np.int64))
        input_ids, positions = (_tensor(a).to(self.device, non_blocking=True) for a in (plan.input_ids, plan.positions))
        hidden = None
        if self._graphs is not None and not plan.prompt_logprobs and plan.num_tokens == len(plan.query_lens):
            hidden = self._graphs.run(input_ids, positions, *(_tensor(a).to(self.device, non_blocking=True) for a in (
                plan.slot_mapping, plan.context_lens, plan.block_tables)))
        if hidden is None:
            meta = self._metadata(_tensor(plan.query_lens), _tensor(plan.context_lens), _tensor(plan.block_tables),
                                  _tensor(plan.slot_mapping))
            hidden = self.model(input_ids, positions, self.kv_cache, meta)
        prompt_logprobs = self._prompt_logprobs(hidden, plan) if plan.prompt_logprobs else {}
        if len(plan.sample_indices) == 0:
            return StepOutput([], np.zeros(0, dtype=np.int64), prompt_logprobs=prompt_logprobs)
        # The last token of each sequence that needs logits.
        last_token = (np.cumsum(plan.query_lens)[plan.sample_indices] - 1 if plan.logit_rows is None
                      else plan.logit_rows)
        logits = self.model.compute_logits(hidden[torch.from_numpy(last_token).to(self.device)])
        if logits is None:  # not rank 0: the logits went to rank 0
            return StepOutput([], np.zeros(0, dtype=np.int64))
        if plan.token_bitmask is not None:  # before penalties, temperature, top-k/p: on the device
            apply_token_bitmask(logits, plan.token_bitmask, plan.sampling)
        if logits.device.type != "cpu":
            if all(_plain_greedy(p) for p in plan.sampling):  # argmax where the logits are
                return StepOutput([s.seq_id for s in plan.sampling], logits.argmax(dim=-1).cpu().numpy(),
                                  prompt_logprobs=prompt_logprobs)
            logits = logits.float().cpu()  # the sampler's processing runs on the CPU
        tokens, logprobs = self.sampler(logits, plan.sampling)
        return StepOutput([s.seq_id for s in plan.sampling], tokens.numpy(), logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, plan: StepPlan) -> dict:
        """Raw logprobs of prompt tokens (every rank computes its vocabulary shard; rank 0 ranks)."""
        out = {}
        for req in plan.prompt_logprobs:
            rows = hidden[req.first_row:req.first_row + len(req.targets)]
            logits = self.model.compute_logits(rows)
            if logits is None:
                continue
            logprobs = torch.log_softmax(logits, dim=-1)
            out[req.seq_id] = (req.first_position, [token_logprobs(row, target, req.num_logprobs)
                                                    for row, target in zip(logprobs, req.targets)])
        return out
