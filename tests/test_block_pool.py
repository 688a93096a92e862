"""BlockPool: the free queue's exact order, reference counts, the prefix-cache index, eviction."""

from __future__ import annotations

import pytest

from coordinator.block_pool import ALLOC_SAMPLE_EVERY, BlockPool, NoFreeBlocksError

H1, H2, H3 = b"hash-one", b"hash-two", b"hash-three"


def _snapshot(pool: BlockPool):
    return (list(pool.free_queue), list(pool.ref_counts), list(pool.block_hash), dict(pool.cached),
            pool.num_evictions)


def _allocate_all(pool: BlockPool) -> list[int]:
    return [pool.allocate() for _ in range(pool.num_blocks)]


# ---- construction ----------------------------------------------------------------------------

def test_pool_rejects_zero_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_fresh_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(5)
    assert list(pool.free_queue) == [0, 1, 2, 3, 4]
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert list(pool.free_queue) == [3, 4]
    assert (pool.num_free, pool.num_used) == (2, 3)


def test_allocated_block_has_ref_count_one_and_no_hash():
    pool = BlockPool(3)
    b = pool.allocate()
    assert pool.ref_counts == [1, 0, 0]
    assert pool.block_hash[b] is None


# ---- free queue order ------------------------------------------------------------------------

def test_freed_unhashed_block_goes_to_head_and_is_reused_first():
    pool = BlockPool(6)
    for _ in range(4):
        pool.allocate()  # 0..3 used, queue [4, 5]
    assert pool.decref(1) is True
    assert list(pool.free_queue) == [1, 4, 5]
    assert pool.decref(3) is True
    assert list(pool.free_queue) == [3, 1, 4, 5]
    # Last freed, first reused (it holds nothing worth keeping).
    assert [pool.allocate(), pool.allocate(), pool.allocate()] == [3, 1, 4]
    assert list(pool.free_queue) == [5]


def test_freed_hashed_blocks_go_to_tail_in_free_order():
    pool = BlockPool(4)
    _allocate_all(pool)
    pool.register(2, H1)
    pool.register(0, H2)
    pool.decref(2)
    pool.decref(0)
    assert list(pool.free_queue) == [2, 0]
    pool.register(3, H3)
    pool.decref(3)
    assert list(pool.free_queue) == [2, 0, 3]


def test_free_queue_order_with_mixed_hashed_and_unhashed_frees():
    pool = BlockPool(6)
    _allocate_all(pool)
    pool.register(1, H1)
    pool.register(3, H3)
    pool.decref(1)  # hashed   -> tail
    pool.decref(0)  # unhashed -> head
    pool.decref(3)  # hashed   -> tail
    pool.decref(2)  # unhashed -> head
    assert list(pool.free_queue) == [2, 0, 1, 3]
    # Unhashed blocks first, then cached blocks least recently freed first.
    assert [pool.allocate() for _ in range(4)] == [2, 0, 1, 3]


def test_allocate_evicts_cached_blocks_in_lru_order():
    pool = BlockPool(3)
    _allocate_all(pool)
    for b, h in ((0, H1), (1, H2), (2, H3)):
        pool.register(b, h)
    for b in (1, 2, 0):  # free order: 1 is least recently freed
        pool.decref(b)
    assert pool.allocate() == 1
    assert pool.lookup(H2) is None
    assert pool.lookup(H3) == 2 and pool.lookup(H1) == 0
    assert pool.num_evictions == 1
    assert pool.allocate() == 2
    assert pool.lookup(H3) is None and pool.lookup(H1) == 0
    assert pool.num_evictions == 2


def test_allocate_of_reused_cached_block_clears_its_hash():
    pool = BlockPool(1)
    b = pool.allocate()
    pool.register(b, H1)
    pool.decref(b)
    assert pool.lookup(H1) == b and pool.num_cached == 1
    assert pool.allocate() == b
    assert pool.block_hash[b] is None
    assert pool.lookup(H1) is None
    assert pool.num_cached == 0
    assert pool.num_evictions == 1
    # The block can be registered again under new content.
    pool.register(b, H2)
    assert pool.lookup(H2) == b and pool.block_hash[b] == H2


def test_allocate_of_unhashed_block_is_not_an_eviction():
    pool = BlockPool(2)
    pool.decref(pool.allocate())
    pool.allocate()
    assert pool.num_evictions == 0


# ---- reference counts --------------------------------------------------------------------------

def test_shared_block_is_freed_only_when_last_reference_drops():
    pool = BlockPool(3)
    b = pool.allocate()
    pool.incref(b)
    pool.incref(b)
    assert pool.ref_counts[b] == 3
    assert pool.decref(b) is False
    assert pool.decref(b) is False
    assert b not in pool.free_queue
    assert pool.num_used == 1
    assert pool.decref(b) is True
    assert pool.ref_counts[b] == 0
    assert list(pool.free_queue) == [b, 1, 2]


def test_incref_of_used_block_does_not_touch_free_queue():
    pool = BlockPool(3)
    b = pool.allocate()
    before = list(pool.free_queue)
    pool.incref(b)
    assert list(pool.free_queue) == before
    assert pool.num_free == 2


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    b = pool.allocate()
    pool.decref(b)
    before = _snapshot(pool)
    with pytest.raises(RuntimeError, match="double free"):
        pool.decref(b)
    assert _snapshot(pool) == before
    assert pool.ref_counts[b] == 0


def test_decref_of_never_allocated_block_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="double free of KV block 1"):
        pool.decref(1)


# ---- prefix-cache hits on free blocks ---------------------------------------------------------

def test_incref_of_free_cached_block_takes_it_out_of_free_queue():
    pool = BlockPool(4)
    _allocate_all(pool)
    pool.register(1, H1)
    pool.register(2, H2)
    pool.decref(1)
    pool.decref(2)
    pool.decref(3)  # unhashed: head
    assert list(pool.free_queue) == [3, 1, 2]
    hit = pool.lookup(H1)
    assert hit == 1
    pool.incref(hit)  # a prefix hit revives the block
    assert list(pool.free_queue) == [3, 2]
    assert pool.ref_counts[1] == 1
    assert pool.block_hash[1] == H1 and pool.lookup(H1) == 1
    assert (pool.num_free, pool.num_used) == (2, 2)
    # Allocation can no longer hand it out: 3, then 2 (evicting H2), then nothing.
    assert pool.allocate() == 3
    assert pool.allocate() == 2
    assert pool.lookup(H2) is None
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    assert pool.lookup(H1) == 1


def test_revived_cached_block_freed_again_becomes_most_recently_used():
    pool = BlockPool(3)
    _allocate_all(pool)
    for b, h in ((0, H1), (1, H2), (2, H3)):
        pool.register(b, h)
        pool.decref(b)
    assert list(pool.free_queue) == [0, 1, 2]
    pool.incref(0)
    pool.decref(0)
    assert list(pool.free_queue) == [1, 2, 0]
    assert pool.allocate() == 1  # 0 was touched later, so 1 is evicted first
    assert pool.lookup(H1) == 0


# ---- registration ----------------------------------------------------------------------------

def test_register_first_block_with_a_hash_wins():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, H1)
    pool.register(b, H1)
    assert pool.lookup(H1) == a
    assert pool.block_hash[b] is None
    assert pool.num_cached == 1
    # The duplicate holds nothing findable, so when freed it goes to the head.
    pool.decref(a)
    pool.decref(b)
    assert list(pool.free_queue) == [b, 2, a]


def test_register_of_already_hashed_block_is_ignored():
    pool = BlockPool(2)
    a = pool.allocate()
    pool.register(a, H1)
    pool.register(a, H2)
    assert pool.block_hash[a] == H1
    assert pool.lookup(H2) is None
    assert pool.cached == {H1: a}


def test_lookup_of_unknown_hash_is_none():
    assert BlockPool(2).lookup(H1) is None


# ---- exhaustion --------------------------------------------------------------------------------

def test_allocate_from_empty_pool_raises_no_free_blocks_and_changes_nothing():
    pool = BlockPool(2)
    _allocate_all(pool)
    before = _snapshot(pool)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    assert _snapshot(pool) == before
    assert (pool.num_free, pool.num_used) == (0, 2)


def test_every_block_allocated_exactly_once_before_exhaustion():
    pool = BlockPool(7)
    assert sorted(_allocate_all(pool)) == list(range(7))
    assert pool.ref_counts == [1] * 7
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_allocation_latency_is_sampled_first_then_every_nth_allocation():
    assert ALLOC_SAMPLE_EVERY > 1
    pool = BlockPool(3 * ALLOC_SAMPLE_EVERY + 1)
    pool.allocate()  # the first allocation is sampled
    assert len(pool.alloc_latency_samples_ns) == 1
    for n in range(2, 3 * ALLOC_SAMPLE_EVERY + 2):
        pool.allocate()
        # Allocations 1, 1 + N, 1 + 2N, ... are timed; none in between.
        assert len(pool.alloc_latency_samples_ns) == 1 + (n - 1) // ALLOC_SAMPLE_EVERY, n
    assert len(pool.alloc_latency_samples_ns) == 4
    assert all(isinstance(ns, int) and ns >= 0 for ns in pool.alloc_latency_samples_ns)


def test_take_latency_samples_returns_and_empties_the_samples():
    pool = BlockPool(ALLOC_SAMPLE_EVERY + 2)
    for _ in range(ALLOC_SAMPLE_EVERY + 1):  # allocations 1 and 1 + N are sampled
        pool.allocate()
    samples = pool.take_latency_samples()
    assert len(samples) == 2 and all(ns >= 0 for ns in samples)
    assert pool.alloc_latency_samples_ns == [] and pool.take_latency_samples() == []
    assert samples is not pool.alloc_latency_samples_ns
    pool.allocate()  # allocation 2 + N: not sampled; the count goes on across takes
    assert pool.take_latency_samples() == []


def test_the_cpu_pool_keeps_no_latency_samples_nobody_drains():
    from coordinator.cpu_block_pool import CpuBlockPool

    pool = CpuBlockPool(4)
    for _ in range(3):
        pool.allocate()
    assert pool.alloc_latency_samples_ns == []
