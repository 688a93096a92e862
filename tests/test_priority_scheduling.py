"""The priority scheduling policy: admission and preemption order, and ageing (no starvation)."""

from __future__ import annotations

import pytest

from coordinator.kv_cache_manager import KVCacheManager
from coordinator.scheduler import PRIORITY_AGING_STEPS, Scheduler
from coordinator.sequence import SequenceStatus
from tests.test_scheduler import assert_no_leak, finish_all, make_seq, plan, run_step


def _scheduler(policy: str, num_blocks=64, budget=64, max_num_seqs=8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4, enable_prefix_caching=False), max_num_seqs, budget, True, policy)


def _seq(seq_id: int, tokens: int, priority: int):
    seq = make_seq(seq_id, tokens)
    seq.priority = priority
    return seq


@pytest.mark.parametrize("policy,expected_first", [("fcfs", 0), ("priority", 1)])
def test_admission_follows_the_policy(policy, expected_first):
    sched = _scheduler(policy, budget=8, max_num_seqs=1)
    sched.add(_seq(0, 8, priority=5))  # arrives first, less important
    sched.add(_seq(1, 8, priority=0))
    assert plan(run_step(sched)) == [(expected_first, 8)]
    finish_all(sched)
    assert_no_leak(sched.kv)


def test_priority_preempts_the_least_important_running_sequence_not_the_newest():
    sched = _scheduler("priority", num_blocks=6, budget=64)
    sched.add(_seq(0, 8, priority=9))  # oldest, least important
    sched.add(_seq(1, 8, priority=1))
    sched.add(_seq(2, 7, priority=0))  # newest, most important
    run_step(sched)  # 2 + 2 + 2 blocks: the pool is full
    out = run_step(sched)  # seq 0 and 1 need a third block each
    assert [s.seq_id for s in out.preempted] == [0]
    assert {s.seq_id for s in sched.running} == {1, 2}
    finish_all(sched)
    assert_no_leak(sched.kv)


def test_a_low_priority_request_ages_past_a_stream_of_important_ones():
    sched = _scheduler("priority", budget=4, max_num_seqs=1)
    low = _seq(0, 4, priority=2)
    sched.add(low)
    sched.add(_seq(1, 4, priority=0))
    next_id = 2
    admitted_at = None
    for step in range(1, 4 * PRIORITY_AGING_STEPS):
        out = run_step(sched)
        if low in [s for s, _ in out.scheduled]:
            admitted_at = step
            break
        for seq in list(sched.running):  # each important request finishes at once ...
            sched.finish(seq, SequenceStatus.FINISHED_STOPPED)
        sched.add(_seq(next_id, 4, priority=0))  # ... and a fresh one arrives
        next_id += 1
    # Two levels to climb, one per PRIORITY_AGING_STEPS steps waited; then the older arrival wins.
    assert admitted_at is not None, "the low-priority request starved"
    assert 2 * PRIORITY_AGING_STEPS <= admitted_at <= 2 * PRIORITY_AGING_STEPS + 2
    finish_all(sched)
    assert_no_leak(sched.kv)


def test_unknown_policy_is_refused():
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        EngineConfig(scheduling_policy="lifo")
