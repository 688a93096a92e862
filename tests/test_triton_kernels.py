"""Triton write_kv and paged attention against the torch reference, on the CPU under
TRITON_INTERPRET=1 (on a GPU machine they run compiled): prefills over cached context, fresh
prefills and decodes in one step, block sizes 8/16/32, GQA, fp32/bf16/fp16, split-K decodes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest.py has set TRITON_INTERPRET=1 before this

import kernels  # noqa: E402
from kernels import triton as tk  # noqa: E402
from kernels.random_batch import shuffled_block_tables  # noqa: E402
from pagedserve import LLM  # noqa: E402
from tests.test_model_correctness import _generate, _prompts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REFERENCE = kernels.get_backend("torch", "cpu", torch.float32)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _step(query_lens, context_lens, block_size, num_blocks, seed=0):
    """Block tables (shuffled physical blocks) and the slots of the step's new tokens."""
    tables, slots = shuffled_block_tables(torch.Generator().manual_seed(seed), block_size, query_lens, context_lens,
                                          num_blocks)
    return tables, torch.tensor(slots, dtype=torch.int64)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


CASES = [  # (query_lens, context_lens): fresh prefill, prefill chunk over context, decodes
    ([9, 5, 1, 1, 1], [9, 37, 1, 40, 70]),
    ([17, 1], [50, 130]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_write_kv_and_attention_match_the_reference(dtype, block_size, case):
    query_lens, context_lens = CASES[case]
    heads, kv_heads, head_dim = 4, 2, 16
    num_blocks = 40
    tables, slots = _step(query_lens, context_lens, block_size, num_blocks, seed=case)
    g = torch.Generator().manual_seed(100 + case)
    cache = torch.randn((num_blocks, 2, block_size, kv_heads, head_dim), generator=g).to(dtype)
    num_tokens = sum(query_lens)
    qkv = torch.randn((num_tokens, (heads + 2 * kv_heads) * head_dim), generator=g).to(dtype)
    # Views of one projection, as the model hands them over.
    query = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
    key = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    value = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
    q_lens, c_lens = torch.tensor(query_lens, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32)

    ref_meta = REFERENCE.build_metadata(q_lens, c_lens, tables, slots, block_size)
    ref_cache = cache.clone()
    REFERENCE.write_kv(key, value, ref_cache, ref_meta)
    want = REFERENCE.paged_attention(query, key, value, ref_cache, ref_meta, scale=head_dim ** -0.5)

    dev = lambda t: t.to(DEVICE)  # noqa: E731
    tri_cache = dev(cache.clone())
    meta = tk.build_metadata(q_lens, c_lens, tables, slots, DEVICE)
    tk.write_kv(dev(key), dev(value), tri_cache, meta.slot_mapping)
    assert torch.equal(tri_cache.cpu(), ref_cache)  # every slot written, nothing else touched
    for kernel in tk.attention.DECODE_KERNELS:
        for splits in (1, 3):
            meta.num_splits, meta.decode_kernel = splits, kernel
            got = tk.paged_attention(dev(query), tri_cache, meta, scale=head_dim ** -0.5).cpu()
            assert not got.float().isnan().any()
            assert _relative_error(got, want) < TOLERANCE[dtype], (kernel, splits, _relative_error(got, want))


def test_padding_slots_write_nothing_and_a_non_power_of_two_head_dim_works():
    block_size, kv_heads, head_dim, heads = 16, 1, 24, 3  # GQA 3:1, head_dim padded to 32 inside
    cache = torch.randn((8, 2, block_size, kv_heads, head_dim))
    key, value = torch.randn((3, kv_heads, head_dim)), torch.randn((3, kv_heads, head_dim))
    before = cache.clone()
    slots = torch.tensor([5, -1, 40])  # a padding token in the middle
    tk.write_kv(key, value, cache, slots)
    assert torch.equal(cache[0, 0, 5], key[0]) and torch.equal(cache[2, 1, 8], value[2])
    changed = (cache != before).flatten(2).any(-1)  # [blocks, K/V] slabs touched
    assert int(changed.sum()) == 4  # K and V of two tokens
    tables, slots = _step([1, 6], [30, 6], block_size, 8, seed=3)
    query = torch.randn((7, heads, head_dim))
    k_new, v_new = torch.randn((7, kv_heads, head_dim)), torch.randn((7, kv_heads, head_dim))
    q_lens, c_lens = torch.tensor([1, 6]), torch.tensor([30, 6])
    ref_meta = REFERENCE.build_metadata(q_lens, c_lens, tables, slots, block_size)
    REFERENCE.write_kv(k_new, v_new, cache, ref_meta)
    want = REFERENCE.paged_attention(query, k_new, v_new, cache, ref_meta, scale=0.2)
    got = tk.paged_attention(query, cache, tk.build_metadata(q_lens, c_lens, tables, slots, "cpu"), scale=0.2)
    assert _relative_error(got, want) < 1e-4


def test_split_count_grows_with_context_while_the_grid_is_small():
    assert tk.attention.choose_num_splits(1, 8, 100) == 1  # short context: no split
    assert tk.attention.choose_num_splits(1, 8, 8192) == 16  # one long decode: many splits
    assert tk.attention.choose_num_splits(64, 8, 8192) == 1  # enough programs already


def test_a_model_on_the_triton_backend_gives_the_torch_backends_tokens(tiny_llama):
    """The whole engine on the Triton kernels: fresh prefills, chunks over cached context (a
    32-token budget), prefix-cache hits and decodes give the torch backend's greedy tokens."""
    prompts = _prompts(4, seed=3, low=20, high=50)
    prompts.append(prompts[0] + [7, 8, 9])  # shares its first blocks with the first prompt
    with LLM(tiny_llama, kv_cache_memory=1 << 22, attention_backend="torch") as llm:
        want = _generate(llm, prompts, max_new=6)
    with LLM(tiny_llama, kv_cache_memory=1 << 22, attention_backend="triton", max_num_batched_tokens=32) as llm:
        assert llm.engine.executor.worker.attn_backend.name == "triton"
        assert _generate(llm, prompts, max_new=6) == want



def test_the_kernels_compile_for_hopper():
    """The interpreter runs code the compiler refuses, and never sees registers or shared memory:
    benchmarks/gpu/compile_check.py compiles every kernel for sm_90 (as an H100/H200 runs it) in
    a process of its own (the compiler needs triton imported without TRITON_INTERPRET)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "compile_check.py"
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    compiled = [line for line in done.stdout.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == 16, done.stdout  # 4 kernels x bf16/fp32 x 2 head layouts
