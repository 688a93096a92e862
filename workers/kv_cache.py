"""The worker's KV cache: one block-major tensor, so a block is one contiguous slab and a swap,
a copy-on-write copy or a KV-store transfer of a block is one memcpy.

Shape: [num_blocks, num_layers, 2 (K, V), block_size, kv_heads_local, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.block_bytes

    def allocate(self, num_blocks: int, device: str) -> torch.Tensor:
        # Zeroed, so that padding blocks read by batched attention hold finite values.
        return torch.zeros((num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim),
                           dtype=self.dtype, device=device)


def copy_blocks(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst (copy-on-write), all pairs in one indexed copy."""
    if pairs:
        src = torch.tensor([s for s, _ in pairs], device=kv_cache.device)
        dst = torch.tensor([d for _, d in pairs], device=kv_cache.device)
        kv_cache[dst] = kv_cache[src]
