"""kv_cache_dtype="bfloat16" under a float32 model (vLLM's --kv-cache-dtype): the cache holds K/V
rounded to bf16, half the bytes per block, and attention reads them widened and sums in fp32.
Here: the cache and the block count it buys, how close its outputs stay to an fp32 cache, that a
prompt's results do not depend on chunking, prefix hits or preemption, and the refusals."""

from __future__ import annotations

import pytest
import torch

from coordinator.kv_handoff import check_matching
from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from tests.test_kv_swap import PROMPTS, TIGHT, _assert_all_free
from tests.test_model_correctness import _generate, _prompts

LONG = _prompts(1, seed=5, low=150, high=150)[0]  # 10 blocks of 16: long enough to chunk


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return torch.tensor([entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], prompt[1:])])


@pytest.fixture(scope="module")
def bf16_expected(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=1 << 24, kv_cache_dtype="bfloat16") as llm:
        return _generate(llm, PROMPTS)


def test_a_bf16_cache_holds_twice_the_blocks_and_stays_close_to_fp32(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=1 << 22) as fp32, \
            LLM(tiny_llama, kv_cache_memory=1 << 22, kv_cache_dtype="bfloat16") as bf16:
        worker = bf16.engine.executor.worker
        assert worker.kv_cache.dtype == torch.bfloat16 and worker.dtype == torch.float32
        assert worker.attn_backend.name == fp32.engine.executor.worker.attn_backend.name
        assert bf16.stats()["kv_blocks_total"] == 2 * fp32.stats()["kv_blocks_total"]
        exact, rounded = _prompt_logprobs(fp32, LONG), _prompt_logprobs(bf16, LONG)
        # Rounding K/V to bf16 (8 bits of mantissa) moves each prompt token's logprob a little:
        # measurably, so the cache really is bf16, and far less than the logprobs spread (this
        # random model's are -4 to -19).
        diff = (exact - rounded).abs()
        assert 0 < float(diff.mean()) < 0.05 and float(diff.max()) < 0.3, diff  # measured: 0.020 and 0.118


def _continuation(llm: LLM, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, torch.tensor([entry[tok].logprob for entry, tok in zip(out.logprobs, out.token_ids)])


def test_a_bf16_cache_gives_the_same_results_chunked_or_not(tiny_llama):
    """A fresh prefill attends to its K/V rounded as the cache holds them, so a prompt computed in
    one step, in chunks over its cached part, or behind a prefix hit continues the same way."""
    with LLM(tiny_llama, kv_cache_memory=1 << 22, kv_cache_dtype="bfloat16") as whole:
        once = _continuation(whole, LONG)
        again = _continuation(whole, LONG)  # every full block of the prompt a prefix hit now
        assert whole.stats()["prefix_cache_hits"] >= len(LONG) // 16
    with LLM(tiny_llama, kv_cache_memory=1 << 22, kv_cache_dtype="bfloat16", max_num_batched_tokens=32,
             enable_prefix_caching=False) as chunked:
        in_chunks = _continuation(chunked, LONG)
    for other in (again, in_chunks):
        assert other[0] == once[0]
        torch.testing.assert_close(other[1], once[1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_bf16_sequences_finish_as_unpreempted_ones(tiny_llama, bf16_expected, mode):
    """Swapped blocks travel at the cache's dtype (half the bytes); recomputed ones are rewritten
    rounded as before: outputs equal the run without preemption."""
    with LLM(tiny_llama, kv_cache_memory=TIGHT // 2, swap_space=0.01, preemption_mode=mode,
             max_num_batched_tokens=64, kv_cache_dtype="bfloat16") as llm:
        assert llm.stats()["kv_blocks_total"] == 24  # half the bytes of test_kv_swap's 24 fp32 blocks
        assert _generate(llm, PROMPTS) == bf16_expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0
        if mode == "swap":
            assert stats["swap_out_blocks"] > 0
            assert stats["swap_out_bytes"] == stats["swap_out_blocks"] * 2 * 2 * 16 * 2 * 16 * 2
        _assert_all_free(llm)


@pytest.mark.parametrize("fields, message", [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, bfloat16; got 'fp8'"),
    ({"kv_cache_dtype": "bfloat16", "dtype": "float16"}, "kv_cache_dtype 'bfloat16' needs dtype float32 or bfloat16"),
    ({"kv_cache_dtype": "bfloat16", "device": "cuda"}, "runs on device cpu with attention_backend auto, cpu or "
                                                       "torch only .* got device 'cuda'"),
    ({"kv_cache_dtype": "bfloat16", "attention_backend": "triton"}, "attention_backend 'triton'"),
])
def test_unsupported_kv_cache_dtypes_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_prefill_and_decode_replicas_must_share_the_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype: prefill kv_cache_dtype='auto', "
                                         "decode kv_cache_dtype='bfloat16'"):
        check_matching(EngineConfig(), EngineConfig(kv_cache_dtype="bfloat16"))


def test_a_bf16_cache_hands_prompts_over_at_half_the_bytes(tiny_llama):
    """P/D with a bf16 cache on both sides: the store's blocks are bf16 too (half an fp32
    block's bytes), and the decode side continues as a colocated bf16 engine does."""
    from coordinator.engine import LLMEngine
    from coordinator.kv_handoff import open_handoff_store
    from tests.test_kv_handoff import ENGINE, _handoff, _run

    made = [LLMEngine.from_config(EngineConfig(model=tiny_llama, kv_cache_dtype=cache, **ENGINE))
            for cache in ("bfloat16", "bfloat16", "bfloat16", "auto")]
    colocated, prefill, decode, fp32 = made
    prefill.role, decode.role = "prefill", "decode"
    handoff = open_handoff_store([prefill, decode], space_gib=1 / 64, lease_seconds=60.0)
    try:
        assert handoff.block_bytes * 2 == fp32.executor.block_bytes()
        prompt = [(29 * i + 3) % 4000 + 3 for i in range(50)]
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        expected = _run(colocated, "c", prompt, params)
        got, leased = _handoff(prefill, decode, handoff, "h", prompt, params)
        assert leased == 3 and got.metrics.num_cached_tokens == 48
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert handoff.pool.num_used == 0 and decode.scheduler.kv.pool.num_used == 0
    finally:
        for engine in made:
            engine.shutdown()
        handoff.close()
