"""The worker's KV cache: one block-major tensor, so a block is one contiguous slab and a swap,
a copy-on-write copy or a KV-store transfer of a block is one memcpy.

Shape: [num_blocks, num_layers, 2 (K, V), block_size, kv_heads_local, head_dim].
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kvstore.store import check_device_blocks


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


class SwapSpace:
    """This rank's view of the CPU KV store's shared-memory pool: swaps are indexed copies
    straight between the device cache and the segment, one slab per block."""

    def __init__(self, layout, rank: int, kv_cache: torch.Tensor):
        from kvstore.store import attach

        self._kv_bytes = kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)
        layout.check([], rank, self._kv_bytes.shape[1])  # before mapping anything
        self.layout, self.rank = layout, rank
        self._shm, self.valid, data = attach(layout)
        self._data = torch.from_numpy(data[:, rank])  # [num_cpu_blocks, block_bytes], strided
        self._gpu = None
        if kv_cache.is_cuda:  # page-locked segment, copies on a side stream (workers/cuda_transfer.py)
            from workers.cuda_transfer import PinnedTransfers

            self._gpu = PinnedTransfers(data)

    def _copies(self):
        """Where the block copies run: a side CUDA stream on a GPU, inline on a CPU."""
        return self._gpu if self._gpu is not None else contextlib.nullcontext()

    def finish(self) -> None:
        """Wait until this step's copies are done (a GPU's are asynchronous)."""
        if self._gpu is not None:
            self._gpu.finish()

    def _ids(self, pairs, device_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        device = [p[0] if device_first else p[1] for p in pairs]
        cpu = [p[1] if device_first else p[0] for p in pairs]
        self.layout.check(cpu, self.rank)
        check_device_blocks(device, self._kv_bytes.shape[0])
        return torch.tensor(device), torch.tensor(cpu)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, cpu block) pairs: write this rank's shards, then mark them valid."""
        if pairs:
            device, cpu = self._ids(pairs, device_first=True)
            # One contiguous slab per block: copy_ runs at memcpy speed, where an indexed
            # gather/scatter of bytes would crawl.
            with self._copies():
                for d, c in zip(device.tolist(), cpu.tolist()):
                    self._data[c].copy_(self._kv_bytes[d], non_blocking=True)
            self.valid[cpu.numpy(), self.rank] = 1  # the step's finish() precedes any reader

    def swap_in(self, pairs: list[tuple[int, int]], release: bool = True) -> None:
        """(cpu block, device block) pairs: read this rank's shards back, and release them unless
        they stay cached (`release=False`, the CPU prefix tier)."""
        if pairs:
            device, cpu = self._ids(pairs, device_first=False)
            if not self.valid[cpu.numpy(), self.rank].all():
                raise RuntimeError("swap-in of a CPU block this rank never wrote")
            with self._copies():
                for d, c in zip(device.tolist(), cpu.tolist()):
                    self._kv_bytes[d].copy_(self._data[c], non_blocking=True)
            if release:
                self.valid[cpu.numpy(), self.rank] = 0

    def close(self) -> None:
        """Unmap the segment (the store owns and unlinks it)."""
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        self._data = self._kv_bytes = self.valid = None
        try:
            self._shm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass
