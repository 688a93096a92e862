"""The KV store over shared memory, for a worker on the store's node: the rank maps the store's
segment and swaps are copies straight between its device cache and the segment, one slab per
block; no byte passes through the store's process.

Each shard carries a checksum (kvstore/store.py): written once the shard's data is in the segment,
checked by the rank that reads the shard back. On a GPU the segment is page-locked and the copies
run on a side stream (kvstore/cuda_transfer.py), so they are asynchronous until `finish()`, which
is also when a swap-out's checksums can be taken.
"""

from __future__ import annotations

import contextlib

import torch

from kvstore.store import StoreLayout, attach, check_device_blocks, checksums, shard_checksum


class ShmSwapSpace:
    """This rank's view of the store's segment: its shards data[:, rank], their checksums and
    their valid flags."""

    def __init__(self, layout: StoreLayout, rank: int, kv_cache: torch.Tensor):
        self._kv_bytes = kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)
        layout.check([], rank, self._kv_bytes.shape[1])  # before mapping anything
        self.layout, self.rank = layout, rank
        self._shm, self.valid, data = attach(layout)
        self._crc = checksums(self._shm, layout)
        self._shards = data[:, rank]  # [num_cpu_blocks, block_bytes], strided; each row contiguous
        self._data = torch.from_numpy(self._shards)
        self._unsealed: list[int] = []  # swapped out on a GPU, checksummed once the copies land
        self._gpu = None
        if kv_cache.is_cuda:
            from kvstore.cuda_transfer import PinnedTransfers

            self._gpu = PinnedTransfers(data)

    def _copies(self):
        """Where the block copies run: a side CUDA stream on a GPU, inline on a CPU."""
        return self._gpu if self._gpu is not None else contextlib.nullcontext()

    def finish(self) -> None:
        """Wait until this step's copies are done (a GPU's are asynchronous), then checksum the
        shards they wrote."""
        if self._gpu is not None:
            self._gpu.finish()
            self._seal(self._unsealed)
            self._unsealed = []

    def _seal(self, cpu_blocks) -> None:
        for c in cpu_blocks:
            self._crc[c, self.rank] = shard_checksum(self._shards[c])

    def _corrupt(self, cpu_blocks) -> list[int]:
        return [c for c in cpu_blocks if shard_checksum(self._shards[c]) != self._crc[c, self.rank]]

    def _ids(self, pairs, device_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        device = [p[0] if device_first else p[1] for p in pairs]
        cpu = [p[1] if device_first else p[0] for p in pairs]
        self.layout.check(cpu, self.rank)
        check_device_blocks(device, self._kv_bytes.shape[0])
        return torch.tensor(device), torch.tensor(cpu)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, cpu block) pairs: write this rank's shards and their checksums, then
        mark them valid."""
        if pairs:
            device, cpu = self._ids(pairs, device_first=True)
            # One contiguous slab per block: copy_ runs at memcpy speed, where an indexed
            # gather/scatter of bytes would crawl.
            with self._copies():
                for d, c in zip(device.tolist(), cpu.tolist()):
                    self._data[c].copy_(self._kv_bytes[d], non_blocking=True)
            if self._gpu is None:
                self._seal(cpu.tolist())
            else:  # the data is still on its way
                self._unsealed += cpu.tolist()
            self.valid[cpu.numpy(), self.rank] = 1  # the step's finish() precedes any reader

    def swap_in(self, pairs: list[tuple[int, int]], release: bool = True) -> list[int]:
        """(cpu block, device block) pairs: read this rank's shards back, and release them unless
        they stay cached (`release=False`, the CPU prefix tier). Returns the cpu blocks whose
        shard fails its checksum (copied all the same: the caller must not use them)."""
        if not pairs:
            return []
        device, cpu = self._ids(pairs, device_first=False)
        if not self.valid[cpu.numpy(), self.rank].all():
            raise RuntimeError("swap-in of a CPU block this rank never wrote")
        with self._copies():
            for d, c in zip(device.tolist(), cpu.tolist()):
                self._kv_bytes[d].copy_(self._data[c], non_blocking=True)
        # The host copy is read meanwhile, not written: no writer reuses a CPU block in the step
        # that reads it (coordinator/cpu_block_pool.py).
        corrupt = self._corrupt(cpu.tolist())
        if release:
            self.valid[cpu.numpy(), self.rank] = 0
        return corrupt

    def close(self) -> None:
        """Unmap the segment (the store owns and unlinks it)."""
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        self._data = self._shards = self._crc = self._kv_bytes = self.valid = None
        try:
            self._shm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass
