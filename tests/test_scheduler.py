"""Scheduler over a real KVCacheManager, no model: each step is `schedule()`, then what workers
would return (a token for each sequence whose context the step completes), then the scheduler's
own `update_from_output`."""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.kv_cache_manager import KVCacheManager
from coordinator.sampling_params import SamplingParams
from coordinator.scheduler import Scheduler, SchedulerOutput
from coordinator.sequence import Sequence, SequenceStatus
from coordinator.stats import IterationStats
from workers.step_plan import StepOutput

SAMPLED = 7
BS = 4


def make_scheduler(num_blocks=64, budget=64, max_num_seqs=8, chunked=True, prefix=False,
                   watermark=0.0, block_size=BS) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix, watermark=watermark)
    return Scheduler(kv, max_num_seqs, budget, chunked), kv


def make_seq(seq_id: int, tokens) -> Sequence:
    if isinstance(tokens, int):
        tokens = [100 + seq_id * 50 + i for i in range(tokens)]  # distinct per sequence
    return Sequence(seq_id, f"req-{seq_id}", list(tokens), SamplingParams(max_tokens=None))


def worker_output(out: SchedulerOutput, tokens: dict[int, int]) -> StepOutput:
    return StepOutput(list(tokens), np.array(list(tokens.values()), dtype=np.int64))


def run_step(sched: Scheduler, sampled: int = SAMPLED) -> SchedulerOutput:
    out = sched.schedule()
    tokens = {seq.seq_id: sampled for seq, n in out.scheduled if seq.num_computed_tokens + n == seq.num_tokens}
    sched.update_from_output(out, worker_output(out, tokens), IterationStats())
    sched.kv.end_step()
    return out


def plan(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(seq.seq_id, n) for seq, n in out.scheduled]


def finish_all(sched: Scheduler) -> None:
    for seq in [*sched.running, *sched.waiting, *sched.swapped]:
        sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished()


def assert_no_leak(kv: KVCacheManager) -> None:
    pool = kv.pool
    assert pool.num_free == pool.num_blocks, f"{pool.num_used} blocks still used"
    assert pool.ref_counts == [0] * pool.num_blocks
    assert kv.pending_copies == []


# ---- chunked prefill ---------------------------------------------------------------------------

def test_chunked_prefill_splits_prompts_by_the_token_budget():
    sched, kv = make_scheduler(budget=8)
    a, b = make_seq(1, 20), make_seq(2, 20)
    sched.add(a)
    sched.add(b)
    steps = [plan(run_step(sched)) for _ in range(7)]
    assert steps == [
        [(1, 8)],
        [(1, 8)],
        [(1, 4), (2, 4)],  # a's last chunk; b takes the rest of the budget
        [(1, 1), (2, 7)],
        [(1, 1), (2, 7)],
        [(1, 1), (2, 2)],  # b's prompt done; the budget's rest goes unused
        [(1, 1), (2, 1)],
    ]
    finish_all(sched)
    assert_no_leak(kv)


def test_first_token_is_sampled_only_after_the_last_prefill_chunk():
    sched, kv = make_scheduler(budget=8)
    a = make_seq(1, 20)
    sched.add(a)
    run_step(sched)
    run_step(sched)
    assert a.num_computed_tokens == 16 and a.num_output_tokens == 0
    assert a.block_table == [0, 1, 2, 3]
    run_step(sched)
    assert a.num_computed_tokens == 20 and a.output_token_ids == [SAMPLED]
    assert [plan(run_step(sched)) for _ in range(2)] == [[(1, 1)], [(1, 1)]]
    finish_all(sched)
    assert_no_leak(kv)


def test_scheduled_tokens_never_exceed_the_budget():
    sched, kv = make_scheduler(budget=10)
    for i in range(5):
        sched.add(make_seq(i, 7 + i))
    for _ in range(12):
        out = run_step(sched)
        assert 0 < out.num_tokens <= 10
    finish_all(sched)
    assert_no_leak(kv)


# ---- non-chunked -----------------------------------------------------------------------------------

def test_non_chunked_mode_schedules_whole_prompts_only():
    sched, kv = make_scheduler(budget=8, chunked=False)
    sched.add(make_seq(1, 6))
    sched.add(make_seq(2, 6))
    assert plan(run_step(sched)) == [(1, 6)]  # 6 > 2 left: b waits whole
    assert [s.seq_id for s in sched.waiting] == [2]
    assert plan(run_step(sched)) == [(1, 1), (2, 6)]
    finish_all(sched)
    assert_no_leak(kv)


def test_chunked_mode_splits_the_same_prompts():
    sched, kv = make_scheduler(budget=8, chunked=True)
    sched.add(make_seq(1, 6))
    sched.add(make_seq(2, 6))
    assert plan(run_step(sched)) == [(1, 6), (2, 2)]
    assert plan(run_step(sched)) == [(1, 1), (2, 4)]
    finish_all(sched)
    assert_no_leak(kv)


def test_non_chunked_prompt_that_does_not_fit_blocks_later_ones():
    sched, kv = make_scheduler(budget=8, chunked=False)
    sched.add(make_seq(1, 4))
    sched.add(make_seq(2, 6))
    sched.add(make_seq(3, 2))  # would fit the 4 tokens left, but may not overtake 2
    assert plan(run_step(sched)) == [(1, 4)]
    assert [s.seq_id for s in sched.waiting] == [2, 3]
    finish_all(sched)
    assert_no_leak(kv)


# ---- admission ---------------------------------------------------------------------------------

def test_waiting_sequences_are_admitted_first_come_first_served():
    sched, kv = make_scheduler()
    for i in (3, 1, 2):
        sched.add(make_seq(i, 5))
    out = run_step(sched)
    assert plan(out) == [(3, 5), (1, 5), (2, 5)]
    assert [s.seq_id for s in sched.running] == [3, 1, 2]
    assert all(s.status is SequenceStatus.RUNNING for s in sched.running)
    finish_all(sched)
    assert_no_leak(kv)


def test_head_of_queue_that_lacks_blocks_is_not_overtaken():
    sched, kv = make_scheduler(num_blocks=4)
    a, b, c = make_seq(1, 8), make_seq(2, 12), make_seq(3, 2)
    for s in (a, b, c):
        sched.add(s)
    assert plan(run_step(sched)) == [(1, 8)]  # b needs 3 blocks, 2 free; c could fit but waits
    assert list(sched.waiting) == [b, c]
    assert b.block_table == [] and c.block_table == []
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    assert plan(run_step(sched)) == [(2, 12), (3, 2)]
    finish_all(sched)
    assert_no_leak(kv)


def test_max_num_seqs_caps_running_sequences():
    sched, kv = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq(1, 3), make_seq(2, 3), make_seq(3, 3)
    for s in (a, b, c):
        sched.add(s)
    assert plan(run_step(sched)) == [(1, 3), (2, 3)]
    assert plan(run_step(sched)) == [(1, 1), (2, 1)]
    assert list(sched.waiting) == [c] and c.status is SequenceStatus.WAITING
    sched.finish(a, SequenceStatus.FINISHED_LENGTH)
    assert plan(run_step(sched)) == [(2, 1), (3, 3)]
    finish_all(sched)
    assert_no_leak(kv)


def test_decodes_of_running_sequences_come_before_new_admissions():
    sched, kv = make_scheduler(budget=4)
    a = make_seq(1, 4)
    sched.add(a)
    run_step(sched)
    b = make_seq(2, 10)
    sched.add(b)
    assert plan(run_step(sched)) == [(1, 1), (2, 3)]
    finish_all(sched)
    assert_no_leak(kv)


def test_running_decodes_can_use_the_whole_budget_and_starve_admissions():
    sched, kv = make_scheduler(budget=2)
    a, b = make_seq(1, 1), make_seq(2, 1)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    c = make_seq(3, 1)
    sched.add(c)
    for _ in range(3):
        assert plan(run_step(sched)) == [(1, 1), (2, 1)]
    assert list(sched.waiting) == [c]
    finish_all(sched)
    assert_no_leak(kv)


def test_watermark_keeps_blocks_free_when_admitting_beside_running_sequences():
    sched, kv = make_scheduler(num_blocks=10, watermark=0.2)  # 2 watermark blocks
    a = make_seq(1, 12)  # 3 blocks
    sched.add(a)
    run_step(sched)
    b = make_seq(2, 24)  # 6 blocks: 7 free, 2 kept back -> refused
    sched.add(b)
    assert plan(run_step(sched)) == [(1, 1)]
    assert list(sched.waiting) == [b] and b.block_table == []
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    assert plan(run_step(sched)) == [(2, 24)]  # alone, it may use the watermark blocks
    finish_all(sched)
    assert_no_leak(kv)


def test_lone_sequence_may_use_the_whole_pool():
    sched, kv = make_scheduler(num_blocks=5, watermark=0.4)
    a = make_seq(1, 20)
    sched.add(a)
    assert plan(run_step(sched)) == [(1, 20)]
    assert kv.num_free_blocks == 0
    finish_all(sched)
    assert_no_leak(kv)


# ---- preemption ----------------------------------------------------------------------------------

def _three_decoding_one_waiting():
    """bs 4, 4 blocks: a, b, c each hold one full block; d waits behind max_num_seqs=3."""
    sched, kv = make_scheduler(num_blocks=4, max_num_seqs=3)
    seqs = [make_seq(i, 4) for i in (1, 2, 3, 4)]
    for s in seqs:
        sched.add(s)
    assert plan(run_step(sched)) == [(1, 4), (2, 4), (3, 4)]
    assert kv.num_free_blocks == 1
    return sched, kv, seqs


def test_preempted_sequence_goes_to_front_of_waiting_with_tokens_kept():
    sched, kv, (a, b, c, d) = _three_decoding_one_waiting()
    tokens_before = list(c.token_ids)
    assert c.num_output_tokens == 1
    out = run_step(sched)  # a takes the last block; b needs one: c, the newest, is preempted
    assert plan(out) == [(1, 1), (2, 1)]
    assert out.preempted == [c]
    assert list(sched.waiting) == [c, d]
    assert sched.running == [a, b]
    assert c.status is SequenceStatus.WAITING
    assert c.token_ids == tokens_before  # generated token kept
    assert c.num_computed_tokens == 0
    assert c.block_table == []
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert a.num_preemptions == 0 and b.num_preemptions == 0
    assert a.block_table == [0, 3] and b.block_table == [1, 2]  # b got c's freed block
    finish_all(sched)
    assert_no_leak(kv)


def test_preempted_sequence_is_readmitted_first_and_recomputes_its_generated_tokens():
    sched, kv, (a, b, c, d) = _three_decoding_one_waiting()
    run_step(sched)  # c preempted with 5 tokens (4 prompt + 1 generated)
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)  # frees 2 blocks
    out = run_step(sched)
    assert plan(out) == [(2, 1), (3, 5)]  # c before d; its whole context is prefilled again
    assert list(sched.waiting) == [d]
    assert c.output_token_ids == [SAMPLED, SAMPLED]
    assert c.num_preemptions == 1
    finish_all(sched)
    assert_no_leak(kv)


def test_sequence_that_is_newest_preempts_itself():
    sched, kv = make_scheduler(num_blocks=3)
    a, b = make_seq(1, 6), make_seq(2, 4)
    sched.add(a)
    sched.add(b)
    assert plan(run_step(sched)) == [(1, 6), (2, 4)]
    assert kv.num_free_blocks == 0
    out = run_step(sched)  # a writes inside its block; b needs a block and is the newest
    assert plan(out) == [(1, 1)]
    assert out.preempted == [b]
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert b.num_preemptions == 1 and kv.num_free_blocks == 1
    finish_all(sched)
    assert_no_leak(kv)


def test_a_requests_preempted_samples_count_it_once_among_the_waiting_requests():
    """The queue limit (`--max-queued-requests`) counts requests: an n=3 request whose samples
    were preempted is one waiting request, not three."""
    sched, kv = make_scheduler(num_blocks=3)
    sched.add_request("a", [1, 2, 3, 4], SamplingParams(n=3, temperature=1.0, max_tokens=None))
    sched.add_request("b", [5, 6, 7, 8], SamplingParams(max_tokens=None))
    assert sched.num_waiting_requests == 2
    out = sched.schedule()  # both prompts: a block each; a forks into 3 samples on a's block
    first = out.scheduled[0][0]
    sampled = {seq.seq_id: SAMPLED for seq, _ in out.scheduled} | {fork: SAMPLED for fork in first.fork_ids}
    sched.update_from_output(out, worker_output(out, sampled), IterationStats())
    kv.end_step()
    assert sched.num_waiting_requests == 0 and len(sched.running) == 4
    run_step(sched)  # one free block for four sequences that each need one: three are preempted
    assert sorted(seq.request_id for seq in sched.waiting) == ["a", "a", "b"]
    assert sched.num_waiting_requests == 2
    finish_all(sched)
    assert_no_leak(kv)


def test_nothing_is_admitted_in_a_step_that_preempted_even_if_it_would_fit():
    # c duplicates b's prompt but was admitted with b, so its first block is an unregistered
    # duplicate: once preempted, c would fit again through a prefix hit on b's block.
    sched, kv = make_scheduler(num_blocks=5, prefix=True)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    a, b, c = make_seq(1, 4), make_seq(2, prompt), make_seq(3, prompt)
    for s in (a, b, c):
        sched.add(s)
    assert plan(run_step(sched)) == [(1, 4), (2, 7), (3, 7)]
    assert kv.num_free_blocks == 0
    out = run_step(sched)
    assert out.preempted == [c]
    assert plan(out) == [(1, 1), (2, 1)]
    assert list(sched.waiting) == [c] and c.status is SequenceStatus.WAITING
    # It would have fitted: a prefix hit on b's block plus the one block still free.
    assert kv.num_free_blocks == 1
    assert kv.get_computed_blocks(c) == [b.block_table[0]]
    # Readmitted once there is room, skipping the cached block.
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    out = run_step(sched)
    assert plan(out) == [(2, 1), (3, 4)]
    assert c.block_table[0] == b.block_table[0]
    assert c.num_cached_prompt_tokens == 0  # only a first admission's hits are reported
    finish_all(sched)
    assert_no_leak(kv)


def test_preemption_lets_older_sequences_keep_running_to_completion():
    sched, kv = make_scheduler(num_blocks=6, max_num_seqs=4)
    seqs = [make_seq(i, 6) for i in range(3)]  # 2 blocks each
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished():
        run_step(sched)
        steps += 1
        for s in list(sched.running):
            if s.num_output_tokens >= 8:
                sched.finish(s, SequenceStatus.FINISHED_LENGTH)
        assert steps < 100
    assert all(s.output_token_ids == [SAMPLED] * 8 for s in seqs)
    assert seqs[0].num_preemptions == 0  # the oldest is never the victim
    assert sched.num_preemptions >= 1
    assert_no_leak(kv)


# ---- prefix cache on admission ----------------------------------------------------------------

def test_prefix_cache_hit_on_admission_skips_cached_tokens():
    sched, kv = make_scheduler(prefix=True)
    a = make_seq(1, list(range(10)))
    sched.add(a)
    assert plan(run_step(sched)) == [(1, 10)]
    b = make_seq(2, list(range(8)) + [50, 51, 52])
    sched.add(b)
    out = run_step(sched)
    assert plan(out) == [(1, 1), (2, 3)]  # 11 prompt tokens - 8 cached
    assert b.num_cached_prompt_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_computed_tokens == 11 and b.output_token_ids == [SAMPLED]
    assert kv.prefix_stats.queries == 10 + 11 and kv.prefix_stats.hits == 8
    finish_all(sched)
    assert_no_leak(kv)


def test_prefix_cache_hit_after_the_first_request_finished():
    sched, kv = make_scheduler(prefix=True)
    a = make_seq(1, list(range(13)))
    sched.add(a)
    run_step(sched)
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    b = make_seq(2, list(range(13)))  # same prompt: all but the last block's worth cached
    sched.add(b)
    assert plan(run_step(sched)) == [(2, 1)]
    assert b.num_cached_prompt_tokens == 12
    finish_all(sched)
    assert_no_leak(kv)


def test_no_prefix_hits_when_prefix_caching_is_off():
    sched, kv = make_scheduler(prefix=False)
    sched.add(make_seq(1, list(range(10))))
    run_step(sched)
    b = make_seq(2, list(range(10)))
    sched.add(b)
    assert plan(run_step(sched)) == [(1, 1), (2, 10)]
    assert b.num_cached_prompt_tokens == 0
    assert kv.prefix_stats.queries == 0
    finish_all(sched)
    assert_no_leak(kv)


# ---- finish ----------------------------------------------------------------------------------------

def test_finish_running_sequence_frees_its_blocks():
    sched, kv = make_scheduler()
    a, b = make_seq(1, 9), make_seq(2, 3)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert kv.pool.num_used == 4
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    assert a.status is SequenceStatus.FINISHED_STOPPED
    assert sched.running == [b]
    assert a.block_table == [] and kv.pool.num_used == 1
    assert plan(run_step(sched)) == [(2, 1)]
    finish_all(sched)
    assert_no_leak(kv)


def test_finish_mid_prefill_sequence_frees_its_partial_blocks():
    sched, kv = make_scheduler(budget=8)
    a = make_seq(1, 30)
    sched.add(a)
    run_step(sched)
    assert a.num_computed_tokens == 8 and kv.pool.num_used == 2
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert a.status is SequenceStatus.FINISHED_ABORTED
    assert not sched.has_unfinished()
    assert_no_leak(kv)


def test_finish_waiting_sequence_removes_it_from_the_queue():
    sched, kv = make_scheduler(max_num_seqs=1)
    a, b, c = make_seq(1, 3), make_seq(2, 3), make_seq(3, 3)
    for s in (a, b, c):
        sched.add(s)
    run_step(sched)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert list(sched.waiting) == [c]
    assert b.status is SequenceStatus.FINISHED_ABORTED
    sched.finish(a, SequenceStatus.FINISHED_LENGTH)
    assert plan(run_step(sched)) == [(3, 3)]
    finish_all(sched)
    assert_no_leak(kv)


def test_finish_preempted_sequence_removes_it_from_waiting():
    sched, kv, (a, b, c, d) = _three_decoding_one_waiting()
    run_step(sched)
    assert c in sched.waiting
    sched.finish(c, SequenceStatus.FINISHED_ABORTED)
    assert list(sched.waiting) == [d]
    assert c.status is SequenceStatus.FINISHED_ABORTED
    finish_all(sched)
    assert_no_leak(kv)


def test_finish_swapped_sequence_removes_it_from_swapped():
    from coordinator.cpu_block_pool import CpuBlockPool

    cpu = CpuBlockPool(8)
    kv = KVCacheManager(4, BS, enable_prefix_caching=False, watermark=0.0, cpu_pool=cpu)
    sched = Scheduler(kv, 8, 64, True, preemption_mode="swap")
    a, b = make_seq(1, 8), make_seq(2, 7)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # 2 + 2 blocks: the pool is full
    out = run_step(sched)  # a needs a third block: b (the newest) is swapped out
    assert [s.seq_id for s in out.preempted] == [2] and b.status is SequenceStatus.SWAPPED
    assert len(out.swap_out) == 2 and cpu.num_used == 2 and b.block_table == [] and len(b.cpu_block_table) == 2
    assert b.num_computed_tokens == 7  # its K/V live on in the store
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert not sched.swapped and cpu.num_used == 0 and b.status is SequenceStatus.FINISHED_ABORTED
    finish_all(sched)
    assert_no_leak(kv)


# ---- random workloads ------------------------------------------------------------------------------

def _next_token(context: list) -> int:
    """A deterministic stand-in for the model: the next token is a function of the context."""
    return hashlib.blake2b(repr(context).encode(), digest_size=2).digest()[0] % 3


workloads = st.fixed_dictionaries({
    "prompts": st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=6),
    "max_tokens": st.lists(st.integers(1, 6), min_size=6, max_size=6),
    "block_size": st.sampled_from([2, 4]),
    "extra_blocks": st.integers(0, 6),
    "budget_extra": st.integers(0, 12),
    "max_num_seqs": st.integers(1, 4),
    "chunked": st.booleans(),
    "prefix": st.booleans(),
    "arrivals": st.lists(st.integers(0, 3), min_size=6, max_size=6),
    # A CPU KV store of this many blocks (0: none): swap preemption and the prefix cache's CPU tier.
    "cpu_blocks": st.sampled_from([0, 1, 2, 3, 8]),
    "preemption_mode": st.sampled_from(["swap", "auto", "recompute"]),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads)
def test_random_workloads_read_back_their_own_tokens_and_leak_nothing(w):
    """The sampled token is computed from what the block tables hold (a shadow of the KV cache
    written through the tables, and of the CPU store, with each step's transfers applied in the
    workers' order: swap-outs, copies, swap-ins, loads), so a wrong prefix hit, a lost block, a
    stale table, or a CPU block overwritten before a step read it changes the outputs; they must
    equal the reference computed from the token ids."""
    from coordinator.cpu_block_pool import CpuBlockPool

    bs = w["block_size"]
    longest = max(len(p) + m for p, m in zip(w["prompts"], w["max_tokens"]))
    num_blocks = -(-longest // bs) + w["extra_blocks"]  # the longest sequence always fits alone
    budget = (longest if not w["chunked"] else 1) + w["budget_extra"]
    cpu = CpuBlockPool(w["cpu_blocks"]) if w["cpu_blocks"] else None
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=w["prefix"], watermark=0.0, cpu_pool=cpu)
    sched = Scheduler(kv, w["max_num_seqs"], budget, w["chunked"],
                      preemption_mode=w["preemption_mode"] if cpu else "recompute")
    content = {b: [None] * bs for b in range(num_blocks)}
    cpu_content = {c: [None] * bs for c in range(w["cpu_blocks"])}
    seqs = [Sequence(i, f"r{i}", p, SamplingParams(max_tokens=w["max_tokens"][i]))
            for i, p in enumerate(w["prompts"])]
    pending = list(seqs)
    steps = 0
    while pending or sched.has_unfinished():
        while pending and w["arrivals"][pending[0].seq_id] <= steps:
            sched.add(pending.pop(0))
        out = sched.schedule()
        steps += 1
        assert steps < 400, "no progress"
        assert out.num_tokens <= budget
        ids = [s.seq_id for s, _ in out.scheduled]
        assert len(set(ids)) == len(ids)
        assert len(sched.running) <= w["max_num_seqs"]
        for victim in out.preempted:
            assert victim.block_table == []
            if victim.status is SequenceStatus.SWAPPED:
                assert any(victim in group for group in sched.swapped)
            else:
                assert victim in sched.waiting and victim.num_computed_tokens == 0
        if out.preempted:
            assert all(s in sched.running for s, _ in out.scheduled)
            recomputed = [v for v in out.preempted if v.status is SequenceStatus.WAITING]
            if recomputed:
                assert sched.waiting[0] is recomputed[-1]
        # The workers' order. Every transfer reads a snapshot taken at its turn.
        for d, c in out.swap_out:
            cpu_content[c] = list(content[d])
        for src, dst in out.copies:
            content[dst] = list(content[src])
        for c, d in out.swap_in + out.load:
            content[d] = list(cpu_content[c])
        for c, _ in out.swap_in:
            cpu_content[c] = [None] * bs  # released: the store no longer vouches for it
        tokens = {}  # the workers' forward pass: write every new token, then read back whole contexts
        for seq, n in out.scheduled:
            assert n >= 1
            assert seq.status is SequenceStatus.RUNNING
            old = seq.num_computed_tokens
            assert len(seq.block_table) == kv.blocks_needed(old + n)
            for pos in range(old, old + n):
                content[seq.block_table[pos // bs]][pos % bs] = seq.token_ids[pos]
        for seq, n in out.scheduled:
            if seq.num_computed_tokens + n == seq.num_tokens:
                seen = [content[seq.block_table[p // bs]][p % bs] for p in range(seq.num_tokens)]
                assert seen == seq.token_ids, f"seq {seq.seq_id} reads tokens it never wrote"
                tokens[seq.seq_id] = _next_token(seq.token_ids)
        sched.update_from_output(out, worker_output(out, tokens), IterationStats())  # max_tokens ends them
        kv.end_step()
        # Ref counts equal the number of running tables holding each block, on both pools.
        counts = [0] * num_blocks
        for seq in sched.running:
            for b in seq.block_table:
                counts[b] += 1
        assert kv.pool.ref_counts == counts
        assert all(s.block_table == [] for s in sched.waiting)
        if cpu is not None:
            cpu_counts = [0] * cpu.num_blocks
            for group in sched.swapped:
                for c in set(c for seq in group for c in seq.cpu_block_table):
                    cpu_counts[c] += sum(seq.cpu_block_table.count(c) for seq in group)
            assert cpu.ref_counts == cpu_counts
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED_LENGTH
        expected = list(seq.prompt_token_ids)
        for _ in range(seq.params.max_tokens):
            expected.append(_next_token(expected))
        assert seq.token_ids == expected
    assert_no_leak(kv)
    if cpu is not None:
        assert cpu.num_used == 0


def test_decodes_run_before_an_older_sequences_remaining_prefill_chunks():
    sched, kv = make_scheduler(budget=8)
    old, young = make_seq(0, 3), make_seq(1, 3)
    sched.add(old)
    sched.add(young)
    run_step(sched)
    assert plan(run_step(sched)) == [(0, 1), (1, 1)]  # both decoding, oldest first
    # The older one now has 12 tokens to catch up (as after a readmission): the younger one's
    # decode still goes first, and the older one's chunk gets what is left of the budget.
    old.token_ids.extend([5] * 11)
    assert plan(run_step(sched)) == [(1, 1), (0, 7)]
    finish_all(sched)
    assert_no_leak(kv)


def test_preempting_an_already_scheduled_decode_drops_it_from_the_step():
    sched, kv = make_scheduler(num_blocks=4, budget=16, watermark=0.0)
    old = make_seq(0, 9)  # 3 blocks once its prompt is in, grows into a 4th
    sched.add(old)
    run_step(sched)
    young = make_seq(1, 3)
    sched.add(young)
    run_step(sched)  # young takes the last block
    assert kv.num_free_blocks == 0
    # Give `old` an unfinished prefill (as after a readmission) so it is ordered after young's decode.
    old.token_ids.extend([5] * 5)  # 16 tokens: its 4th block must come from young
    out = run_step(sched)
    assert [s.seq_id for s in out.preempted] == [1]
    assert plan(out) == [(0, 6)]  # young's decode was scheduled first, then preempted and dropped
    assert young.status == SequenceStatus.WAITING and sched.waiting[0] is young
    finish_all(sched)
    assert_no_leak(kv)


def _faulted_step(sched: Scheduler) -> tuple[SchedulerOutput, list[str]]:
    """A step whose workers died: what recovery does with it (no output, the pool lost)."""
    out = sched.schedule()
    sched.kv.end_step()
    poison = sched.record_fault(out)
    sched.reset_after_worker_loss(out)
    return out, poison


def test_a_poison_request_is_named_only_once_it_faults_without_another_twice_faulted_request():
    sched, kv = make_scheduler()
    for i in range(3):
        sched.add_request(f"r{i}", [100 + 10 * i + t for t in range(8)], SamplingParams(max_tokens=4))
    out, poison = _faulted_step(sched)
    assert len(out.scheduled) == 3 and poison == []  # one fault proves nothing
    out, poison = _faulted_step(sched)  # once-faulted suspects run together again: cheap recovery
    assert len(out.scheduled) == 3 and poison == []  # three twice-faulted requests: no verdict yet
    assert sched.fault_suspects == {"r0": 2, "r1": 2, "r2": 2}
    ok = run_step(sched)
    assert [seq.request_id for seq, _ in ok.scheduled] == ["r0"]  # isolated: one per step
    assert "r0" not in sched.fault_suspects  # a step it ran in succeeded: cleared
    out, poison = _faulted_step(sched)  # r1 alone among the twice-faulted: the poison
    assert {seq.request_id for seq, _ in out.scheduled} == {"r0", "r1"} and poison == ["r1"]
    assert sched.fault_suspects["r0"] == 1  # r0 shared the batch: a suspect again, not a poison
    sched.abort_request("r1")
    while sched.has_unfinished():
        run_step(sched)
    assert not sched.fault_suspects
    assert_no_leak(kv)
