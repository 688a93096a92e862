"""How many KV blocks fit on a GPU: `gpu_memory_utilization` of the device's memory, less the
weights, the peak activations of the largest step (a forward of `max_num_batched_tokens` tokens
and the logits of `max_num_seqs` rows), and the memory CUDA graphs will hold (the activations of
the largest captured decode batch: graphs keep their own pool). All three are measured by running
them, not estimated from shapes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GiB = 1 << 30


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # the device's memory
    weights: int  # allocated before profiling: the model
    peak_activations: int  # above the weights during the largest step
    graphs: int  # reserved for CUDA graphs' private pool (0 without graphs)


def kv_blocks_for(profile: MemoryProfile, utilization: float, block_bytes: int) -> int:
    """Blocks of `block_bytes` (one rank's shard) in what is left; ValueError with the numbers
    when not even one fits."""
    budget = int(profile.total * utilization)
    left = budget - profile.weights - profile.peak_activations - profile.graphs
    if left < block_bytes:
        raise ValueError(
            f"gpu_memory_utilization ({utilization}) allows {budget / GiB:.2f} of {profile.total / GiB:.2f} GiB; "
            f"weights ({profile.weights / GiB:.2f} GiB), peak activations ({profile.peak_activations / GiB:.2f} GiB) "
            f"and CUDA graphs ({profile.graphs / GiB:.2f} GiB) leave {left / GiB:.2f} GiB, not one KV block "
            f"({block_bytes} bytes): raise gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs")
    return left // block_bytes


def profile(worker, max_num_batched_tokens: int, max_num_seqs: int, graph_batch: int) -> MemoryProfile:
    """Run the largest prefill step and the largest graph-sized decode step on a scratch cache."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated()
    prefill, graphs = _peaks(worker, weights, max_num_batched_tokens, max_num_seqs, graph_batch)
    torch.cuda.empty_cache()  # the scratch cache is gone
    total = torch.cuda.mem_get_info()[1]
    return MemoryProfile(total, weights, max(prefill, 0), max(graphs, 0))


def _peaks(worker, weights: int, max_num_batched_tokens: int, max_num_seqs: int, graph_batch: int) -> tuple[int, int]:
    bs = worker.config.block_size
    tokens = max(max_num_batched_tokens, max_num_seqs)
    scratch = worker.cache_spec.allocate(-(-tokens // bs) + 1, worker.device)
    baseline = weights + scratch.numel() * scratch.element_size()

    def peak_of(num_seqs: int, query_len: int, logits_rows: int) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        worker.dummy_step(scratch, num_seqs, query_len, logits_rows)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - baseline

    prefill = peak_of(1, max_num_batched_tokens, max_num_seqs)
    graphs = peak_of(graph_batch, 1, 0) if graph_batch else 0
    return prefill, graphs
