"""Torch paged attention: vectorized over sequences and blocks (no Python loop per sequence).

Contract shared by every backend:
- The KV cache of one layer is a view `kv_cache` of shape
  `[num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]` (a strided view into the
  block-major cache: each block's K and V of one layer are one contiguous run).
- A step carries `T` new tokens from `S` sequences, flattened in sequence order. Sequence `s`
  brings `query_lens[s]` new tokens (a prefill chunk, or 1 for a decode) whose K/V are written
  at `slot_mapping` (slot = block_id * block_size + offset) before attention runs, so that
  after the write its whole context of `context_lens[s]` tokens lies in the blocks of
  `block_tables[s]`. Query `i` of sequence `s` sits at position
  `context_lens[s] - query_lens[s] + i` and attends causally to every key at or before it.

Metadata (gather indices, masks) is built once per step and reused by every layer: building it
costs as much as several layers' attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class _Group:
    """Sequences attended together, their queries padded to one length."""

    token_index: torch.Tensor  # [G, Qmax] index into the flat token dim (padding -> a real token)
    token_valid: torch.Tensor  # [G * Qmax] bool: which padded rows are real queries
    out_index: torch.Tensor  # [n_real] flat token index of each real padded row, in row order
    block_tables: torch.Tensor  # [G, max_blocks]
    mask: torch.Tensor  # [G, 1, Qmax, max_blocks * block_size] bool: key visible to query


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    block_size: int
    slot_blocks: torch.Tensor  # [T] block id of each new token's slot
    slot_offsets: torch.Tensor  # [T] offset inside that block
    groups: list[_Group]
    # Optional reusable buffer (any shape, the cache's dtype) for the gathered context blocks:
    # a fresh tensor of tens of MiB per layer costs more in page faults than the copy itself
    # (measured: 12.7 ms vs 1.5 ms for a 34 MiB gather).
    workspace: torch.Tensor | None = None

    @property
    def max_gathered_blocks(self) -> int:
        return max((g.block_tables.numel() for g in self.groups), default=0)


def _build_group(seq_idx, query_start, query_lens, context_lens, block_tables, block_size):
    q_lens = query_lens[seq_idx]
    ctx_lens = context_lens[seq_idx]
    q_max = int(q_lens.max())
    num_blocks = int((ctx_lens.max() + block_size - 1) // block_size)
    rows = torch.arange(q_max, device=q_lens.device)
    valid = rows[None, :] < q_lens[:, None]  # [G, Qmax]
    # Padding rows re-read the sequence's first token; their output is dropped.
    token_index = query_start[seq_idx][:, None] + torch.where(valid, rows[None, :], 0)
    q_pos = (ctx_lens - q_lens)[:, None] + rows[None, :]  # [G, Qmax]
    k_pos = torch.arange(num_blocks * block_size, device=q_lens.device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx_lens[:, None, None])
    flat_valid = valid.reshape(-1)
    return _Group(
        token_index=token_index,
        token_valid=flat_valid,
        out_index=token_index.reshape(-1)[flat_valid],
        block_tables=block_tables[seq_idx, :num_blocks].long(),
        mask=mask[:, None],
    )


def _group_sequences(query_lens: list[int], context_lens: list[int], max_gather_tokens: int) -> list[list[int]]:
    """Split the step's sequences into attention groups.

    Decodes and prefill chunks apart (one long chunk must not pad hundreds of decodes to its
    length); within each kind, sorted by context length and cut so that a group's padded
    context (sequences x longest) stays under `max_gather_tokens`. Sorting keeps the padding
    small; the cut keeps each group's gathered K/V small enough to still sit in the CPU cache
    when attention reads it back (measured on SmolLM2 decode: see the worker's budget).
    """
    groups = []
    for decode in (True, False):
        order = sorted((i for i, q in enumerate(query_lens) if (q == 1) == decode), key=context_lens.__getitem__)
        current: list[int] = []
        for i in order:
            # Sorted ascending, so this sequence is the group's longest.
            if current and context_lens[i] * (len(current) + 1) > max_gather_tokens:
                groups.append(current)
                current = []
            current.append(i)
        if current:
            groups.append(current)
    return groups


def build_attention_metadata(
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    max_gather_tokens: int = 1 << 30,
) -> AttentionMetadata:
    """Precompute what every layer's `write_kv` and `paged_attention` need for one step."""
    query_lens = query_lens.long()
    context_lens = context_lens.long()
    query_start = torch.zeros_like(query_lens)
    query_start[1:] = torch.cumsum(query_lens, 0)[:-1]
    groups = [
        _build_group(torch.tensor(idx), query_start, query_lens, context_lens, block_tables, block_size)
        for idx in _group_sequences(query_lens.tolist(), context_lens.tolist(), max_gather_tokens)
    ]
    slot_mapping = slot_mapping.long()
    return AttentionMetadata(
        num_tokens=int(query_lens.sum()),
        block_size=block_size,
        slot_blocks=torch.div(slot_mapping, block_size, rounding_mode="floor"),
        slot_offsets=slot_mapping % block_size,
        groups=groups,
    )


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the new tokens' K/V (`[T, kv_heads, head_dim]`) at their slots."""
    kv_cache[meta.slot_blocks, 0, meta.slot_offsets] = key
    kv_cache[meta.slot_blocks, 1, meta.slot_offsets] = value


def _gather_blocks(kv_cache: torch.Tensor, block_tables: torch.Tensor,
                   workspace: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the listed blocks, `[G, kv_heads, L, head_dim]` each (transposed views of
    contiguous `[G, L, kv_heads, head_dim]` buffers). One `index_select` each over rows of
    contiguous block slabs goes at memcpy speed into a reused buffer; gathering K and V together
    and splitting them afterwards costs a second copy (measured: 17% of a decode step)."""
    n_seq, n_blocks = block_tables.shape
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    index = block_tables.reshape(-1)
    row = block_size * kv_heads * head_dim
    need = index.numel() * row
    halves = [None, None]
    if workspace is not None and workspace.numel() >= 2 * need:
        flat_ws = workspace.view(-1)
        halves = [flat_ws[:need].view(-1, row), flat_ws[need:2 * need].view(-1, row)]
    k, v = (torch.index_select(kv_cache[:, i].flatten(1), 0, index, out=halves[i])
            .view(n_seq, n_blocks * block_size, kv_heads, head_dim).transpose(1, 2) for i in (0, 1))
    return k, v


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Causal attention of `query` (`[T, heads, head_dim]`) over each sequence's paged context.

    GQA is folded into the query length: the `heads // kv_heads` query heads that share a KV
    head become extra query rows of that KV head (each with its token's mask row), so every
    KV head's context is read once per layer instead of once per query head.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    rep = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for g in meta.groups:  # at most two: decodes, prefill chunks
        n_seq, q_max = g.token_index.shape
        # [G, Qmax, KVH, rep, D] -> [G, KVH, rep * Qmax, D]
        q = query[g.token_index].view(n_seq, q_max, num_kv_heads, rep, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(n_seq, num_kv_heads, rep * q_max, head_dim)
        mask = g.mask if rep == 1 or q_max == 1 else g.mask.repeat(1, 1, rep, 1)
        k, v = _gather_blocks(kv_cache, g.block_tables, meta.workspace)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        # [G, KVH, rep, Qmax, D] -> [G * Qmax, H, D]
        o = o.view(n_seq, num_kv_heads, rep, q_max, head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(n_seq * q_max, num_heads, head_dim)
        out[g.out_index] = o[g.token_valid]
    return out
