"""CUDA graphs of the decode step's forward pass (the model body; logits and sampling stay
outside), one per padded batch size, replayed for every step made only of decodes.

A decode batch of n sequences runs the graph of the smallest captured size >= n: the rows past n
are padding, with slot -1 (write_kv skips it), a context of one token and block table row 0, and
their outputs are dropped. Inputs live in static buffers the graphs were captured on; a replay
copies the step's values into them. The split-K factor of each graph is fixed at capture for the
longest context (`max_model_len`): shorter contexts leave some splits empty, which costs little.
"""

from __future__ import annotations

import torch

BATCH_SIZES = (1, 2, 4, 8) + tuple(range(16, 513, 16))


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in BATCH_SIZES if b <= max_num_seqs]
    if not sizes or sizes[-1] < max_num_seqs <= BATCH_SIZES[-1]:
        sizes.append(next(b for b in BATCH_SIZES if b >= max_num_seqs))
    return sizes


def padded_size(sizes: list[int], n: int) -> int | None:
    """The smallest captured size that holds n sequences; None when n exceeds them all."""
    return next((b for b in sizes if b >= n), None)


class DecodeGraphs:
    def __init__(self, backend, model, kv_cache: torch.Tensor, max_num_seqs: int, max_model_len: int,
                 block_size: int):
        """`backend`: the worker's TritonBackend, which the captured layers call through."""
        from kernels.triton.attention import TritonMetadata, choose_num_splits

        self.model, self.kv_cache = model, kv_cache
        self.sizes = graph_batch_sizes(max_num_seqs)
        largest, device = self.sizes[-1], kv_cache.device
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((largest, max_blocks), dtype=torch.int32, device=device)
        # Held for the graphs' lifetime: a replay reads them through the addresses captured, so a
        # tensor freed after capture would hand its memory to others and the graphs garbage.
        self.rows = rows = torch.arange(largest, dtype=torch.long, device=device)
        self.no_prefill = no_prefill = torch.zeros(0, dtype=torch.int32, device=device)
        num_kv_heads = kv_cache.shape[4]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: its pool then serves the smaller ones
            meta = TritonMetadata(
                slot_mapping=self.slot_mapping[:b], prefill_query_start=no_prefill, prefill_query_lens=no_prefill,
                prefill_context_lens=no_prefill, prefill_block_tables=no_prefill.view(0, 1), max_prefill_query_len=0,
                decode_rows=rows[:b], decode_context_lens=self.context_lens[:b], decode_block_tables=self.block_tables[:b],
                max_decode_context=max_model_len, num_splits=choose_num_splits(b, num_kv_heads, max_model_len),
                backend=backend)
            args = (self.input_ids[:b], self.positions[:b], kv_cache, meta)
            model(*args)  # compiles the kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = model(*args)
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            context_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor | None:
        """The hidden states of n decodes, or None when n exceeds every captured size."""
        n = input_ids.shape[0]
        b = padded_size(self.sizes, n)
        if b is None or block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:b].fill_(-1)
        self.context_lens[:n].copy_(context_lens, non_blocking=True)
        self.context_lens[n:b].fill_(1)
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.block_tables[n:b].zero_()
        self.graphs[b].replay()
        return self.outputs[b][:n]
