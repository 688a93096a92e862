"""KVCacheManager: lazy growth, fork and copy-on-write, the prefix cache, fragmentation,
all-or-nothing allocation and the watermark; plus a stateful property test of the invariants."""

from __future__ import annotations

import hashlib
import itertools
from array import array

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from coordinator.kv_cache_manager import KVCacheManager, hash_block
from coordinator.sampling_params import SamplingParams
from coordinator.sequence import Sequence

BS = 4
_ids = itertools.count(1000)


def make_seq(tokens, seq_id=None) -> Sequence:
    return Sequence(next(_ids) if seq_id is None else seq_id, "req", list(tokens), SamplingParams())


def compute(kv: KVCacheManager, seq: Sequence, n: int, sampled: int = 99) -> None:
    """The engine's side of a step whose slots are already allocated: write K/V for `n` tokens,
    commit, and sample a token when the sequence caught up."""
    seq.num_computed_tokens += n
    kv.commit_computed(seq)
    if seq.num_computed_tokens == seq.num_tokens:
        seq.token_ids.append(sampled)


def step(kv: KVCacheManager, seq: Sequence, n: int | None = None, computed_blocks=(),
         sampled: int = 99) -> None:
    """allocate_slots + compute; `n` defaults to every token not yet computed."""
    if n is None:
        n = seq.num_tokens - seq.num_computed_tokens - len(computed_blocks) * kv.block_size
    assert kv.allocate_slots(seq, n, computed_blocks)
    compute(kv, seq, n, sampled)


def admit(kv: KVCacheManager, seq: Sequence, sampled: int = 99) -> list[int]:
    """Prefix lookup, then the whole (remaining) prompt in one step; returns the hit blocks."""
    hits = kv.get_computed_blocks(seq)
    step(kv, seq, computed_blocks=hits, sampled=sampled)
    return hits


def manager_state(kv: KVCacheManager, *seqs: Sequence):
    pool = kv.pool
    return (list(pool.free_queue), list(pool.ref_counts), list(pool.block_hash), dict(pool.cached),
            list(kv.pending_copies),
            [(list(s.block_table), s.num_computed_tokens, len(s.block_hashes)) for s in seqs])


# ---- lazy growth -------------------------------------------------------------------------------

def test_block_table_grows_only_when_last_block_is_full():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    seq = make_seq([1, 2, 3])
    step(kv, seq)  # prompt: 3 tokens -> 1 block
    assert seq.block_table == [0]
    assert seq.num_tokens == 4
    step(kv, seq)  # decode position 3: still block 0
    assert seq.block_table == [0]
    assert kv.num_free_blocks == 7
    step(kv, seq)  # decode position 4: block 0 is full
    assert seq.block_table == [0, 1]
    for _ in range(3):  # positions 5, 6, 7
        step(kv, seq)
    assert seq.block_table == [0, 1]
    step(kv, seq)  # position 8
    assert seq.block_table == [0, 1, 2]
    assert kv.pool.num_used == 3


def test_prompt_allocation_covers_exactly_the_tokens_asked_for():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    seq = make_seq(range(9))
    assert kv.allocate_slots(seq, 5)  # a first chunk of 5 tokens
    assert seq.block_table == [0, 1]
    compute(kv, seq, 5)
    assert kv.allocate_slots(seq, 3)  # positions 5..7 fit in block 1
    assert seq.block_table == [0, 1]
    compute(kv, seq, 3)
    assert kv.allocate_slots(seq, 1)  # position 8
    assert seq.block_table == [0, 1, 2]


def test_allocate_zero_tokens_allocates_nothing():
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)
    seq = make_seq([1, 2, 3, 4])
    step(kv, seq)
    before = manager_state(kv, seq)
    assert kv.allocate_slots(seq, 0)
    assert manager_state(kv, seq) == before


# ---- fork and copy-on-write ------------------------------------------------------------------

def _forked_pair(kv: KVCacheManager, prompt_len: int):
    parent = make_seq(range(prompt_len))
    step(kv, parent, sampled=50)
    child = make_seq(range(prompt_len))
    child.token_ids = parent.token_ids[:prompt_len] + [51]  # a different sample
    kv.fork(parent, child)
    return parent, child


def test_fork_shares_every_block_and_increments_ref_counts():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    parent, child = _forked_pair(kv, 6)
    assert parent.block_table == [0, 1]
    assert child.block_table == [0, 1]
    assert child.block_table is not parent.block_table
    assert kv.pool.ref_counts[:3] == [2, 2, 0]
    assert child.num_computed_tokens == 6
    assert kv.pool.num_used == 2
    assert kv.num_filled_slots([parent, child]) == 6  # shared slots count once
    assert kv.drain_copies() == []


def test_append_into_shared_partial_block_copies_it_once():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    parent, child = _forked_pair(kv, 6)  # block 1 holds 2 tokens, shared
    assert kv.allocate_slots(parent, 1)
    assert kv.drain_copies() == [(1, 2)]
    assert parent.block_table == [0, 2]
    assert child.block_table == [0, 1]
    assert kv.pool.ref_counts[:3] == [2, 1, 1]
    # The copy (block 2) carries the two tokens already written, as block 1 still does.
    assert kv.num_filled_slots([parent, child]) == 4 + 2 + 2
    compute(kv, parent, 1)
    assert kv.num_filled_slots([parent, child]) == 4 + 2 + 3
    # Second write by the parent: its block is private now, no copy.
    assert kv.allocate_slots(parent, 1)
    assert kv.drain_copies() == []
    assert parent.block_table == [0, 2]
    compute(kv, parent, 1)
    # The child is now the only holder of block 1: it writes in place.
    assert kv.allocate_slots(child, 1)
    assert kv.drain_copies() == []
    assert child.block_table == [0, 1]
    assert kv.pool.ref_counts[:3] == [2, 1, 1]


def test_child_appending_first_gets_the_copy_and_parent_then_writes_in_place():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    parent, child = _forked_pair(kv, 5)
    assert kv.allocate_slots(child, 1)
    assert kv.drain_copies() == [(1, 2)]
    assert child.block_table == [0, 2]
    assert kv.allocate_slots(parent, 1)
    assert kv.drain_copies() == []
    assert parent.block_table == [0, 1]


def test_drain_copies_empties_the_pending_list():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    parent, _ = _forked_pair(kv, 6)
    kv.allocate_slots(parent, 1)
    assert kv.drain_copies() == [(1, 2)]
    assert kv.drain_copies() == []


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    parent, child = _forked_pair(kv, 8)
    assert kv.allocate_slots(parent, 1)
    assert kv.allocate_slots(child, 1)
    assert kv.drain_copies() == []
    assert parent.block_table == [0, 1, 2]
    assert child.block_table == [0, 1, 3]
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]


def test_copy_on_write_plus_new_block_in_one_allocation():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    parent, _ = _forked_pair(kv, 6)
    parent.token_ids += [60, 61, 62, 63]  # e.g. several tokens accepted at once
    assert kv.allocate_slots(parent, 5)  # positions 6..10: finishes block 1, needs block 2
    assert kv.drain_copies() == [(1, 2)]
    assert parent.block_table == [0, 2, 3]


def test_freeing_forked_child_leaves_parent_blocks_alive():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    parent, child = _forked_pair(kv, 6)
    kv.free(child)
    assert child.block_table == [] and child.num_computed_tokens == 0
    assert kv.pool.ref_counts[:2] == [1, 1]
    assert kv.pool.num_used == 2
    assert kv.num_filled_slots([parent]) == 6
    kv.free(parent)
    assert kv.pool.num_used == 0 and kv.num_filled_slots([]) == 0


# ---- prefix cache ------------------------------------------------------------------------------

def test_hash_block_is_blake2b_over_parent_hash_and_token_bytes():
    tokens = [1, 2, 3, 4]
    expected = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).digest()
    assert hash_block(None, tokens) == expected
    parent = hash_block(None, [9, 9, 9, 9])
    chained = hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()
    assert hash_block(parent, tokens) == chained


def test_same_tokens_under_different_prefix_hash_differently():
    p1, p2 = hash_block(None, [1, 1, 1, 1]), hash_block(None, [2, 2, 2, 2])
    assert hash_block(p1, [5, 6, 7, 8]) != hash_block(p2, [5, 6, 7, 8])
    assert hash_block(p1, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(p1, [5, 6, 7, 8]) == hash_block(hash_block(None, [1, 1, 1, 1]), [5, 6, 7, 8])


def test_same_block_tokens_after_different_prefix_is_not_a_cache_hit():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)
    b = make_seq([0, 0, 0, 0, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b) == []
    assert b.block_hashes[1] != a.block_hashes[1]
    assert a.block_hashes[0] != b.block_hashes[0]


def test_get_computed_blocks_returns_longest_cached_prefix():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make_seq(range(13))
    admit(kv, a)  # 3 full blocks registered: [0, 1, 2]
    assert kv.pool.num_cached == 3
    b = make_seq(list(range(8)) + [70, 71, 72, 73, 74])  # diverges in block 2
    assert kv.get_computed_blocks(b) == [0, 1]
    c = make_seq(list(range(4)) + [70])
    assert kv.get_computed_blocks(c) == [0]
    d = make_seq([5] + list(range(1, 13)))  # differs in the first token
    assert kv.get_computed_blocks(d) == []


def test_get_computed_blocks_always_leaves_last_token_to_compute():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make_seq(range(12))
    admit(kv, a)
    assert kv.pool.num_cached == 3
    # Exactly two blocks' worth: the second block must be recomputed for its last token.
    assert kv.get_computed_blocks(make_seq(range(8))) == [0]
    assert kv.get_computed_blocks(make_seq(range(9))) == [0, 1]
    assert kv.get_computed_blocks(make_seq(range(12))) == [0, 1]
    assert kv.get_computed_blocks(make_seq(range(4))) == []
    assert kv.get_computed_blocks(make_seq([0])) == []


def test_get_computed_blocks_is_empty_without_prefix_caching():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    admit(kv, make_seq(range(13)))
    assert kv.pool.num_cached == 0
    assert kv.get_computed_blocks(make_seq(range(13))) == []


def test_prefix_hit_on_running_sequence_shares_blocks_and_skips_tokens():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make_seq(range(10))
    admit(kv, a)  # blocks [0, 1, 2]; 0 and 1 full and registered
    b = make_seq(list(range(8)) + [40, 41, 42])
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    assert kv.allocate_slots(b, 3, hits)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]
    compute(kv, b, 3)
    assert b.num_computed_tokens == 11
    assert kv.num_filled_slots([a, b]) == 10 + 3  # the shared full blocks count once


def test_freed_cached_blocks_are_reused_by_a_later_request():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make_seq(range(10))
    admit(kv, a)  # [0, 1, 2]; blocks 0 and 1 registered
    kv.free(a)
    # Block 2 (partial, unhashed) at the head; cached 1 then 0 at the tail (tail freed first).
    assert list(kv.pool.free_queue) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert kv.num_filled_slots([]) == 0
    b = make_seq(list(range(8)) + [30, 31])
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    assert kv.allocate_slots(b, 2, hits)
    assert b.block_table == [0, 1, 2]
    assert kv.pool.ref_counts[:3] == [1, 1, 1]
    assert 0 not in kv.pool.free_queue and 1 not in kv.pool.free_queue
    assert kv.num_filled_slots([b]) == 8  # the revived blocks' tokens count again
    compute(kv, b, 2)
    assert kv.num_filled_slots([b]) == 10


def test_freed_cached_blocks_are_evicted_tail_block_first():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = make_seq(range(13))
    admit(kv, a)  # [0, 1, 2, 3]; 0, 1, 2 registered
    kv.free(a)
    assert list(kv.pool.free_queue) == [3, 2, 1, 0]
    filler = make_seq([77])
    step(kv, filler)  # takes block 3 (unhashed)
    assert filler.block_table == [3]
    assert kv.get_computed_blocks(make_seq(range(13))) == [0, 1, 2]
    filler2 = make_seq([78])
    step(kv, filler2)  # evicts block 2, the sequence's last cached block
    assert filler2.block_table == [2]
    assert kv.pool.num_evictions == 1
    assert kv.get_computed_blocks(make_seq(range(13))) == [0, 1]
    filler3 = make_seq([79])
    step(kv, filler3)
    assert filler3.block_table == [1]
    assert kv.get_computed_blocks(make_seq(range(13))) == [0]


def test_fully_computed_blocks_are_registered_in_the_prefix_cache_as_they_fill():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    seq = make_seq(range(3))
    step(kv, seq)  # 3 tokens: nothing full yet
    assert kv.pool.num_cached == 0
    step(kv, seq)  # position 3 fills block 0
    assert kv.pool.cached == {hash_block(None, [0, 1, 2, 99]): 0}
    assert seq.block_hashes == [hash_block(None, [0, 1, 2, 99])]


def test_duplicate_content_block_is_not_registered_twice():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a, b = make_seq(range(5)), make_seq(range(5))
    # Both allocated before either computed, as when admitted in one step: no hit for b.
    assert kv.allocate_slots(a, 5) and kv.allocate_slots(b, 5)
    compute(kv, a, 5)
    compute(kv, b, 5)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    assert kv.pool.cached == {a.block_hashes[0]: 0}
    assert kv.pool.block_hash[2] is None
    kv.free(b)
    assert list(kv.pool.free_queue)[:2] == [2, 3]  # nothing cached in them: reused first


def test_prefix_hit_on_own_blocks_after_free_restores_progress():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make_seq(range(6))
    admit(kv, a)
    for _ in range(3):
        step(kv, a)  # 9 tokens computed, token 10 sampled
    kv.free(a)  # as a recompute preemption does: tokens kept
    assert a.num_computed_tokens == 0 and a.block_table == []
    hits = kv.get_computed_blocks(a)
    assert hits == [0, 1]
    assert kv.allocate_slots(a, a.num_tokens - 8, hits)
    assert a.num_computed_tokens == 8


def test_blocks_recomputed_after_eviction_are_registered_again():
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    a = make_seq(range(9))
    admit(kv, a)  # [0, 1, 2]; 0 and 1 registered
    kv.free(a)  # preempted: tokens kept
    other = make_seq([60] * 9)
    admit(kv, other)  # takes every block, evicting a's cached ones
    assert kv.pool.num_cached == 2 and kv.get_computed_blocks(a) == []
    kv.free(other)
    step(kv, a)  # recompute all 10 tokens (9 + the one sampled before), evicting other's
    assert kv.pool.num_evictions == 4
    assert kv.pool.num_cached == 2
    assert kv.get_computed_blocks(make_seq(range(9))) == a.block_table[:2]


# ---- fragmentation -------------------------------------------------------------------------------

def test_fragmentation_is_empty_slots_over_allocated_slots():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    assert kv.fragmentation([]) == 0.0
    a = make_seq(range(5))
    assert kv.allocate_slots(a, 5)
    assert kv.num_filled_slots([a]) == 0
    assert kv.fragmentation([a]) == 1.0  # allocated, nothing written yet
    compute(kv, a, 5)
    assert kv.num_filled_slots([a]) == 5
    assert kv.fragmentation([a]) == pytest.approx(3 / 8)
    b = make_seq(range(2))
    step(kv, b)
    assert kv.num_filled_slots([a, b]) == 7
    assert kv.fragmentation([a, b]) == pytest.approx(5 / 12)
    kv.free(a)
    assert kv.num_filled_slots([b]) == 2
    assert kv.fragmentation([b]) == pytest.approx(2 / 4)
    kv.free(b)
    assert kv.fragmentation([]) == 0.0 and kv.num_filled_slots([]) == 0


# ---- all or nothing ----------------------------------------------------------------------------

def test_allocate_slots_is_all_or_nothing_when_pool_is_short():
    kv = KVCacheManager(3, BS, enable_prefix_caching=False)
    a = make_seq(range(8))
    step(kv, a)
    b = make_seq(range(9))  # needs 3 blocks, 1 free
    before = manager_state(kv, a, b)
    assert kv.allocate_slots(b, 9) is False
    assert manager_state(kv, a, b) == before
    assert b.block_table == [] and kv.num_free_blocks == 1
    assert kv.allocate_slots(b, 4) is True  # a smaller chunk fits
    assert b.block_table == [2]


def test_failed_allocation_with_prefix_hits_revives_nothing():
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    a = make_seq(range(9))
    admit(kv, a)  # [0, 1, 2]; 0 and 1 cached
    kv.free(a)
    b = make_seq(list(range(8)) + [50, 51, 52, 53, 54])  # 2 hits + 5 tokens = 2 more blocks
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    before = manager_state(kv, b)
    assert kv.allocate_slots(b, 5, hits) is False  # 3 free, 2 of them are the hits
    assert manager_state(kv, b) == before
    assert b.num_computed_tokens == 0
    assert kv.pool.ref_counts == [0, 0, 0]
    assert kv.allocate_slots(b, 4, hits) is True  # one new block suffices
    assert b.block_table == [0, 1, 2]


def test_failed_copy_on_write_changes_nothing():
    kv = KVCacheManager(2, BS, enable_prefix_caching=False)
    parent, child = _forked_pair(kv, 6)  # both blocks used, shared
    before = manager_state(kv, parent, child)
    assert kv.allocate_slots(parent, 1) is False
    assert manager_state(kv, parent, child) == before
    assert kv.drain_copies() == []


def test_allocation_succeeds_when_exactly_enough_blocks_are_free():
    kv = KVCacheManager(3, BS, enable_prefix_caching=False)
    seq = make_seq(range(12))
    assert kv.allocate_slots(seq, 12)
    assert kv.num_free_blocks == 0


# ---- watermark -----------------------------------------------------------------------------------

def test_watermark_blocks_are_kept_free_only_when_asked():
    kv = KVCacheManager(10, BS, enable_prefix_caching=False, watermark=0.2)
    assert kv.watermark_blocks == 2
    a = make_seq(range(32))  # 8 blocks: leaves exactly the watermark
    assert kv.allocate_slots(a, 32, keep_watermark=True)
    assert kv.num_free_blocks == 2
    b = make_seq(range(4))
    assert kv.allocate_slots(b, 4, keep_watermark=True) is False
    assert b.block_table == [] and kv.num_free_blocks == 2
    assert kv.allocate_slots(b, 4, keep_watermark=False)
    assert kv.num_free_blocks == 1


def test_watermark_refuses_allocation_that_would_dip_below_it():
    kv = KVCacheManager(10, BS, enable_prefix_caching=False, watermark=0.2)
    assert kv.allocate_slots(make_seq(range(36)), 36, keep_watermark=True) is False
    assert kv.num_free_blocks == 10
    assert kv.allocate_slots(make_seq(range(36)), 36, keep_watermark=False)


def test_default_watermark_is_one_percent_of_blocks_rounded_down():
    assert KVCacheManager(99, BS, enable_prefix_caching=False).watermark_blocks == 0
    assert KVCacheManager(1000, BS, enable_prefix_caching=False).watermark_blocks == 10


# ---- stateful property test ------------------------------------------------------------------------

class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions (with prefix lookup), chunked steps, forks, frees and recompute
    preemptions on a small pool, with tokens from a tiny vocabulary so prefixes collide.

    Besides the bookkeeping invariants, a shadow copy of every block's contents (written by the
    simulated steps, copied by the copy-on-write ops) checks that each live sequence's table
    really holds its tokens: a wrong prefix hit or a write into a shared block shows up there."""

    def __init__(self):
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.pending: list[Sequence] = []  # not admitted (new or preempted)
        self.live: list[Sequence] = []  # hold blocks
        self.content: dict[int, list] = {}
        self.next_id = 0

    @initialize(block_size=st.sampled_from([2, 4]), num_blocks=st.integers(3, 12),
                prefix=st.sampled_from([True, True, True, False]), watermark=st.sampled_from([0.0, 0.2]))
    def setup(self, block_size, num_blocks, prefix, watermark):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix, watermark=watermark)
        self.content = {b: [None] * block_size for b in range(num_blocks)}

    # -- helpers --
    def _new_seq(self, tokens) -> Sequence:
        self.next_id += 1
        return Sequence(self.next_id, f"r{self.next_id}", tokens, SamplingParams())

    def _apply_copies(self):
        for src, dst in self.kv.drain_copies():
            self.content[dst] = list(self.content[src])

    def _write(self, seq: Sequence, n: int, sampled: int):
        bs, old = self.kv.block_size, seq.num_computed_tokens
        for pos in range(old, old + n):
            self.content[seq.block_table[pos // bs]][pos % bs] = seq.token_ids[pos]
        compute(self.kv, seq, n, sampled)

    def _try_allocate(self, seq, n, hits=(), keep_watermark=False) -> bool:
        kv, pool, bs = self.kv, self.kv.pool, self.kv.block_size
        before = manager_state(kv, *self.live, seq)
        used_before = pool.num_used
        revived = sum(1 for b in hits if pool.ref_counts[b] == 0)
        start = seq.num_computed_tokens + len(hits) * bs
        new_blocks = kv.blocks_needed(start + n) - len(seq.block_table) - len(hits)
        shared_partial = start % bs != 0 and pool.ref_counts[seq.block_table[start // bs]] > 1
        wm = kv.watermark_blocks if keep_watermark else 0
        fits = new_blocks + shared_partial <= pool.num_free - revived - wm
        ok = kv.allocate_slots(seq, n, hits, keep_watermark=keep_watermark)
        assert ok == fits
        if not ok:
            assert manager_state(kv, *self.live, seq) == before, "failed allocation changed state"
        else:
            assert len(kv.pending_copies) == int(shared_partial)
            assert pool.num_used == used_before + revived + new_blocks + shared_partial
        return ok

    # -- rules --
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=11))
    def add_sequence(self, tokens):
        self.pending.append(self._new_seq(tokens))

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 12), keep_watermark=st.booleans(),
          sampled=st.integers(0, 1))
    def admit(self, i, chunk, keep_watermark, sampled):
        seq = self.pending[i % len(self.pending)]
        kv = self.kv
        hits = kv.get_computed_blocks(seq)
        assert len(hits) * kv.block_size < seq.num_tokens  # the last token is always computed
        assert len(set(hits)) == len(hits)
        for j, b in enumerate(hits):
            assert kv.pool.block_hash[b] == seq.block_hashes[j]
        n = min(chunk, seq.num_tokens - len(hits) * kv.block_size)
        if not self._try_allocate(seq, n, hits, keep_watermark):
            return
        assert seq.num_computed_tokens == len(hits) * kv.block_size
        self._apply_copies()
        self.pending.remove(seq)
        self.live.append(seq)
        self._write(seq, n, sampled)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 6), sampled=st.integers(0, 1))
    def step_sequence(self, i, chunk, sampled):
        seq = self.live[i % len(self.live)]
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert n >= 1
        if self._try_allocate(seq, n):
            self._apply_copies()
            self._write(seq, n, sampled)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), token=st.integers(0, 1))
    def fork(self, i, token):
        parent = self.live[i % len(self.live)]
        child = self._new_seq(parent.prompt_token_ids)
        child.token_ids = list(parent.token_ids)
        sampled_last = parent.num_tokens > parent.num_prompt_tokens
        if sampled_last and parent.num_computed_tokens == parent.num_tokens - 1:
            child.token_ids[-1] = token  # a sibling sample of the last token
        refs_before = list(self.kv.pool.ref_counts)
        self.kv.fork(parent, child)
        for b in set(parent.block_table):
            assert self.kv.pool.ref_counts[b] == refs_before[b] + 1
        assert child.block_table == parent.block_table
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        seq = self.live.pop(i % len(self.live))
        self.kv.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def preempt(self, i):
        """Recompute preemption: free, keep the tokens, admit again later."""
        seq = self.live.pop(i % len(self.live))
        self.kv.free(seq)
        self.pending.append(seq)

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 100))
    def drop_pending(self, i):
        seq = self.pending.pop(i % len(self.pending))
        self.kv.free(seq)  # a no-op for a sequence without blocks

    # -- invariants --
    @invariant()
    def bookkeeping_is_consistent(self):
        kv = self.kv
        if kv is None:
            return
        pool, bs = kv.pool, kv.block_size
        assert pool.num_free + pool.num_used == pool.num_blocks
        holders: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in self.live:
            table = seq.block_table
            assert len(set(table)) == len(table), f"block twice in one table: {table}"
            # Lazy growth: the table covers exactly the computed tokens.
            assert len(table) == kv.blocks_needed(seq.num_computed_tokens)
            for idx, b in enumerate(table):
                holders.setdefault(b, []).append((seq, idx))
        for seq in self.pending:
            assert seq.block_table == []
        free = set(pool.free_queue)
        used = set(holders)
        assert len(free) == len(pool.free_queue)
        assert not (free & used), f"blocks both free and used: {free & used}"
        assert free | used == set(range(pool.num_blocks))
        assert pool.num_used == len(used)
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == len(holders.get(b, ())), f"ref count of block {b}"
        for b in free:
            assert pool.ref_counts[b] == 0
        # Fill of each used block, from every table that holds it: all holders must agree.
        fill_of: dict[int, int] = {}
        for b, hs in holders.items():
            fills = {min(bs, max(0, s.num_computed_tokens - idx * bs)) for s, idx in hs}
            assert len(fills) == 1, f"holders of block {b} disagree on its fill: {fills}"
            (fill_of[b],) = fills
        total = sum(fill_of.values())
        assert kv.num_filled_slots(self.live) == total
        allocated = pool.num_used * bs
        assert kv.fragmentation(self.live) == pytest.approx(0.0 if allocated == 0 else 1 - total / allocated)
        # Prefix-cache index.
        for h, b in pool.cached.items():
            assert pool.block_hash[b] == h
        for b, h in enumerate(pool.block_hash):
            if h is not None:
                assert pool.cached.get(h) == b
                if b in fill_of:
                    assert fill_of[b] == bs  # only full blocks are cached
        assert kv.pending_copies == []

    @invariant()
    def tables_hold_the_sequences_tokens(self):
        if self.kv is None:
            return
        bs = self.kv.block_size
        for seq in self.live:
            for pos in range(seq.num_computed_tokens):
                got = self.content[seq.block_table[pos // bs]][pos % bs]
                assert got == seq.token_ids[pos], f"seq {seq.seq_id} position {pos}"
        # A cached block's contents are the tokens its hash names (checked through any live
        # sequence whose hashes cover it).
        pool = self.kv.pool
        for seq in self.live + self.pending:
            for j, h in enumerate(seq.block_hashes):
                b = pool.cached.get(h)
                if b is not None:
                    assert self.content[b] == seq.token_ids[j * bs:(j + 1) * bs]

    def teardown(self):
        kv = self.kv
        if kv is None:
            return
        for seq in self.live + self.pending:
            kv.free(seq)
        assert kv.pool.num_free == kv.pool.num_blocks
        assert kv.pool.ref_counts == [0] * kv.pool.num_blocks
        assert kv.num_filled_slots(self.live + self.pending) == 0
        assert sorted(kv.pool.free_queue) == list(range(kv.pool.num_blocks))


KVCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestKVCacheStateMachine = KVCacheMachine.TestCase
