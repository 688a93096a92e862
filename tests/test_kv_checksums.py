"""Checksums of the KV store's block shards: written at swap-out, checked by the rank that reads
the shard back. A block corrupted in the store (bytes flipped in its shared-memory segment, as
a real fault would) is counted, recomputed and never served."""

from __future__ import annotations

import logging

import msgpack
import numpy as np
import pytest
import torch

from coordinator.scheduler import Scheduler
from coordinator.sequence import SequenceStatus
from coordinator.stats import IterationStats
from kvstore.store import KVStore, attach
from kvstore.swap_space import open_swap_space
from pagedserve import LLM, SamplingParams
from tests.test_cpu_prefix_tier import _computed, _tier
from tests.test_kv_swap import PROMPTS, TIGHT, _assert_all_free, expected  # noqa: F401 (a fixture)
from tests.test_model_correctness import _generate, _prompts
from tests.test_scheduler import assert_no_leak, make_seq, run_step
from workers.executor import merge_rank_outputs
from workers.step_plan import StepOutput


def _flip_byte(layout, cpu_block: int, rank: int = 0) -> None:
    """Corrupt one byte of a shard where it lives: in the store's shared-memory segment."""
    shm, valid, data = attach(layout)
    data[cpu_block, rank, 7] ^= 0xFF
    del valid, data
    shm.close()


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_shard_corrupted_in_the_store_fails_its_checksum_and_a_clean_one_passes(transport):
    store = KVStore(num_blocks=4, tp_size=2, block_bytes=64, transport=transport)
    try:
        caches = [torch.randn(3, 16) for _ in range(2)]  # each rank: 3 blocks of 64 bytes
        originals = [cache.clone() for cache in caches]
        spaces = [open_swap_space(store.layout, rank, cache) for rank, cache in enumerate(caches)]
        for space in spaces:
            space.swap_out([(0, 1), (2, 3)])
            space.finish()
        _flip_byte(store.layout, cpu_block=3, rank=1)
        # A prefix-tier read (release=False) reports it and leaves the shard in the store...
        assert spaces[1].swap_in([(1, 1), (3, 0)], release=False) == [3]
        assert store.valid_blocks([1, 3]) == [True, True]
        # ...a swap-in too; each rank checks its own shard only: rank 0's are intact.
        assert spaces[0].swap_in([(1, 1), (3, 0)]) == []
        assert torch.equal(caches[0][1], originals[0][0]) and torch.equal(caches[0][0], originals[0][2])
        assert spaces[1].swap_in([(1, 1), (3, 0)]) == [3]
        assert torch.equal(caches[1][1], originals[1][0])
        assert not torch.equal(caches[1][0], originals[1][2])  # copied, but reported: never used
        for space in spaces:
            space.close()
    finally:
        store.close()


def test_the_grpc_store_keeps_the_writers_checksum_or_takes_its_own():
    import grpc

    from kvstore.grpc_transport import encode_chunk, store_channel
    from pagedserve.v1 import kvstore_pb2

    store = KVStore(num_blocks=4, tp_size=1, block_bytes=64, transport="grpc")
    try:
        channel = store_channel(store.layout)
        put = channel.stream_unary("/pagedserve.v1.KVStore/PutBlocks", request_serializer=None,
                                   response_deserializer=kvstore_pb2.PutReply.FromString)
        shard = bytes(range(64))
        # Without a checksum (any protobuf client): the store's own. With a wrong one: kept, and
        # the reader finds the mismatch.
        for block, extra in ((1, {}), (2, {"checksums": [[2, 12345]]})):
            header = msgpack.packb({"rank": 0, "pieces": [[block, 0, 64]], **extra})
            assert put(iter([encode_chunk(header, [shard])])).blocks == 1
        stray = msgpack.packb({"rank": 0, "pieces": [[1, 0, 64]], "checksums": [[3, 1]]})
        with pytest.raises(grpc.RpcError) as err:
            put(iter([encode_chunk(stray, [shard])]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "whose shard was not sent" in err.value.details()
        channel.close()
        cache = torch.zeros(2, 16)
        space = open_swap_space(store.layout, 0, cache)
        assert space.swap_in([(1, 0), (2, 1)]) == [2]
        assert cache[0].numpy().tobytes() == shard
        space.close()
    finally:
        store.close()


def test_every_ranks_corrupt_blocks_reach_the_coordinator():
    rank0 = StepOutput([7], np.array([42]), corrupt_cpu_blocks=[5])
    rank1 = StepOutput([], np.zeros(0, dtype=np.int64), corrupt_cpu_blocks=[3, 5])
    merged = merge_rank_outputs([rank0, rank1])
    assert merged.seq_ids == [7] and merged.token_ids.tolist() == [42]
    assert merged.corrupt_cpu_blocks == [3, 5]


def test_a_prefix_load_that_fails_its_checksum_discards_the_step_and_recomputes(caplog):
    kv, cpu = _tier(num_blocks=4, num_cpu_blocks=8)
    sched = Scheduler(kv, 8, 64, True)
    a = make_seq(0, 9)  # 2 full blocks, saved to the CPU tier once evicted
    assert kv.allocate_slots(a, 9)
    _computed(kv, a, 9)
    kv.free(a)
    filler = make_seq(1, 16)
    assert kv.allocate_slots(filler, 16)
    assert len(kv.save_evicted()) == 2
    kv.end_step()
    kv.free(filler)

    again = make_seq(2, a.token_ids[:9])
    sched.add(again)
    out = sched.schedule()
    (good, good_device), (bad, bad_device) = out.load
    assert out.scheduled == [(again, 1)]
    kv.end_step()  # as the engine: before update_from_output
    stats = IterationStats()
    with caplog.at_level(logging.WARNING, logger="coordinator.scheduler"):
        updates = sched.update_from_output(out, StepOutput([again.seq_id], np.array([777]),
                                                           corrupt_cpu_blocks=[bad]), stats)
    assert updates == []  # the token sampled on bad data is neither appended nor streamed
    assert again.token_ids == a.token_ids[:9] and again.status is SequenceStatus.WAITING
    assert again.block_table == [] and again.num_computed_tokens == 0 and sched.waiting[0] is again
    assert stats.kv_checksum_failures == 1 and "req-2" in caplog.text
    # Neither tier serves the bad block again; the good one stays cached in both.
    assert cpu.lookup(again.block_hashes[1]) is None and cpu.lookup(again.block_hashes[0]) == good
    assert kv.pool.lookup(again.block_hashes[1]) is None
    assert kv.pool.lookup(again.block_hashes[0]) == good_device

    out = run_step(sched, sampled=5)  # block 0 from the device cache, block 1 recomputed
    assert out.load == [] and out.scheduled == [(again, 5)]
    assert again.token_ids == a.token_ids[:9] + [5]
    sched.finish(again, SequenceStatus.FINISHED_LENGTH)
    assert_no_leak(kv)
    assert cpu.num_used == 0


def _corrupt_swapped_blocks(engine, rank: int = 0) -> set[int]:
    blocks = {c for group in engine.scheduler.swapped for seq in group for c in seq.cpu_block_table}
    for c in blocks:
        _flip_byte(engine.kv_store.layout, c, rank)
    return blocks


def _run_corrupting_swaps(llm, rank: int = 0) -> tuple[list, set[int]]:
    """Greedy outputs of PROMPTS, with every block of the first groups swapped out corrupted in
    the store before they come back."""
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), None, prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    outputs, corrupted = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if not corrupted and engine.scheduler.swapped:
            corrupted = _corrupt_swapped_blocks(engine, rank)
    return [outputs[str(i)] for i in range(len(PROMPTS))], corrupted


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_swapped_block_corrupted_in_the_store_is_recomputed_not_served(tiny_llama, expected, transport, caplog):
    with LLM(tiny_llama, kv_cache_memory=TIGHT, swap_space=0.01, preemption_mode="swap", kv_transport=transport,
             max_num_batched_tokens=64) as llm:
        with caplog.at_level(logging.WARNING, logger="coordinator.scheduler"):
            got, corrupted = _run_corrupting_swaps(llm)
        assert got == expected
        stats = llm.stats()
        assert corrupted and stats["kv_checksum_failures_total"] == len(corrupted)
        assert "failed their checksum; recomputing request(s)" in caplog.text
        _assert_all_free(llm)


def test_a_prefix_block_corrupted_in_the_cpu_tier_is_recomputed_not_served(tiny_llama):
    first = _prompts(1, seed=5, low=100, high=100)[0]  # 6 full blocks of 16
    others = _prompts(6, seed=6, low=80, high=90)
    with LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False) as roomy:
        want = _generate(roomy, [first], max_new=8)
    with LLM(tiny_llama, kv_cache_memory=TIGHT, swap_space=0.01, max_num_batched_tokens=128) as llm:
        kv = llm.engine.scheduler.kv
        _generate(llm, [first], max_new=8)
        _generate(llm, others, max_new=8)  # the first prompt's blocks go to the CPU tier
        probe = make_seq(99, first)
        tier = kv.get_cpu_tier_blocks(probe, 0)
        assert len(tier) == 6 and kv.get_computed_blocks(probe) == []
        _flip_byte(llm.engine.kv_store.layout, tier[2])
        assert _generate(llm, [first], max_new=8) == want
        stats = llm.stats()
        assert stats["kv_checksum_failures_total"] == 1
        assert kv.cpu_pool.lookup(probe.block_hashes[2]) is None  # dropped from the tier
        assert kv.cpu_pool.lookup(probe.block_hashes[1]) == tier[1]
        _assert_all_free(llm)


def test_a_shard_corrupted_on_one_rank_under_tensor_parallelism_is_caught(ray_session, tiny_llama, expected):
    with LLM(tiny_llama, kv_cache_memory=TIGHT // 2, swap_space=0.01, preemption_mode="swap",
             tensor_parallel_size=2, max_num_batched_tokens=64) as llm:
        got, corrupted = _run_corrupting_swaps(llm, rank=1)  # rank 0's shards stay intact
        assert got == expected
        assert corrupted and llm.stats()["kv_checksum_failures_total"] == len(corrupted)
        _assert_all_free(llm)
