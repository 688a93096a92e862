"""Tensor parallelism, Megatron style: which heads, rows and vocabulary entries a rank holds, and
the two collectives a forward pass needs.

- Query heads split evenly across ranks. KV heads split evenly too, or, when there are more ranks
  than KV heads, each KV head is replicated on `tp / num_kv_heads` neighbouring ranks (every
  query head a rank holds then uses that one KV head).
- QKV and gate/up are column-parallel (a rank holds its rows), O and down are row-parallel (a
  rank holds its columns and the partial sums are all-reduced).
- The embedding and the LM head are vocabulary-parallel: a rank holds ceil(vocab / tp) rows;
  embedding lookups are all-reduced, logits are gathered to rank 0, which samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group. Size 1 is the single-process case: every
    collective is a no-op and every shard is the whole tensor."""

    rank: int = 0
    size: int = 1

    def heads(self, num_heads: int) -> tuple[int, int]:
        """(first query head, count) this rank holds."""
        per_rank = num_heads // self.size
        return self.rank * per_rank, per_rank

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, count) this rank holds; one replicated head when tp > num_kv_heads."""
        if self.size <= num_kv_heads:
            per_rank = num_kv_heads // self.size
            return self.rank * per_rank, per_rank
        return self.rank // (self.size // num_kv_heads), 1

    def rows(self, total: int) -> tuple[int, int]:
        """(first row, count) of an evenly split dimension (intermediate size)."""
        per_rank = total // self.size
        return self.rank * per_rank, per_rank

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first row, padded count): the last rank's shard is padded with zero rows."""
        per_rank = -(-vocab_size // self.size)
        return self.rank * per_rank, per_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `x` along the last dimension on rank 0; None elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None
