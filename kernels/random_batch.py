"""A random paged step for the attention backends' tests and benchmarks: sequences whose cached
tokens already sit in randomly placed blocks, and new tokens (a decode's one, or a prefill chunk)
whose K/V are still to be written, in the layout every backend reads (see `reference.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    cache: torch.Tensor  # one layer's [num_blocks, 2, block_size, num_kv_heads, head_dim], a strided view
    query: torch.Tensor  # [new tokens, num_heads, head_dim]
    new_k: torch.Tensor  # [new tokens, num_kv_heads, head_dim]: not yet in the cache
    new_v: torch.Tensor
    keys: list[torch.Tensor]  # each sequence's whole context, [context_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # [sequences, max blocks] int32
    slots: list[int]  # the new tokens' slots (block * block_size + offset)
    block_size: int

    def metadata(self, backend, max_gather_tokens: int = 1 << 30):
        """`backend`'s metadata for this step (its build_metadata, from the step's CPU tensors)."""
        return backend.build_metadata(torch.tensor(self.query_lens), torch.tensor(self.context_lens),
                                      self.block_tables, torch.tensor(self.slots), self.block_size,
                                      max_gather_tokens)


def shuffled_block_tables(gen: torch.Generator, block_size: int, query_lens: list[int], context_lens: list[int],
                          num_blocks: int) -> tuple[torch.Tensor, list[int]]:
    """Block tables over a random permutation of `num_blocks` physical blocks, each sequence
    taking the next blocks its context needs, and the slots (block * block_size + offset) of each
    sequence's last `query_lens[s]` positions: the step's new tokens, in sequence order."""
    order = torch.randperm(num_blocks, generator=gen)
    needed = [-(-c // block_size) for c in context_lens]
    tables = torch.zeros(len(context_lens), max(needed), dtype=torch.int32)
    slots, start = [], 0
    for s, (q, c) in enumerate(zip(query_lens, context_lens)):
        tables[s, :needed[s]] = order[start:start + needed[s]]
        start += needed[s]
        slots += [int(tables[s, pos // block_size]) * block_size + pos % block_size for pos in range(c - q, c)]
    return tables, slots


def random_paged_batch(gen: torch.Generator, block_size: int, query_lens: list[int], cached_lens: list[int],
                       num_heads: int, num_kv_heads: int, head_dim: int) -> PagedBatch:
    """Sequence s holds `cached_lens[s]` tokens in the cache and brings `query_lens[s]` new ones.
    Its blocks are a random permutation's (a few spare blocks among them), and the cache is one
    layer's view of a two-layer block-major cache, strided as the worker passes it."""
    context_lens = [c + q for c, q in zip(cached_lens, query_lens)]
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    block_tables, slots = shuffled_block_tables(gen, block_size, query_lens, context_lens, num_blocks)
    cache = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=gen)[:, 1]
    keys = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for c in context_lens]
    values = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for c in context_lens]
    for s, cached in enumerate(cached_lens):  # the cached part is in place; the new tokens await write_kv
        for pos in range(cached):
            block, offset = int(block_tables[s, pos // block_size]), pos % block_size
            cache[block, 0, offset], cache[block, 1, offset] = keys[s][pos], values[s][pos]
    new_k = torch.cat([k[c:] for k, c in zip(keys, cached_lens)])
    new_v = torch.cat([v[c:] for v, c in zip(values, cached_lens)])
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    return PagedBatch(cache, query, new_k, new_v, keys, values, list(query_lens), context_lens, block_tables,
                      slots, block_size)
