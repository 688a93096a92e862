"""`kernels.get_backend`, the one place that picks the attention backend: what `auto` resolves
to, the refusals, and the cpu backend (C decodes, torch prefills) against the torch one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import cpu
from kernels.random_batch import shuffled_block_tables
from tests.test_paged_attention import _random_batch


def test_auto_takes_the_c_kernel_on_a_cpu_in_fp32_or_bf16_and_torch_otherwise():
    for dtype in (torch.float32, torch.bfloat16):
        assert kernels.get_backend("auto", "cpu", dtype).name == ("cpu" if cpu.available() else "torch")
    assert kernels.get_backend("auto", "cpu", torch.float16).name == "torch"


def test_auto_takes_triton_on_a_gpu():
    pytest.importorskip("triton")
    assert kernels.get_backend("auto", "cuda", torch.bfloat16).name == "triton"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_is_always_torch(device, dtype):
    assert kernels.get_backend("torch", device, dtype).name == "torch"


def test_unknown_names_and_unusable_combinations_raise_naming_attention_backend(monkeypatch):
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cpu, triton; got 'cuda'"):
        kernels.get_backend("cuda", "cuda", torch.bfloat16)
    for device, dtype in (("cpu", torch.float16), ("cuda", torch.float32)):
        with pytest.raises(ValueError, match="attention_backend 'cpu' needs device cpu, dtype float32 or bfloat16"):
            kernels.get_backend("cpu", device, dtype)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend 'triton' needs device cuda"):
        kernels.get_backend("triton", "cpu", torch.float32)


def test_importing_kernels_loads_no_backend():
    """Cheap to import (no torch, no triton), and no `__version__`: a Hugging Face package also
    imports as `kernels`, and transformers probes its version."""
    code = ("import sys, kernels\n"
            "assert not hasattr(kernels, '__version__')\n"
            "loaded = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton') or m.startswith('kernels.')]\n"
            "assert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]


LAYOUTS = {  # (query_lens, cached_lens)
    "mixed": ([1, 12, 1, 30, 1, 5], [40, 0, 7, 25, 90, 3]),  # decodes, fresh prefills, chunks over context
    "decodes-only": ([1, 1, 1], [15, 64, 33]),
    "prefills-only": ([9, 20], [0, 17]),
    # Speculative verify steps and P/D tails: chunks of 2-8 tokens over context (the C kernel, a
    # query per token), beside a decode and a chunk of 9 (the torch path).
    "small-chunks": ([5, 1, 2, 8, 9], [40, 7, 100, 16, 30]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("block_size", [5, 8, 16])  # 5: a last block shorter than the others
# 64 and 128: the kernel's copies with the head size fixed at compile time; 12: not a multiple of
# the 8-lane vectors
@pytest.mark.parametrize("head_dim", [16, 12, 64, 128])
def test_cpu_backend_gives_the_torch_backends_output(layout, block_size, head_dim):
    if not cpu.available():
        pytest.skip("no C compiler for the CPU decode kernel")
    query_lens, cached_lens = LAYOUTS[layout]
    results = []
    for name in ("torch", "cpu"):
        backend = kernels.get_backend(name, "cpu", torch.float32)
        gen = torch.Generator().manual_seed(block_size)  # the same batch for both
        cache, query, new_k, new_v, meta, _, _ = _random_batch(
            gen, block_size, query_lens, cached_lens, num_heads=6, num_kv_heads=2, head_dim=head_dim, backend=backend)
        assert meta.backend is backend
        backend.write_kv(new_k, new_v, cache, meta)
        results.append((cache, backend.paged_attention(query, new_k, new_v, cache, meta, scale=0.25)))
    (torch_cache, want), (cpu_cache, got) = results
    assert torch.equal(cpu_cache, torch_cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# The kernel's vector path (head sizes 64 and 128) scores 16 tokens of a block at a time and sums
# values for up to 4 (head size 128: 2) query heads of a KV head at once: query heads per KV head
# of 1, 4, 5 and 7 take every tile size and a remainder; 32-token blocks hold two groups of 16,
# and the context lengths end inside a group, on one's edge and inside a block's second group.
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (10, 2), (7, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_groups_of_heads_and_tokens(heads, block_size, head_dim, dtype):
    if not cpu.available():
        pytest.skip("no C compiler for the CPU decode kernel")
    num_heads, num_kv_heads = heads
    query_lens, cached_lens = [1, 1, 1, 1, 4], [0, 15, 47, 100, 60]
    results = []
    for name, run_dtype in (("torch", torch.float32), ("cpu", dtype)):
        backend = kernels.get_backend(name, "cpu", run_dtype)
        gen = torch.Generator().manual_seed(num_heads * block_size + head_dim)
        cache, query, new_k, new_v, meta, _, _ = _random_batch(
            gen, block_size, query_lens, cached_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, backend=backend)
        cache, query, new_k, new_v = (t.to(dtype).to(run_dtype) for t in (cache, query, new_k, new_v))
        backend.write_kv(new_k, new_v, cache, meta)
        results.append(backend.paged_attention(query, new_k, new_v, cache, meta, scale=0.125))
    want, got = results
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


# The prefill kernel's tiles: 16 query positions x the query heads of one KV head, keys 16 at a
# time. Prompts longer than a tile, fresh and over cached context, ending inside and on the edge
# of a tile and of a block; 8-token blocks (shorter than a group of 16 keys) and 32 (two groups);
# 1, 3, 4 and 8 query heads per KV head, and 9, which the kernel declines (torch's path then).
# bf16 (queries, cache and output) where the CPU has AVX512-BF16, against torch in fp32 on the same
# bf16 values: the kernel's sums are fp32, its output rounded to bf16 once.
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2), (16, 2), (9, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_kernel_tiles_of_positions_heads_and_keys(heads, block_size, head_dim, dtype):
    if not cpu.available():
        pytest.skip("no C compiler for the CPU kernels")
    if not cpu.prefill_takes(dtype):
        pytest.skip(f"the C prefill kernel takes no {dtype} on this CPU (bf16 needs AVX512-BF16)")
    num_heads, num_kv_heads = heads
    query_lens, cached_lens = [37, 16, 1, 17, 50, 9], [0, 0, 30, 33, 64, 100]
    results = []
    for name, run_dtype in (("torch", torch.float32), ("cpu", dtype)):
        backend = kernels.get_backend(name, "cpu", run_dtype)
        gen = torch.Generator().manual_seed(num_heads * block_size + head_dim)
        cache, query, new_k, new_v, meta, _, _ = _random_batch(
            gen, block_size, query_lens, cached_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, backend=backend)
        cache, query, new_k, new_v = (t.to(dtype).to(run_dtype) for t in (cache, query, new_k, new_v))
        if name == "cpu":  # the kernel takes every chunk of 9+ tokens, unless it declines the shape
            assert meta.prefill_seqs is not None and meta.prefills.groups == []
            assert meta.prefill_seqs.q_len.tolist() == [37, 16, 17, 50, 9]
        backend.write_kv(new_k, new_v, cache, meta)
        results.append(backend.paged_attention(query, new_k, new_v, cache, meta, scale=0.125))
    want, got = results
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: half a unit in the last place of values near 1-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    declined = num_heads // num_kv_heads > 8
    assert (meta.prefill_seqs is None) == declined and backend._prefill_in_c == (not declined)


def test_cpu_prefill_kernel_takes_bf16_only_with_avx512_bf16_and_a_bf16_query():
    """A bf16 cache's prompt chunks go to the C kernel where the CPU has AVX512-BF16, else torch's
    path; an fp32 query over a bf16 cache (an fp32 model with kv_cache_dtype bf16) is declined."""
    if not cpu.available():
        pytest.skip("no C compiler for the CPU kernels")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert cpu.prefill_takes(torch.bfloat16) == (" avx512_bf16" in flags)
    assert kernels.get_backend("cpu", "cpu", torch.bfloat16)._prefill_in_c == cpu.prefill_takes(torch.bfloat16)
    backend = kernels.get_backend("cpu", "cpu", torch.float32)  # its metadata holds the chunks for the kernel
    cache, query, new_k, new_v, meta, _, _ = _random_batch(
        torch.Generator().manual_seed(3), 16, [20, 12], [0, 40], num_heads=6, num_kv_heads=2, head_dim=64,
        backend=backend)
    backend.write_kv(new_k, new_v, cache, meta)
    out = torch.zeros(query.shape)
    assert not cpu.prefill_attention(out, query.contiguous(), cache.bfloat16(), meta.prefill_seqs, 0.125)
    assert torch.count_nonzero(out) == 0  # declined: nothing written


def test_cpu_prefill_kernel_keeps_the_softmax_exact_over_a_wide_range_of_scores():
    """A large scale spreads a row's scores over hundreds: the kernel's inline exponential takes
    exponents down to its floor, and the weights below it are 0 (e^-80 beside the maximum's 1)."""
    if not cpu.available():
        pytest.skip("no C compiler for the CPU kernels")
    results = []
    for name in ("torch", "cpu"):
        backend = kernels.get_backend(name, "cpu", torch.float32)
        gen = torch.Generator().manual_seed(11)
        cache, query, new_k, new_v, meta, _, _ = _random_batch(
            gen, 16, [40, 23], [0, 50], num_heads=9, num_kv_heads=3, head_dim=64, backend=backend)
        backend.write_kv(new_k, new_v, cache, meta)
        results.append(backend.paged_attention(query, new_k, new_v, cache, meta, scale=4.0))
    want, got = results
    assert backend._prefill_in_c
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prefill_attention_benchmark_compares_backends_that_agree(tmp_path, dtype):
    """benchmarks/prefill_attention.py, one call per case: both backends timed, their outputs alike
    (bf16: both round their outputs to bf16, from sums taken in different orders)."""
    if not cpu.prefill_takes(dtype):
        pytest.skip(f"the C prefill kernel takes no {dtype} here")
    from benchmarks import prefill_attention

    out = tmp_path / "prefill_attention.json"
    prefill_attention.main(["--repeats", "1", "--layers", "1", "--dtype", str(dtype).split(".")[1],
                            "--result-json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["dtype"] == str(dtype).split(".")[1]
    assert [r["case"] for r in saved["results"]] == list(prefill_attention.CASES)
    for row in saved["results"]:
        assert row["max_abs_difference"] < (1e-4 if dtype == torch.float32 else 2e-2)
        assert row["torch"]["median_ms"] > 0 and row["cpu"]["median_ms"] > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("head_dim", [64, 12])
def test_cpu_backend_on_a_bf16_cache_gives_the_fp32_result_of_the_same_values(layout, head_dim):
    """A bf16 cache: the C kernel widens K/V exactly and sums in fp32, so its decode rows match
    the torch backend run in fp32 on the very same (bf16-representable) values, to bf16's output
    rounding; prefills run torch's bf16 path, a little further off."""
    if not cpu.available():
        pytest.skip("no C compiler for the CPU decode kernel")
    query_lens, cached_lens = LAYOUTS[layout]
    results = []
    for name, dtype in (("torch", torch.float32), ("cpu", torch.bfloat16)):
        backend = kernels.get_backend(name, "cpu", dtype)
        gen = torch.Generator().manual_seed(head_dim)  # the same batch for both
        cache, query, new_k, new_v, meta, _, _ = _random_batch(
            gen, 16, query_lens, cached_lens, num_heads=6, num_kv_heads=2, head_dim=head_dim, backend=backend)
        # Values bf16 holds exactly, in the dtype of each run.
        cache, query, new_k, new_v = (t.to(torch.bfloat16).to(dtype) for t in (cache, query, new_k, new_v))
        backend.write_kv(new_k, new_v, cache, meta)
        results.append((cache, backend.paged_attention(query, new_k, new_v, cache, meta, scale=0.25)))
    (fp32_cache, want), (bf16_cache, got) = results
    assert got.dtype == torch.bfloat16
    assert torch.equal(bf16_cache.float(), fp32_cache)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_decode_kernel_on_a_bf16_cache_sums_bf16_queries_and_others_to_fp32_precision(head_dim):
    """A bf16 model's queries are bf16 values: their scores against a bf16 cache take the CPU's
    bf16 dot products where it has them (each product exact, summed in fp32); any other query
    widens each key. Both give the float64 result of the same values to fp32's precision, over
    several blocks and a last one part full."""
    if not cpu.available():
        pytest.skip("no C compiler for the CPU decode kernel")
    gen = torch.Generator().manual_seed(head_dim)
    blocks, block_size, num_heads, num_kv_heads = 12, 16, 6, 2
    cache = torch.randn(blocks, 2, block_size, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(3, 4).contiguous()
    lens = torch.tensor([64, 37, 5], dtype=torch.int32)
    exact = torch.randn(3, num_heads, head_dim, generator=gen).to(torch.bfloat16).float()
    for query in (exact, exact + 1e-3 * torch.randn(3, num_heads, head_dim, generator=gen)):
        out = torch.empty_like(query)
        cpu.decode_attention(out, query.contiguous(), cache, tables, lens, 0.125)
        for s in range(3):
            n = int(lens[s])
            rows = cache[tables[s].long()].double()  # [4, 2, block, kv_heads, head_dim]
            k, v = (rows[:, i].reshape(-1, num_kv_heads, head_dim)[:n] for i in (0, 1))
            k, v = (t.repeat_interleave(num_heads // num_kv_heads, dim=1) for t in (k, v))
            weights = torch.softmax(torch.einsum("hd,thd->ht", query[s].double(), k) * 0.125, dim=-1)
            want = torch.einsum("ht,thd->hd", weights, v)
            torch.testing.assert_close(out[s].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32, 5])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_splits_a_long_context_and_gives_each_sequence_the_same_bits_alone_or_batched(
        block_size, head_dim, dtype):
    """Contexts past 1,024 tokens run in parts (one per 1,024 tokens begun) on all threads, merged
    after: lengths on and just past the threshold and a part's size, parts unequal by a block,
    beside short contexts that stay whole. Each gives the float64 result to fp32's precision, and
    the same bits computed alone as in the batch: where a context splits depends on its length
    only."""
    if not cpu.available():
        pytest.skip("no C compiler for the CPU decode kernel")
    gen = torch.Generator().manual_seed(block_size + head_dim)
    num_heads, num_kv_heads = 9, 3
    lens = torch.tensor([1024, 1025, 2048, 2049, 3000, 5, 300], dtype=torch.int32)
    per_seq = [-(-int(n) // block_size) for n in lens]
    blocks = sum(per_seq)
    cache = torch.randn(blocks, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables, _ = shuffled_block_tables(gen, block_size, [1] * len(lens), lens.tolist(), blocks)
    query = 2 * torch.randn(len(lens), num_heads, head_dim, generator=gen)
    out = torch.empty_like(query)
    cpu.decode_attention(out, query, cache, tables, lens, 0.125)
    rep = num_heads // num_kv_heads
    for s, n in enumerate(lens.tolist()):
        rows = cache[tables[s, :per_seq[s]].long()].double()  # [blocks, 2, block, kv_heads, head_dim]
        k, v = (rows[:, i].reshape(-1, num_kv_heads, head_dim)[:n].repeat_interleave(rep, dim=1) for i in (0, 1))
        weights = torch.softmax(torch.einsum("hd,thd->ht", query[s].double(), k) * 0.125, dim=-1)
        torch.testing.assert_close(out[s].double(), torch.einsum("ht,thd->hd", weights, v), rtol=1e-5, atol=1e-5)
        alone = torch.empty_like(query[s:s + 1])
        cpu.decode_attention(alone, query[s:s + 1].contiguous(), cache, tables[s:s + 1].contiguous(), lens[s:s + 1],
                             0.125)
        assert torch.equal(alone, out[s:s + 1])
