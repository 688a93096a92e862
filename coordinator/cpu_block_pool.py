"""The coordinator's second block allocator: ids of blocks in the CPU KV store.

The same structure as the device pool (`BlockPool`): reference counts, so that sequences sharing
device blocks (n > 1 samples, beams) still share their CPU copies after swapping out as a group,
and a hash index with LRU eviction, which is the CPU tier of the prefix cache: a hashed device
block about to be evicted is saved here under its hash, and a free CPU block keeps its hash until
an allocation (a swap-out or another save) evicts it, least recently used first.

Step-deferred releases: workers run a step's transfers in the order swap-outs (writes into CPU
blocks) then swap-ins (reads from CPU blocks). A CPU block read in a step must therefore not be
handed to a writer in the same step, or the write would land before the read. So a block read by
a step (a swapped group coming back, a prefix-tier hit) or written by it (a tier save, until its
data is there) holds a reference until the step has executed (`end_step`).

A block whose data failed its checksum when read back leaves the tier (`KVCacheManager.drop_corrupt`).
"""

from __future__ import annotations

import copy

from coordinator.block_pool import BlockPool


class CpuBlockPool(BlockPool):
    def __init__(self, num_blocks: int):
        super().__init__(num_blocks, sample_latency=False)  # the figure is the device pool's
        self._held_for_step: list[int] = []

    def hold_for_step(self, block: int) -> None:
        """Keep `block` out of the free queue until the running step has executed."""
        self.incref(block)
        self._held_for_step.append(block)

    def release_after_step(self, block: int) -> None:
        """Hand over an existing reference, dropped once the running step has executed."""
        self._held_for_step.append(block)

    def end_step(self) -> None:
        held, self._held_for_step = self._held_for_step, []
        for block in held:
            self.decref(block)

    def view(self) -> "CpuBlockPool":
        """Another handle on the same blocks (ref counts, free queue, hash index: shared, never
        replaced) with step holds of its own: each engine sharing a store holds and releases
        what its own steps touch. Callers serialize their use with the store's lock."""
        other = copy.copy(self)
        other._held_for_step = []
        return other
