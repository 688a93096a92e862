"""The coordinator's second block allocator: ids of blocks in the CPU KV store.

Reference counted like the device pool, so that sequences sharing device blocks (n > 1 samples,
beams) still share their CPU copies after swapping out as a group.
"""

from __future__ import annotations

from collections import deque


class CpuBlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        block = self._free.popleft()
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"cpu block {block} freed twice")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)
