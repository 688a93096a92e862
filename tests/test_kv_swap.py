"""Swap preemption through the CPU KV store (shared memory): outputs unchanged, nothing leaked."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import stat
import subprocess
import sys
import threading
import time
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import torch

from kvstore.grpc_transport import GrpcSwapSpace
from kvstore.shm_transport import ShmSwapSpace
from kvstore.store import KVStore, attach
from kvstore.swap_space import open_swap_space
from pagedserve import LLM, SamplingParams
from tests.test_model_correctness import _generate, _prompts

PROMPTS = _prompts(10, seed=21, high=60)
# 24 blocks of 16 tokens for 10 sequences of up to 84 tokens: preemption is certain.
TIGHT = 24 * 2 * 2 * 16 * 2 * 16 * 4  # blocks x layers x K/V x tokens x kv heads x head dim x fp32


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pagedserve-kv-")}


@pytest.fixture(autouse=True)
def no_leaked_segment():
    """Every store's shared-memory segment is gone once its engine is (a dead store's too)."""
    before = _segments()
    yield
    assert _segments() <= before


@pytest.fixture(scope="module")
def expected(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=1 << 24) as llm:
        return _generate(llm, PROMPTS)


def _assert_all_free(llm):
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0 and stats["num_swapped"] == 0
    assert all(c == 0 for c in llm.engine.scheduler.kv.pool.ref_counts)


@pytest.mark.parametrize("mode", ["swap", "auto", "recompute"])
def test_preempted_outputs_equal_the_unpreempted_run(tiny_llama, expected, mode):
    with LLM(tiny_llama, kv_cache_memory=TIGHT, swap_space=0.01, preemption_mode=mode,
             max_num_batched_tokens=64) as llm:
        assert llm.stats()["kv_blocks_total"] == 24
        assert _generate(llm, PROMPTS) == expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0
        if mode == "recompute":
            assert stats["swap_out_blocks"] == 0
        else:
            assert stats["swap_out_blocks"] > 0 and stats["swap_in_blocks"] == stats["swap_out_blocks"]
            assert stats["swap_out_bytes"] == stats["swap_out_blocks"] * 2 * 2 * 16 * 2 * 16 * 4
        _assert_all_free(llm)


def test_groups_swap_as_a_unit_and_keep_their_samples(tiny_llama):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:5]]
    params = [SamplingParams(n=3, seed=s, temperature=0.9, max_tokens=20, ignore_eos=True) for s in range(4)] + \
             [SamplingParams(use_beam_search=True, beam_width=3, max_tokens=12)]
    with LLM(tiny_llama, kv_cache_memory=1 << 24) as roomy:
        want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    with LLM(tiny_llama, kv_cache_memory=TIGHT, swap_space=0.01, preemption_mode="swap",
             max_num_batched_tokens=64) as tight:
        got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
        assert tight.stats()["swap_out_blocks"] > 0
        _assert_all_free(tight)
    assert got == want


def test_samples_that_cannot_all_fit_at_once_finish_under_swap(tiny_llama):
    """One request of n samples that together outgrow the pool, and nothing else running:
    swapping the group out and in again went on forever; its victim recomputes alone instead."""
    params = SamplingParams(n=6, seed=5, temperature=0.9, max_tokens=60, ignore_eos=True)  # 6 x 5 blocks > 24
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with LLM(tiny_llama, kv_cache_memory=1 << 24) as roomy:
        want = [c.token_ids for c in roomy.generate(prompt, params, use_tqdm=False)[0].outputs]
    with LLM(tiny_llama, kv_cache_memory=TIGHT, swap_space=0.01, preemption_mode="swap") as tight:
        got = [c.token_ids for c in tight.generate(prompt, params, use_tqdm=False)[0].outputs]
        assert tight.stats()["num_preemptions"] > 0
        _assert_all_free(tight)
    assert got == want


def test_swap_under_tensor_parallelism_uses_a_store_actor(ray_session, tiny_llama, expected):
    tight = TIGHT // 2  # each of the two ranks holds one of the two KV heads
    with LLM(tiny_llama, kv_cache_memory=tight, swap_space=0.01, preemption_mode="swap", tensor_parallel_size=2,
             max_num_batched_tokens=64) as llm:
        assert llm.engine.kv_store._actor is not None
        assert _generate(llm, PROMPTS) == expected
        assert llm.stats()["swap_out_blocks"] > 0
        _assert_all_free(llm)


def test_the_segment_is_owner_only_and_bad_requests_change_nothing():
    store = KVStore(num_blocks=4, tp_size=2, block_bytes=64)
    try:
        mode = stat.S_IMODE(os.stat(f"/dev/shm/{store.layout.segment}").st_mode)
        assert mode == 0o600
        cache = torch.arange(3 * 16, dtype=torch.float32).view(3, 16)  # 3 blocks of 64 bytes
        space = ShmSwapSpace(store.layout, rank=1, kv_cache=cache)
        space.swap_out([(0, 2)])
        assert store.valid_blocks([2]) == [False]  # rank 0 has not written its shard yet
        before = bytes(space._data.numpy().tobytes()), space.valid.copy()
        for bad, words in (([(0, 4)], "cpu block 4 is not in"), ([(3, 1)], "device block 3 is not in"),
                           ([(0, -1)], "cpu block -1 is not in")):
            with pytest.raises(ValueError, match=words):
                space.swap_out(bad)
        assert space._data.numpy().tobytes() == before[0] and (space.valid == before[1]).all()
        with pytest.raises(ValueError, match="rank 2 is not in"):
            ShmSwapSpace(store.layout, rank=2, kv_cache=cache)
        with pytest.raises(ValueError, match="a block shard is 64 bytes; got 32"):
            ShmSwapSpace(store.layout, rank=0, kv_cache=cache.view(6, 8))
        with pytest.raises(RuntimeError, match="never wrote"):
            space.swap_in([(3, 1)])
        space.swap_in([(2, 1)])
        assert torch.equal(cache[1], cache[0])
        space.close()
    finally:
        store.close()
    assert not os.path.exists(f"/dev/shm/{store.layout.segment}")


def test_the_segment_gets_its_memory_in_the_background_and_keeps_what_was_written():
    block_bytes = 256 << 10
    store = KVStore(num_blocks=64, tp_size=1, block_bytes=block_bytes)  # 16 MiB of blocks
    try:
        cache = torch.full((2, block_bytes // 4), 7.0)
        space = ShmSwapSpace(store.layout, rank=0, kv_cache=cache)
        space.swap_out([(0, 40), (1, 63)])  # a worker writes while the store touches its pages
        segment = f"/dev/shm/{store.layout.segment}"
        deadline = time.monotonic() + 30
        while os.stat(segment).st_blocks * 512 < store.layout.size and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.stat(segment).st_blocks * 512 >= store.layout.size  # every page has its memory
        space.close()
        out = torch.zeros_like(cache)
        reader = ShmSwapSpace(store.layout, rank=0, kv_cache=out)
        assert reader.swap_in([(40, 1), (63, 0)]) == []  # checksums hold: nothing was overwritten
        assert (out == 7.0).all()
        reader.close()
    finally:
        store.close()
    touching = [t for t in threading.enumerate() if t.name == "kvstore-touch"]
    for thread in touching:
        thread.join(5)
    assert not any(t.is_alive() for t in touching)


def test_a_store_closed_while_it_touches_its_pages_closes_cleanly(monkeypatch):
    """close() right after start: the toucher still holds a view of the segment. Closing the
    mapping under it failed, and SharedMemory.__del__ failed again later (an exception Python can
    only print); close() now waits for the toucher."""
    failures = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: failures.append(u.exc_value))
    for _ in range(3):
        store = KVStore(num_blocks=128, tp_size=1, block_bytes=1 << 20)  # 128 MiB: touching takes a while
        store.close()
        assert not store._toucher.is_alive()
        del store
        gc.collect()
    assert failures == []


@pytest.mark.parametrize("transport, kind", [("shm", ShmSwapSpace), ("grpc", GrpcSwapSpace)])
def test_open_swap_space_takes_the_stores_transport(transport, kind):
    store = KVStore(num_blocks=4, tp_size=1, block_bytes=64, transport=transport)
    try:
        cache = torch.arange(3 * 16, dtype=torch.float32).view(3, 16)  # 3 blocks of 64 bytes
        space = open_swap_space(store.layout, rank=0, kv_cache=cache)
        assert type(space) is kind
        space.swap_out([(1, 3)])
        space.finish()
        assert store.valid_blocks([3]) == [True]
        space.swap_in([(3, 0)])
        space.finish()
        assert torch.equal(cache[0], cache[1]) and store.valid_blocks([3]) == [False]
        space.close()
    finally:
        store.close()
    with pytest.raises(ValueError, match="kv_transport must be shm or grpc; got 'rdma'"):
        open_swap_space(dataclasses.replace(store.layout, transport="rdma"), 0, cache)


_ATTACH_AND_EXIT = """
import json, sys
from multiprocessing import resource_tracker
from kvstore.store import StoreLayout, attach
shm, valid, data = attach(StoreLayout(**json.loads(sys.argv[1])))
data[2, 0, :] = 7
valid[2, 0] = 1
del valid, data
shm.close()
resource_tracker._resource_tracker._stop()  # its tracker is done (and would have unlinked) now
"""


def test_only_the_store_removes_its_segment(monkeypatch):
    """Attaching registers the segment with the process's resource tracker, which unlinks what it
    holds when the process ends: the store's process keeps that registration (the store's unlink
    drops it), every other process drops its own, so the segment lasts exactly as long as the store."""
    store = KVStore(num_blocks=4, tp_size=1, block_bytes=64)
    path = f"/dev/shm/{store.layout.segment}"
    try:
        assert store.layout.owner_pid == os.getpid()
        dropped = []
        with monkeypatch.context() as m:
            m.setattr(resource_tracker, "unregister", lambda name, rtype: dropped.append(name))
            for layout in (store.layout, dataclasses.replace(store.layout, owner_pid=os.getpid() + 1)):
                shm, valid, data = attach(layout)
                del valid, data
                shm.close()
        assert dropped == ["/" + store.layout.segment]  # only as a process that is not the owner
        assert os.path.exists(path)

        # A worker's process (its own resource tracker, as a Ray worker has) writes a shard and ends.
        repo = str(Path(__file__).resolve().parent.parent)
        subprocess.run([sys.executable, "-c", _ATTACH_AND_EXIT, json.dumps(dataclasses.asdict(store.layout))],
                       check=True, cwd=repo, env={**os.environ, "PYTHONPATH": repo}, timeout=60)
        assert os.path.exists(path)
        assert store.valid_blocks([2]) == [True] and (store._data[2, 0] == 7).all()
    finally:
        store.close()
    assert not os.path.exists(path)


def test_a_killed_store_loses_nothing_and_is_restarted(ray_session, tiny_llama, expected):
    import ray

    with LLM(tiny_llama, kv_cache_memory=TIGHT, swap_space=0.01, preemption_mode="swap",
             distributed_executor_backend="ray", max_num_batched_tokens=64) as llm:
        engine = llm.engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), None, prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        while not engine.scheduler.swapped:
            engine.step()
        old = engine.kv_store
        ray.kill(old._actor)  # the store dies with groups swapped out
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
        assert [outputs[str(i)] for i in range(len(PROMPTS))] == expected
        stats = llm.stats()
        assert stats["kv_store_restarts"] == 1 and engine.kv_store is not old and engine.kv_store.alive()
        _assert_all_free(llm)


def test_a_full_store_falls_back_to_recompute(tiny_llama, expected):
    block = 2 * 2 * 16 * 2 * 16 * 4
    swap_gib = 3 * block / (1 << 30)  # room for 3 blocks only
    with LLM(tiny_llama, kv_cache_memory=TIGHT, swap_space=swap_gib, preemption_mode="swap",
             max_num_batched_tokens=64) as llm:
        assert llm.stats()["cpu_blocks_total"] == 3
        assert _generate(llm, PROMPTS) == expected
        stats = llm.stats()
        # Victims that fit the store swapped; the rest (bigger than what is left) recomputed.
        swapped = llm.engine.scheduler.num_swap_preemptions
        assert 0 < swapped < stats["num_preemptions"]
        _assert_all_free(llm)


@pytest.mark.parametrize("tp", [1, 2])
def test_swap_over_grpc_gives_the_same_outputs(ray_session, tiny_llama, expected, tp):
    with LLM(tiny_llama, kv_cache_memory=TIGHT // tp, swap_space=0.01, preemption_mode="swap", kv_transport="grpc",
             tensor_parallel_size=tp, max_num_batched_tokens=64) as llm:
        assert llm.engine.kv_store.layout.transport == "grpc"
        assert _generate(llm, PROMPTS) == expected
        stats = llm.stats()
        assert stats["swap_out_blocks"] > 0 and stats["swap_in_blocks"] == stats["swap_out_blocks"]
        _assert_all_free(llm)


def test_bad_grpc_store_requests_are_refused_and_change_nothing():
    import grpc
    import msgpack

    from kvstore.grpc_transport import store_channel
    from pagedserve.v1 import kvstore_pb2, kvstore_pb2_grpc

    store = KVStore(num_blocks=4, tp_size=2, block_bytes=64, transport="grpc")
    try:
        stub = kvstore_pb2_grpc.KVStoreStub(store_channel(store.layout))
        data_before, valid_before = store._data.copy(), store._valid.copy()

        def put(*chunks):
            return stub.PutBlocks(iter([kvstore_pb2.BlockChunk(header=h, data=d) for h, d in chunks]))

        def header(block=0, offset=0, length=64, rank=0):
            return msgpack.packb({"rank": rank, "pieces": [[block, offset, length]]})

        cases = [((header(block=4), b"x" * 64),), "cpu block 4 is not in [0, 4)",
                 ((header(rank=2), b"x" * 64),), "rank 2 is not in [0, 2)",
                 ((header(offset=32), b"x" * 64),), "fall outside a 64-byte shard",
                 ((header(length=32), b"x" * 32),), "incomplete: 32 of 64 bytes",
                 ((header(), b"x" * 32),), "longer than its data",
                 ((header(length=32), b"x" * 64),), "data is longer than its pieces",
                 ((b"\xc1not msgpack", b"x" * 64),), "malformed msgpack",
                 ((msgpack.packb([1, 2]), b"x" * 64),), "expected a map"]
        for chunks, words in zip(cases[::2], cases[1::2]):
            with pytest.raises(grpc.RpcError) as err:
                put((header(block=1), b"y" * 64), *chunks)  # a good shard first: not written either
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
        assert (store._data == data_before).all() and (store._valid == valid_before).all()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.GetBlocks(kvstore_pb2.GetRequest(manifest=msgpack.packb({"blocks": [1], "rank": 0}))))
        assert "holds no shard" in err.value.details()
        assert put((header(block=3, rank=1), b"z" * 64)).blocks == 1
        got = list(stub.GetBlocks(kvstore_pb2.GetRequest(manifest=msgpack.packb({"blocks": [3], "rank": 1}))))
        assert b"".join(c.data for c in got) == b"z" * 64
    finally:
        store.close()


def test_store_chunks_are_protobuf_wire_bytes_and_malformed_ones_are_refused():
    import grpc
    import msgpack

    from kvstore.grpc_transport import decode_chunk, encode_chunk, store_channel
    from pagedserve.v1 import kvstore_pb2

    header, parts = b"h" * 300, [b"a" * 30000, b"b" * 40000]
    wire = kvstore_pb2.BlockChunk(header=header, data=b"".join(parts)).SerializeToString()
    assert encode_chunk(header, parts) == wire
    got_header, got_data = decode_chunk(wire)
    assert got_header == header and bytes(got_data) == b"".join(parts)
    # Fields in another order, and an unknown field, as any protobuf writer may send them.
    reordered = (kvstore_pb2.BlockChunk(data=b"xy").SerializeToString() + b"\x18\x07"
                 + kvstore_pb2.BlockChunk(header=b"h").SerializeToString())
    assert decode_chunk(reordered)[0] == b"h" and bytes(decode_chunk(reordered)[1]) == b"xy"
    for bad in (b"\x0a\x05ab", b"\x0a", b"\x0b\x01", b"\x0a" + b"\xff" * 11):
        with pytest.raises(ValueError):
            decode_chunk(bad)

    store = KVStore(num_blocks=2, tp_size=1, block_bytes=64, transport="grpc")
    try:
        channel = store_channel(store.layout)
        put = channel.stream_unary("/pagedserve.v1.KVStore/PutBlocks", request_serializer=None,
                                   response_deserializer=kvstore_pb2.PutReply.FromString)
        before = store._data.copy()
        with pytest.raises(grpc.RpcError) as err:
            put(iter([b"\x0a\x05ab"]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "past the end" in err.value.details()
        assert (store._data == before).all() and not store._valid.any()
        one = msgpack.packb({"rank": 0, "pieces": [[1, 0, 64]]})
        with pytest.raises(grpc.RpcError) as err:
            put(iter([encode_chunk(one, [b"q" * 64]), encode_chunk(one, [b"r" * 64])]))
        assert "expected 64 (pieces in order, once)" in err.value.details()
        overlapping = msgpack.packb({"rank": 0, "pieces": [[1, 0, 32], [1, 0, 32]]})
        with pytest.raises(grpc.RpcError) as err:
            put(iter([encode_chunk(overlapping, [b"q" * 64])]))
        assert "piece at byte 0, expected 32" in err.value.details()
        assert put(iter([encode_chunk(one, [b"q" * 64])])).blocks == 1
        # A CPU prefix-tier read keeps the block valid; a swap-in releases it.
        get = channel.unary_stream("/pagedserve.v1.KVStore/GetBlocks",
                                   request_serializer=kvstore_pb2.GetRequest.SerializeToString,
                                   response_deserializer=kvstore_pb2.BlockChunk.FromString)
        for release, valid_after in ((False, True), (True, False)):
            manifest = msgpack.packb({"blocks": [1], "rank": 0, "release": release})
            chunks = list(get(kvstore_pb2.GetRequest(manifest=manifest)))
            assert b"".join(c.data for c in chunks) == b"q" * 64
            assert bool(store._valid[1, 0]) is valid_after
        channel.close()
    finally:
        store.close()


def test_the_grpc_store_refuses_callers_without_its_secret():
    import dataclasses

    import grpc
    import msgpack

    from kvstore.grpc_transport import store_channel
    from pagedserve.v1 import kvstore_pb2, kvstore_pb2_grpc

    store = KVStore(num_blocks=2, tp_size=1, block_bytes=64, transport="grpc")
    try:
        layout = store.layout
        assert layout.grpc_address.startswith("127.0.0.1:") and len(layout.secret) >= 32
        assert layout.secret not in repr(layout)
        header = msgpack.packb({"rank": 0, "pieces": [[1, 0, 64]]})
        chunk = kvstore_pb2.BlockChunk(header=header, data=b"x" * 64)
        get = kvstore_pb2.GetRequest(manifest=msgpack.packb({"blocks": [1], "rank": 0}))
        wrong = dataclasses.replace(layout, secret="not-the-secret")
        for channel in (grpc.insecure_channel(layout.grpc_address), store_channel(wrong)):
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            for call in (lambda: stub.PutBlocks(iter([chunk])), lambda: list(stub.GetBlocks(get))):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            channel.close()
        assert not store._valid.any() and not store._data.any()  # nothing written
        stub = kvstore_pb2_grpc.KVStoreStub(store_channel(layout))
        assert stub.PutBlocks(iter([chunk])).blocks == 1
    finally:
        store.close()
