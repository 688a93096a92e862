"""The physical KV blocks: a free queue, reference counts, and the prefix-cache index.

Block ids are global: every worker stores its shard of block `b` at index `b` of its cache.

Free queue: an `OrderedDict` used as a doubly linked list keyed by block id, so taking the head,
appending at either end, and removing a block from the middle (a prefix-cache hit on a freed
block) are all O(1) and allocate nothing per operation. Blocks without a hash go to the head
when freed (they hold nothing reusable, so they are handed out first); blocks with a hash go to
the tail, so the head is always the least recently freed cached block: allocation evicts in LRU
order.

Allocation latency is sampled, not timed on every call: one allocation in ALLOC_SAMPLE_EVERY
(the first included) is timed into `alloc_latency_samples_ns`, which the engine's per-step stats
drain into its histogram. Two clock reads cost about as much as the allocation itself.
"""

from __future__ import annotations

import time
from collections import OrderedDict

ALLOC_SAMPLE_EVERY = 8


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, sample_latency: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_allocations = 0
        self._sample_every = ALLOC_SAMPLE_EVERY if sample_latency else 0  # 0: never
        # Sampled allocation latencies (ns) since the stats last took them (`take_latency_samples`).
        self.alloc_latency_samples_ns: list[int] = []
        self.num_evictions = 0
        # When a list: every (block, hash) evicted by an allocation, for the CPU prefix tier to
        # save before the block is overwritten.
        self.evicted: list[tuple[int, bytes]] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self) -> int:
        """Take the head of the free queue (evicting its cached hash, if any); ref count 1."""
        self.num_allocations += 1
        if not self._sample_every or self.num_allocations % self._sample_every != 1:
            return self._allocate()
        start = time.perf_counter_ns()
        block = self._allocate()
        self.alloc_latency_samples_ns.append(time.perf_counter_ns() - start)
        return block

    def take_latency_samples(self) -> list[int]:
        samples, self.alloc_latency_samples_ns = self.alloc_latency_samples_ns, []
        return samples

    def _allocate(self) -> int:
        if not self.free_queue:
            raise NoFreeBlocksError("no free KV blocks")
        block, _ = self.free_queue.popitem(last=False)
        old_hash = self.block_hash[block]
        if old_hash is not None:
            if self.cached.get(old_hash) == block:
                del self.cached[old_hash]
            self.block_hash[block] = None
            self.num_evictions += 1
            if self.evicted is not None:
                self.evicted.append((block, old_hash))
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Share a block; a free cached block comes back out of the free queue (prefix hit)."""
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; returns True when the block became free."""
        count = self.ref_counts[block]
        if count <= 0:
            raise RuntimeError(f"double free of KV block {block}")
        self.ref_counts[block] = count - 1
        if count > 1:
            return False
        self.free_queue[block] = None
        if self.block_hash[block] is None:
            self.free_queue.move_to_end(block, last=False)
        return True

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, block: int) -> None:
        """A free cached block was just wanted again: it becomes the most recently used."""
        if self.ref_counts[block] == 0:
            self.free_queue.move_to_end(block)

    def register(self, block: int, block_hash: bytes) -> None:
        """Record a full block's content hash; the first block with a given hash is the one found."""
        if self.block_hash[block] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def forget(self, block: int) -> None:
        """The block's content no longer matches its hash (a write that never completed): drop
        the hash so that no lookup finds it."""
        block_hash = self.block_hash[block]
        if block_hash is not None:
            if self.cached.get(block_hash) == block:
                del self.cached[block_hash]
            self.block_hash[block] = None

    def forget_free(self) -> None:
        """Drop the hash of every free block (the cached prefixes no sequence holds). Blocks in
        use keep theirs."""
        for block in self.free_queue:
            self.forget(block)

    @property
    def num_cached(self) -> int:
        return len(self.cached)
