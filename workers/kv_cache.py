"""The worker's KV cache: one block-major tensor, so a block is one contiguous slab and a swap,
a copy-on-write copy or a KV-store transfer of a block is one memcpy.

Shape: [num_blocks, num_layers, 2 (K, V), block_size, kv_heads_local, head_dim].
"""

from __future__ import annotations

import math
import mmap
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
        shape = (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        if torch.device(device).type == "cpu":
            # The pool's pages are taken only as blocks are first written: a pool larger than the
            # node's memory would otherwise start and then be killed mid-serving, not refused here.
            nbytes, available = num_blocks * self.block_bytes, available_memory()
            if available is not None and nbytes > available:
                raise ValueError(f"kv_cache_memory: a KV pool of {num_blocks} blocks ({nbytes} bytes) does not fit "
                                 f"in this node's available memory ({available} bytes); lower kv_cache_memory")
            return zeroed_on_first_touch(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=device)


def available_memory() -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), in bytes, or
    None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def zeroed_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on fresh anonymous pages, which the kernel hands out zero-filled when
    each is first touched: the pool costs nothing until its blocks are written. torch.zeros wrote
    the whole pool at start (0.6-1.6 s of a cold start for the default 1 GiB, on 2 cores), and
    held its memory whether the blocks were ever used or not."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds the mapping (a buffer export): it is unmapped when the tensor is freed.
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def copy_blocks(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst (copy-on-write), all pairs in one indexed copy."""
    if pairs:
        src = torch.tensor([s for s, _ in pairs], device=kv_cache.device)
        dst = torch.tensor([d for _, d in pairs], device=kv_cache.device)
        kv_cache[dst] = kv_cache[src]
