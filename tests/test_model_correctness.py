"""Greedy tokens equal transformers' generate, whatever the batch, budget, preemption or cache."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.reference import assert_same_or_near_tie, hf_greedy

MAX_NEW = 24


def _prompts(n: int, seed: int = 0, low: int = 3, high: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(low, high))] for _ in range(n)]


def _generate(llm: LLM, prompts, max_new=MAX_NEW):
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_no_leak(llm: LLM):
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert all(c == 0 for c in llm.engine.scheduler.kv.pool.ref_counts)


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2", "tiny_mistral"])
def tiny_model(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_model, hf_model):
    prompts = _prompts(12)
    return prompts, [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]


def _check(hf_model, prompts, ours, expected):
    for p, o, e in zip(prompts, ours, expected):
        assert_same_or_near_tie(hf_model, p, o, e)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_tokens_equal_transformers(tiny_model, hf_model, reference, backend):
    prompts, expected = reference
    llm = LLM(tiny_model, kv_cache_memory=1 << 24, attention_backend=backend)
    ours = _generate(llm, prompts)
    assert ours == expected  # random tiny models have no near-ties (logit gaps > 1e-2)
    _assert_no_leak(llm)


def test_same_tokens_when_a_tiny_pool_forces_preemption(tiny_model, hf_model, reference):
    prompts, expected = reference
    # 2 layers x 2 x 16 x 2 heads x 16 dims x 4 B = 8 KiB a block; 16 blocks = 256 tokens for 12 seqs.
    llm = LLM(tiny_model, kv_cache_memory=16 * 8192, enable_prefix_caching=False)
    ours = _generate(llm, prompts)
    assert llm.stats()["num_preemptions"] > 0
    _check(hf_model, prompts, ours, expected)
    _assert_no_leak(llm)


def test_same_tokens_with_prefix_cache_hits(tiny_model, hf_model):
    shared = _prompts(1, seed=7, low=70, high=70)[0]
    prompts = [shared + tail for tail in _prompts(6, seed=8, low=1, high=20)]
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    llm = LLM(tiny_model, kv_cache_memory=1 << 24, enable_prefix_caching=True)
    first = _generate(llm, prompts[:1])
    rest = _generate(llm, prompts[1:])
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 5 * 64  # 4 full blocks of the shared prefix, 5 requests
    _check(hf_model, prompts, first + rest, expected)
    _assert_no_leak(llm)


def test_same_tokens_with_chunked_prefill_on_a_tiny_budget(tiny_model, hf_model, reference):
    prompts, expected = reference
    llm = LLM(tiny_model, kv_cache_memory=1 << 24, max_num_batched_tokens=7, enable_prefix_caching=False)
    ours = _generate(llm, prompts)
    _check(hf_model, prompts, ours, expected)
    _assert_no_leak(llm)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_batch_of_one_equals_batch_of_64(tiny_model, backend):
    prompts = _prompts(64, seed=3)
    llm = LLM(tiny_model, kv_cache_memory=1 << 25, enable_prefix_caching=False, attention_backend=backend)
    batched = _generate(llm, prompts, max_new=12)
    single = [_generate(llm, [p], max_new=12)[0] for p in prompts[:8]]
    assert single == batched[:8]
    _assert_no_leak(llm)


def test_same_tokens_with_preemption_prefix_cache_and_chunking_together(tiny_model, hf_model, reference):
    prompts, expected = reference
    llm = LLM(tiny_model, kv_cache_memory=16 * 8192, max_num_batched_tokens=40, block_size=8,
              enable_prefix_caching=True)
    ours = _generate(llm, prompts)
    assert llm.stats()["num_preemptions"] > 0
    _check(hf_model, prompts, ours, expected)
    _assert_no_leak(llm)


@pytest.mark.parametrize("rows", [1, 7, 64, 96, 97, 200])
def test_the_lm_heads_chunked_product_equals_the_plain_one(rows):
    """Skinny batches compute the LM head in vocabulary chunks (workers/models/llama.py): every
    row and column of it, a last chunk shorter than the others included, equals x @ W^T."""
    from workers.models.llama import LM_HEAD_CHUNK, lm_head

    torch.manual_seed(rows)
    weight = torch.randn(2 * LM_HEAD_CHUNK + 37, 48)
    x = torch.randn(rows, 48)
    out = lm_head(x, weight)
    assert out.shape == (rows, weight.shape[0]) and out.is_contiguous()
    torch.testing.assert_close(out, x @ weight.t(), rtol=1e-5, atol=1e-4)
