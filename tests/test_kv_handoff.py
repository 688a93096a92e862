"""Prefill/decode handoff through the shared KV store, engine by engine (in this process, real
shared memory): a prefill engine computes a prompt's full blocks and publishes them, a decode
engine loads them as CPU-tier prefix hits, computes the tail, and decodes the tokens a colocated
engine gives. Leases, failed steps and mismatched settings are checked at the allocator level."""

from __future__ import annotations

import pytest

from coordinator.engine import LLMEngine
from coordinator.kv_handoff import HandoffStore, check_matching, open_handoff_store
from coordinator.sampling_params import SamplingParams
from pagedserve.config import EngineConfig

BLOCK = 16
ENGINE = dict(kv_cache_memory=1 << 22, distributed_executor_backend="uni", block_size=BLOCK)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    colocated = LLMEngine.from_config(EngineConfig(model=tiny_llama, **ENGINE))
    prefill = LLMEngine.from_config(EngineConfig(model=tiny_llama, **ENGINE))
    # The decode side with a pool of another size: block counts may differ.
    decode = LLMEngine.from_config(EngineConfig(model=tiny_llama, **{**ENGINE, "kv_cache_memory": 3 << 21}))
    prefill.role, decode.role = "prefill", "decode"
    handoff = open_handoff_store([prefill, decode], space_gib=1 / 64, lease_seconds=60.0)
    yield colocated, prefill, decode, handoff
    for engine in (colocated, prefill, decode):
        engine.shutdown()
    handoff.close()


def _run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams, publish: bool = False):
    engine.add_processed_request(request_id, None, prompt, params, publish_kv=publish)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final


def _prefill_only(prompt: list[int]) -> list[int]:
    """What the router sends a prefill replica: the prompt's full blocks, the last token left to
    the decode side."""
    return prompt[:(len(prompt) - 1) // BLOCK * BLOCK]


def _handoff(prefill, decode, handoff, request_id, prompt, params):
    part = _prefill_only(prompt)
    if part:
        _run(prefill, request_id + ":prefill", part, SamplingParams(temperature=0.0, max_tokens=1), publish=True)
    leased = handoff.lease_blocks(request_id + ":prefill")
    out = _run(decode, request_id, prompt, params)
    handoff.release(request_id + ":prefill")
    return out, leased


@pytest.mark.parametrize("length", [5, 16, 32, 33, 47, 80])
def test_decode_after_handoff_gives_the_colocated_tokens(engines, length):
    colocated, prefill, decode, handoff = engines
    prompt = [(31 * i + 7 * length) % 4000 + 3 for i in range(length)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = _run(colocated, f"c{length}", prompt, params)
    loaded_before = decode.metrics.pd_blocks["load"]
    got, leased = _handoff(prefill, decode, handoff, f"h{length}", prompt, params)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    full = (length - 1) // BLOCK
    assert leased == full  # every full block but one that holds the last token was handed over
    assert decode.metrics.pd_blocks["load"] - loaded_before == full
    assert got.metrics.num_cached_tokens == full * BLOCK  # the decode side computed only the tail
    for engine in (prefill, decode):
        assert engine.scheduler.kv.pool.num_used == 0
    assert handoff.pool.num_used == 0 and not handoff.leases  # cached, but nothing held


def test_parallel_samples_beams_and_seeded_sampling_through_the_handoff(engines):
    colocated, prefill, decode, handoff = engines
    prompt = [(17 * i + 5) % 3000 + 11 for i in range(41)]
    for i, params in enumerate([
            SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True),
            SamplingParams(use_beam_search=True, beam_width=3, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True, logprobs=2)]):
        expected = _run(colocated, f"cs{i}", prompt, params)
        got, leased = _handoff(prefill, decode, handoff, f"hs{i}", prompt, params)
        assert leased == 2
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]
    assert handoff.pool.num_used == 0


def test_a_prefix_cached_on_the_decode_side_or_in_the_store_is_not_published_twice(engines):
    colocated, prefill, decode, handoff = engines
    shared = [(13 * i + 1) % 2000 + 9 for i in range(48)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    _handoff(prefill, decode, handoff, "p1", shared + [5, 6, 7], params)
    published = handoff.counters.published_blocks
    reused = handoff.counters.reused_blocks
    # The same 3 blocks again, and one more: only the new block is written.
    prompt = shared + list(range(100, 120))
    expected = _run(colocated, "cp2", prompt, params)
    got, leased = _handoff(prefill, decode, handoff, "p2", prompt, params)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert leased == 4
    assert handoff.counters.published_blocks - published == 1
    assert handoff.counters.reused_blocks - reused == 3


def test_a_failed_step_registers_nothing_and_frees_what_it_allocated(engines):
    _, prefill, _, handoff = engines
    kv = prefill.scheduler.kv
    prompt = [(7 * i + 3) % 999 + 1000 for i in range(48)]
    prefill.add_processed_request("fail", None, prompt, SamplingParams(temperature=0.0, max_tokens=1), publish_kv=True)
    used = handoff.pool.num_used
    with kv.lock:
        out = prefill.scheduler.schedule()
    assert len(out.publish) == 3 and handoff.pool.num_used == used + 3
    with kv.lock:
        kv.end_step(succeeded=False)  # as EngineCore after a worker fault
    assert handoff.pool.num_used == used and "fail" not in handoff.leases
    assert handoff.cached_prefix(prefill.scheduler.groups["fail"].first.block_hashes) == 0
    prefill.abort_request("fail")
    assert kv.pool.num_used == 0


def test_a_request_waits_on_its_lease_until_decode_blocks_free_and_then_loads_them(engines, tiny_llama):
    """A decode engine of 12 blocks, 10 of them held by a running request: the handed-over request
    (3 blocks) waits, its blocks leased in the store, and once blocks free it loads them instead of
    recomputing."""
    colocated, prefill, _, handoff = engines
    small = LLMEngine.from_config(EngineConfig(model=tiny_llama, **{**ENGINE, "kv_cache_memory": 12 * 8192}))
    try:
        small.use_handoff_store(handoff)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        prompt = [(19 * i + 2) % 3000 + 40 for i in range(40)]
        expected = _run(colocated, "cw", prompt, params)
        small.add_processed_request("filler", None, [(3 * i + 1) % 3000 + 7 for i in range(10 * BLOCK - 4)],
                                    SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        small.step()
        assert small.scheduler.kv.pool.num_used == 10
        _run(prefill, "w:prefill", prompt[:32], SamplingParams(temperature=0.0, max_tokens=1), publish=True)
        small.add_processed_request("w", None, prompt, params)
        small.step()
        assert [s.request_id for s in small.scheduler.waiting] == ["w"]  # no room: it waits
        assert handoff.lease_blocks("w:prefill") == 2
        final = None
        while small.has_unfinished_requests():
            for out in small.step():
                final = out if out.request_id == "w" and out.finished else final
        handoff.release("w:prefill")
        assert final.outputs[0].token_ids == expected.outputs[0].token_ids
        assert final.metrics.num_cached_tokens == 32  # loaded from its lease
        assert small.scheduler.kv.pool.num_used == 0 and handoff.pool.num_used == 0
    finally:
        small.shutdown()


def test_an_expired_lease_means_the_decode_side_recomputes_the_prompt(engines):
    colocated, prefill, decode, handoff = engines
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [(29 * i + 3) % 3000 + 60 for i in range(50)]
    expected = _run(colocated, "ce", prompt, params)
    _run(prefill, "e:prefill", prompt[:48], SamplingParams(temperature=0.0, max_tokens=1), publish=True)
    assert handoff.lease_blocks("e:prefill") == 3
    assert handoff.expire(now=1e12) == ["e:prefill"]
    got = _run(decode, "e", prompt, params)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.metrics.num_cached_tokens == 0  # the store's copy was freed: computed in full
    assert handoff.pool.num_used == 0


def test_aborting_a_prefill_request_lets_its_lease_go_whenever_the_abort_comes(engines):
    """Before its publishing step (nothing leased) or after it (the step granted the lease): the
    abort leaves no store block held."""
    _, prefill, _, handoff = engines
    part = [(41 * i + 9) % 3000 + 80 for i in range(48)]
    prefill.add_processed_request("a1:prefill", None, part, SamplingParams(temperature=0.0, max_tokens=1),
                                  publish_kv=True)
    prefill.abort_request("a1:prefill")
    _run(prefill, "a2:prefill", part, SamplingParams(temperature=0.0, max_tokens=1), publish=True)
    assert handoff.lease_blocks("a2:prefill") == 3 and handoff.pool.num_used == 3
    prefill.abort_request("a2:prefill")  # finished already: its lease goes all the same
    assert handoff.pool.num_used == 0 and not handoff.leases
    assert prefill.scheduler.kv.pool.num_used == 0


def test_an_expired_lease_frees_the_store_copy_and_a_released_one_keeps_it_cached():
    handoff = HandoffStore(None, num_blocks=8, block_bytes=1, lease_seconds=5.0)
    pool = handoff.pool
    blocks = [pool.allocate() for _ in range(3)]
    for i, block in enumerate(blocks):
        pool.register(block, bytes([i]) * 16)
    pool.incref(blocks[1])  # each lease holds a reference (publish increfs a block the store has)
    handoff.grant("a", blocks[:2], now=100.0)
    handoff.grant("b", blocks[1:], now=103.0)  # shares block 1
    assert handoff.expire(now=104.0) == []
    assert handoff.expire(now=105.5) == ["a"]
    assert pool.lookup(bytes([0]) * 16) is None  # freed: nothing else held it
    assert pool.lookup(bytes([1]) * 16) == blocks[1]  # still leased by b
    assert handoff.release("b") and not handoff.release("b")
    assert pool.num_used == 0
    assert handoff.cached_prefix([bytes([1]) * 16, bytes([2]) * 16]) == 2  # released: cached, reusable
    assert handoff.counters.leases_expired == 1


def test_mismatched_settings_are_refused_naming_both_values():
    base = EngineConfig(kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="same block_size: prefill block_size=16, decode block_size=32"):
        check_matching(base, base.replace(block_size=32))
    with pytest.raises(ValueError, match="same dtype: prefill dtype='float32', decode dtype='bfloat16'"):
        check_matching(base, base.replace(dtype="bfloat16"))
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        check_matching(base, base.replace(enable_prefix_caching=False))


def test_pd_engine_configs_apply_each_sides_settings_and_refuse_a_mismatch():
    from coordinator.kv_handoff import pd_engine_configs

    base = EngineConfig(kv_cache_memory=1 << 22, swap_space=2.0, preemption_mode="swap")
    prefill, decode = pd_engine_configs(base, None, {"tensor_parallel_size": 2, "kv_cache_memory": 1 << 21})
    assert (prefill.tensor_parallel_size, decode.tensor_parallel_size) == (1, 2)
    assert decode.kv_cache_memory == 1 << 21 and prefill.kv_cache_memory == 1 << 22
    assert prefill.swap_space == decode.swap_space == 0.0  # they share the server's store instead
    # The decode side computes tails a token a step and spreads its loads; the prefill side does not.
    assert (decode.long_prefill_token_threshold, decode.max_loaded_blocks_per_step) == (1, 16)
    assert (prefill.long_prefill_token_threshold, prefill.max_loaded_blocks_per_step) == (0, 0)
    _, decode = pd_engine_configs(base, None, {"long_prefill_token_threshold": 0, "max_loaded_blocks_per_step": 4})
    assert (decode.long_prefill_token_threshold, decode.max_loaded_blocks_per_step) == (0, 4)
    with pytest.raises(ValueError, match="decode_config: 'colour' is not an engine setting"):
        pd_engine_configs(base, None, {"colour": 1})
    with pytest.raises(ValueError, match="prefill block_size=16, decode block_size=8"):
        pd_engine_configs(base, None, {"block_size": 8})


def test_a_decode_side_that_loads_over_steps_and_computes_its_tail_a_token_a_step_gives_colocated_tokens(
        tiny_llama, engines):
    """The P/D decode replica's defaults (prompt chunks of 1 token, a few blocks loaded per
    step), here 2 blocks a step: greedy and seeded tokens equal the colocated engine's, the
    handed-over blocks count as cached, and nothing is left held."""
    colocated = engines[0]
    prefill = LLMEngine.from_config(EngineConfig(model=tiny_llama, **ENGINE))
    decode = LLMEngine.from_config(EngineConfig(model=tiny_llama, **ENGINE, long_prefill_token_threshold=1,
                                                max_loaded_blocks_per_step=2))
    prefill.role, decode.role = "prefill", "decode"
    handoff = open_handoff_store([prefill, decode], space_gib=1 / 64, lease_seconds=60.0)
    steps = []  # (blocks loaded, the load's seconds, the step's transfer seconds) of each decode step
    execute = decode.executor.execute

    def recording(plan):
        output = execute(plan)
        steps.append((len(plan.load), output.load_seconds, output.swap_seconds))
        return output

    decode.executor.execute = recording
    try:
        for i, (length, params) in enumerate([
                (90, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
                (70, SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=8, ignore_eos=True))]):
            prompt = [(29 * j + 11 * length) % 3500 + 17 for j in range(length)]
            expected = _run(colocated, f"cl{i}", prompt, params)
            got, leased = _handoff(prefill, decode, handoff, f"hl{i}", prompt, params)
            assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]
            assert leased == (length - 1) // BLOCK
            assert got.metrics.num_cached_tokens == leased * BLOCK  # loaded, over several steps
        # Each load is timed on its own: no seconds without blocks, within the step's transfers.
        loads = [(n, load, swap) for n, load, swap in steps if n]
        assert [n for n, _, _ in loads] == [2, 2, 1, 2, 2]  # 90 tokens: 5 blocks, 70: 4; 2 a step
        assert all(0 < load <= swap for _, load, swap in loads)
        assert all(load == 0 for n, load, _ in steps if not n)
        assert decode.metrics.pd_seconds["load"].count == len(loads)
        assert decode.metrics.pd_seconds["load"].sum == pytest.approx(sum(load for _, load, _ in loads))
        for engine in (prefill, decode):
            assert engine.scheduler.kv.pool.num_used == 0
        assert handoff.pool.num_used == 0 and not handoff.leases
    finally:
        prefill.shutdown()
        decode.shutdown()
        handoff.close()


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_tp1_prefill_hands_over_to_a_tp2_decode_group(ray_session, tiny_llama, transport):
    """A decode replica of two tensor-parallel ranks (Ray worker actors) loads what a one-rank
    prefill replica wrote: the store holds blocks by KV head, not by rank. Over shared memory, and
    over the store's gRPC service (every rank a gRPC client, as on another node)."""
    ray_engine = dict(ENGINE, distributed_executor_backend="ray", worker_cpus=1)
    colocated = LLMEngine.from_config(EngineConfig(model=tiny_llama, **ENGINE))
    prefill = LLMEngine.from_config(EngineConfig(model=tiny_llama, **ENGINE))
    decode = LLMEngine.from_config(EngineConfig(model=tiny_llama, **{**ray_engine, "tensor_parallel_size": 2}))
    handoff = open_handoff_store([prefill, decode], space_gib=1 / 64, lease_seconds=60.0, transport=transport)
    try:
        assert handoff.layout.transport == transport and handoff.layout.shard_by == "kv_head"
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        for length in (17, 48, 70):
            prompt = [(23 * i + length) % 3500 + 21 for i in range(length)]
            expected = _run(colocated, f"c{length}", prompt, params)
            got, leased = _handoff(prefill, decode, handoff, f"t{length}", prompt, params)
            assert leased == (length - 1) // BLOCK
            assert got.metrics.num_cached_tokens == leased * BLOCK
            assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert decode.scheduler.kv.pool.num_used == 0 and handoff.pool.num_used == 0
    finally:
        for engine in (colocated, prefill, decode):
            engine.shutdown()
        handoff.close()
