"""The prefix cache's CPU tier: evicted cached blocks saved to the KV store, prefix hits there
loaded back instead of recomputed, and the step ordering that keeps every transfer's data intact."""

from __future__ import annotations

import pytest

from coordinator.cpu_block_pool import CpuBlockPool
from coordinator.kv_cache_manager import KVCacheManager
from coordinator.scheduler import Scheduler
from coordinator.sequence import SequenceStatus
from pagedserve import LLM, SamplingParams
from tests.test_kv_swap import TIGHT, _assert_all_free
from tests.test_model_correctness import _generate, _prompts
from tests.test_scheduler import make_seq, run_step

BS = 4


def _computed(kv: KVCacheManager, seq, num_tokens: int) -> None:
    """As the engine after a step: the sequence's first `num_tokens` have their K/V written."""
    seq.num_computed_tokens = num_tokens
    kv.commit_computed(seq)


def _tier(num_blocks: int, num_cpu_blocks: int) -> tuple[KVCacheManager, CpuBlockPool]:
    cpu = CpuBlockPool(num_cpu_blocks)
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True, watermark=0.0, cpu_pool=cpu)
    assert kv.cpu_pool is cpu and kv.cpu_tier_enabled
    return kv, cpu


def test_the_cpu_pool_backs_the_prefix_cache_only_with_prefix_caching():
    cpu = CpuBlockPool(2)
    kv = KVCacheManager(4, BS, enable_prefix_caching=False, cpu_pool=cpu)
    assert kv.cpu_pool is cpu and not kv.cpu_tier_enabled  # swap preemption only
    assert kv.pool.evicted is None
    a = make_seq(0, 9)
    assert kv.allocate_slots(a, 9)
    _computed(kv, a, 9)
    assert kv.get_cpu_tier_blocks(a, 0) == [] and kv.save_evicted() == []

    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    assert kv.cpu_pool is None and not kv.cpu_tier_enabled and kv.pool.evicted is None
    kv.end_step()  # nothing to release without a pool
    kv.replace_cpu_pool(cpu)  # a (new) store
    assert kv.cpu_pool is cpu and kv.cpu_tier_enabled and kv.pool.evicted == []
    kv.replace_cpu_pool(None)  # the store died, none replaces it
    assert kv.cpu_pool is None and not kv.cpu_tier_enabled and kv.pool.evicted is None


def test_evicted_cached_blocks_are_saved_and_loaded_back_instead_of_recomputed():
    kv, cpu = _tier(num_blocks=4, num_cpu_blocks=8)
    a = make_seq(0, 13)  # 3 full blocks and one partial
    assert kv.allocate_slots(a, 13)
    _computed(kv, a, 13)
    a_blocks = list(a.block_table[:3])
    kv.free(a)
    assert kv.save_evicted() == []  # freed blocks stay in the device cache: nothing to save yet

    b = make_seq(1, 16)  # needs all 4 device blocks: a's cached ones are evicted
    assert kv.allocate_slots(b, 16)
    saves = kv.save_evicted()
    assert sorted(d for d, _ in saves) == sorted(a_blocks)
    # Held, and found by nobody, until the step has written them.
    assert cpu.num_cached == 0 and cpu.num_used == 3
    assert kv.prefix_stats.cpu_saved_blocks == 3
    kv.end_step()  # the manager ends its CPU pool's step
    assert cpu.num_used == 0 and cpu.num_free == 8 and cpu.num_cached == 3
    kv.free(b)

    again = make_seq(2, a.token_ids[:13])  # a's prompt once more
    assert kv.get_computed_blocks(again) == []
    by_device = dict(saves)
    loaded = kv.get_cpu_tier_blocks(again, 0)
    assert loaded == [by_device[d] for d in a_blocks]  # in prefix order
    assert kv.allocate_slots(again, 1, [], cpu_blocks=loaded)
    assert again.num_computed_tokens == 12 and len(again.block_table) == 4
    assert kv.drain_loads() == list(zip(loaded, again.block_table[:3]))
    assert cpu.num_used == 3  # nothing may overwrite them before this step reads them
    kv.end_step()
    # The loaded blocks are device cache entries again, and stay in the CPU tier too.
    assert kv.get_computed_blocks(make_seq(3, a.token_ids[:13])) == again.block_table[:3]
    assert cpu.num_cached == 3 and kv.prefix_stats.cpu_loaded_blocks == 3


def test_a_cpu_block_loaded_this_step_is_not_overwritten_by_a_save_in_the_same_step():
    kv, cpu = _tier(num_blocks=2, num_cpu_blocks=1)
    a = make_seq(0, 5)
    assert kv.allocate_slots(a, 5)
    _computed(kv, a, 5)
    kv.free(a)  # a's first block is cached on the device
    filler = make_seq(1, 8)
    assert kv.allocate_slots(filler, 8)  # evicts it
    [(_, saved)] = kv.save_evicted()
    kv.end_step()
    _computed(kv, filler, 8)
    kv.free(filler)  # filler's 2 blocks are cached now

    again = make_seq(2, a.token_ids[:5])
    loaded = kv.get_cpu_tier_blocks(again, 0)
    assert loaded == [saved]
    assert kv.allocate_slots(again, 1, [], cpu_blocks=loaded)  # evicts both cached filler blocks
    assert len(kv.pool.evicted) == 2
    # The tier's only block is being read this step: no evicted block is saved over it.
    assert kv.save_evicted() == []
    assert cpu.lookup(a.block_hashes[0]) == saved
    kv.end_step()


def test_a_swapped_groups_cpu_blocks_are_not_reused_by_a_save_in_the_step_that_reads_them():
    cpu = CpuBlockPool(2)
    kv = KVCacheManager(4, BS, enable_prefix_caching=True, watermark=0.0, cpu_pool=cpu)
    sched = Scheduler(kv, 8, 64, True, preemption_mode="swap")
    a, b = make_seq(1, 8), make_seq(2, 7)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # (run_step ends each step: kv.end_step)
    out = run_step(sched)  # a grows into a third block: b is swapped out
    assert b.status is SequenceStatus.SWAPPED and len(out.swap_out) == 2 and cpu.num_free == 0
    sched.finish(a, SequenceStatus.FINISHED_LENGTH)  # a's 2 full blocks stay cached on the device
    out = run_step(sched)  # b comes back onto a's cached blocks, evicting them
    swapped_in = [c for c, _ in out.swap_in]
    assert len(swapped_in) == 2 and b.status is SequenceStatus.RUNNING
    # b's CPU blocks are freed by this step but read by it: a's evicted blocks find no room.
    assert not any(c in swapped_in for _, c in out.swap_out)
    assert out.swap_out == []
    assert cpu.num_used == 0  # run_step ended the step: b's CPU blocks are released


def test_swap_preemption_takes_cpu_blocks_from_the_tier():
    kv, cpu = _tier(num_blocks=4, num_cpu_blocks=2)
    sched = Scheduler(kv, 8, 64, True, preemption_mode="swap")
    cached = make_seq(0, 9)
    assert kv.allocate_slots(cached, 9)
    _computed(kv, cached, 9)
    kv.free(cached)
    filler = make_seq(1, 16)
    assert kv.allocate_slots(filler, 16)
    assert len(kv.save_evicted()) == 2
    kv.end_step()
    kv.free(filler)
    assert cpu.num_cached == 2 and cpu.num_free == 2  # cached blocks count as free
    a, b = make_seq(2, 8), make_seq(3, 7)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # (run_step ends each step: kv.end_step)
    run_step(sched)  # b swaps out into the two CPU blocks the tier held
    assert b.status is SequenceStatus.SWAPPED and cpu.num_used == 2 and cpu.num_cached == 0


# ---- the engine, end to end -------------------------------------------------------------------

@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_prefix_evicted_from_the_device_is_served_from_the_cpu_tier(tiny_llama, transport):
    first = _prompts(1, seed=5, low=100, high=100)[0]  # 6 full blocks of 16
    others = _prompts(6, seed=6, low=80, high=90)
    with LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False) as roomy:
        want = _generate(roomy, [first], max_new=8)
    with LLM(tiny_llama, kv_cache_memory=TIGHT, swap_space=0.01, kv_transport=transport,
             max_num_batched_tokens=128) as llm:
        assert llm.engine.scheduler.kv.cpu_tier_enabled
        assert _generate(llm, [first], max_new=8) == want
        _generate(llm, others, max_new=8)  # 24 device blocks: the first prompt's are evicted
        stats = llm.stats()
        assert stats["cpu_blocks_cached"] > 0 and stats["cpu_prefix_cache_hits"] == 0
        assert llm.engine.scheduler.kv.get_computed_blocks(make_seq(99, first)) == []  # gone from the device
        assert _generate(llm, [first], max_new=8) == want
        after = llm.stats()
        # All 6 full blocks came back from the CPU tier (nothing on the device held them).
        assert after["cpu_prefix_cache_hits"] == 6 * 16
        assert after["prefix_cache_hits"] - stats["prefix_cache_hits"] == 6 * 16
        _assert_all_free(llm)


def test_no_cpu_tier_without_prefix_caching_or_store(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=TIGHT, swap_space=0.01, enable_prefix_caching=False) as llm:
        assert not llm.engine.scheduler.kv.cpu_tier_enabled
        _generate(llm, _prompts(6, seed=6, low=80, high=90), max_new=4)
        assert llm.stats()["cpu_blocks_cached"] == 0
    with LLM(tiny_llama, kv_cache_memory=TIGHT) as llm:
        assert not llm.engine.scheduler.kv.cpu_tier_enabled and llm.stats()["cpu_blocks_total"] == 0


def test_a_long_tier_hit_loads_over_steps_under_the_load_budget_and_its_tail_a_token_a_step():
    """A P/D decode replica's settings: at most 2 blocks loaded per step, prompt chunks of 1
    token. The hit's 5 blocks load over 3 steps in which it computes nothing; then its 2-token
    tail, one token a step. A decode running beside it is scheduled in every step."""
    kv, cpu = _tier(num_blocks=32, num_cpu_blocks=16)
    sched = Scheduler(kv, 8, 64, True, long_prefill_token_threshold=1, max_loaded_blocks_per_step=2)
    decode = make_seq(0, 3)
    sched.add(decode)
    while not decode.output_token_ids:  # its prompt, a token a step too
        run_step(sched)
    handed_over = make_seq(1, 5 * BS + 2)
    kv._extend_hashes(handed_over, 5)
    for h in handed_over.block_hashes:  # published by a prefill replica: cached in the tier, free
        block = cpu.allocate()
        cpu.register(block, h)
        cpu.decref(block)
    sched.add(handed_over)
    loads, computed = [], []
    while not handed_over.output_token_ids:
        out = run_step(sched)
        assert (decode, 1) in out.scheduled
        loads.append(len(out.load))
        computed.append(dict((s.seq_id, n) for s, n in out.scheduled).get(1, 0))
    assert loads == [2, 2, 1, 0, 0] and computed == [0, 0, 0, 1, 1]
    assert handed_over.num_cached_prompt_tokens == 5 * BS and kv.prefix_stats.cpu_hits == 5 * BS
    for seq in (decode, handed_over):
        sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert kv.pool.num_used == 0 and cpu.num_used == 0


def test_reset_prefix_cache_forgets_both_tiers_but_never_blocks_in_use(tiny_llama):
    """vLLM's LLM.reset_prefix_cache: the next prompt is computed cold; refused (False, nothing
    forgotten) while a request holds blocks."""
    first = _prompts(1, seed=5, low=100, high=100)[0]
    others = _prompts(6, seed=6, low=80, high=90)
    with LLM(tiny_llama, kv_cache_memory=TIGHT, swap_space=0.01, max_num_batched_tokens=128) as llm:
        want = _generate(llm, [first], max_new=8)
        _generate(llm, others, max_new=8)  # the first prompt's blocks move to the CPU tier
        cached = llm.stats()
        assert cached["kv_blocks_cached"] > 0 and cached["cpu_blocks_cached"] > 0
        llm.engine.add_request("holder", None, others[0], SamplingParams(max_tokens=4))
        llm.engine.step()  # "holder" now holds device blocks
        held = llm.stats()
        assert llm.reset_prefix_cache() is False
        after = llm.stats()
        assert (after["kv_blocks_cached"], after["cpu_blocks_cached"]) == (held["kv_blocks_cached"],
                                                                          held["cpu_blocks_cached"])
        llm.engine.abort_request("holder")
        llm.engine.step()
        assert llm.reset_prefix_cache() is True
        reset = llm.stats()
        assert reset["kv_blocks_cached"] == 0 and reset["cpu_blocks_cached"] == 0
        assert _generate(llm, [first], max_new=8) == want
        assert llm.stats()["prefix_cache_hits"] == reset["prefix_cache_hits"]  # computed cold
        _assert_all_free(llm)
