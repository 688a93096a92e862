"""A rank's side of the store that prefill and decode replicas share (StoreLayout.shard_by
"kv_head"): a block's shards are its KV heads, not its tensor-parallel ranks, so a block written
by a group of one tensor-parallel size reads back into a group of any other (the store holds
whole blocks; each side shards them its own way).

Shard h of a block is KV head h's slab `[num_layers, 2, block_size, head_dim]` (contiguous in the
store; strided in a rank's cache, whose block is `[.., kv_heads_local, head_dim]`). A rank writes
the heads it holds, except a head replicated on several ranks (tensor_parallel_size >
num_kv_heads), which only its first rank writes; every rank reads the heads it holds. Each shard
carries its checksum and valid flag as in the per-rank store, and a block is whole once every head
is valid.

Ranks on the store's node (`layout.shm_node`, or a store with transport "shm") copy straight
between their cache and the mapped segment; ranks elsewhere stream shards through the store's
gRPC service, staged on the host.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore.store import StoreLayout, attach, check_device_blocks, checksums, shard_checksum


class HeadShardedSwapSpace:
    """A `kvstore.swap_space.SwapSpace` onto a store sharded by KV head. `heads`: (first KV head,
    count) this rank holds; `writes_heads`: whether it writes them (the first rank of each)."""

    def __init__(self, layout: StoreLayout, kv_cache: torch.Tensor, heads: tuple[int, int], writes_heads: bool,
                 local: bool):
        first, count = heads
        if kv_cache.shape[4] != count:
            raise ValueError(f"the cache holds {kv_cache.shape[4]} KV heads; the rank was said to hold {count}")
        self._cache = kv_cache
        self._head_view_shape = (kv_cache.shape[1], 2, kv_cache.shape[3], kv_cache.shape[5])
        shard_bytes = int(np.prod(self._head_view_shape)) * kv_cache.element_size()
        layout.check([], first + count - 1, shard_bytes)  # the heads and the shard size fit the store
        self.layout = layout
        self._heads = list(range(first, first + count))
        self._writes = writes_heads
        self._shm = self._client = None
        if local:
            self._shm, self._valid, data = attach(layout)
            self._crc = checksums(self._shm, layout)
            self._data = data
        else:
            from kvstore.grpc_transport import GrpcSwapSpace

            self._client = GrpcSwapSpace(layout, 0, None)

    def _slab(self, cpu_block: int, head: int) -> torch.Tensor:
        """Shard (cpu_block, head) of the mapped segment, shaped as a head's slab."""
        return torch.from_numpy(self._data[cpu_block, head]).view(self._cache.dtype).view(self._head_view_shape)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, cpu block) pairs: write this rank's heads of each block."""
        if not pairs or not self._writes:
            return
        check_device_blocks([d for d, _ in pairs], self._cache.shape[0])
        cpu = [c for _, c in pairs]
        for j, head in enumerate(self._heads):
            self.layout.check(cpu, head)
            if self._shm is None:
                staged = self._cache[[d for d, _ in pairs], :, :, :, j, :].contiguous().cpu()
                rows = staged.view(torch.uint8).view(len(pairs), -1).numpy()
                self._client.put_shards(head, zip(cpu, rows))
                continue
            self._valid[cpu, head] = 0  # torn while being written
            for d, c in pairs:
                self._slab(c, head).copy_(self._cache[d, :, :, :, j, :])
                self._crc[c, head] = shard_checksum(self._data[c, head])
            self._valid[cpu, head] = 1

    def swap_in(self, pairs: list[tuple[int, int]], release: bool = True) -> list[int]:
        """(cpu block, device block) pairs: read this rank's heads of each block. The shared store's
        blocks stay valid whatever `release` says: its owner (the coordinator's allocator) frees
        them. Returns the cpu blocks with a head that fails its checksum."""
        if not pairs:
            return []
        check_device_blocks([d for _, d in pairs], self._cache.shape[0])
        cpu = [c for c, _ in pairs]
        corrupt: set[int] = set()
        for j, head in enumerate(self._heads):
            self.layout.check(cpu, head)
            if self._shm is None:
                rows = {c: np.empty(self.layout.block_bytes, np.uint8) for c in cpu}
                corrupt.update(self._client.get_shards(head, cpu, rows, release=False))
                for c, d in pairs:
                    slab = torch.from_numpy(rows[c]).view(self._cache.dtype).view(self._head_view_shape)
                    self._cache[d, :, :, :, j, :].copy_(slab)
                continue
            if not self._valid[cpu, head].all():
                raise RuntimeError("a load of a shared-store block whose head was never written")
            for c, d in pairs:
                if shard_checksum(self._data[c, head]) != self._crc[c, head]:
                    corrupt.add(c)
                self._cache[d, :, :, :, j, :].copy_(self._slab(c, head))
        return sorted(corrupt)

    def finish(self) -> None:
        """Copies are synchronous here (a GPU's go through host staging or a blocking copy)."""

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._shm is not None:
            self._data = self._valid = self._crc = None
            try:
                self._shm.close()
            except BufferError:
                pass
            self._shm = None
