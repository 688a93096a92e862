"""The AMX bf16 GEMM (kernels/cpu/amx_gemm.c), on AMX tiles or, without AMX, AVX512-BF16 dot
products (whichever this CPU has): the float64 product rounded once to bf16, over shapes that pad
their channels and K, row counts across its 12-, 16- and 32-row blocks, with a bias; and bf16
layers routed to it up to MAX_ROWS rows, to oneDNN's GEMM beyond."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import amx_gemm
from pagedserve import LLM
from workers.models import llama

pytestmark = pytest.mark.skipif(not amx_gemm.available(),
                                reason="no AMX tile unit nor AVX512-BF16 (or the kernel did not build)")


def test_it_runs_on_amx_where_the_cpu_has_it_else_on_avx512_bf16():
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    assert amx_gemm.isa() == ("amx" if "amx_bf16" in flags else "avx512_bf16")
    assert "avx512_bf16" in flags


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 100, amx_gemm.MAX_ROWS, 300])
@pytest.mark.parametrize("n, k", [(48, 64), (40, 70), (100, 576), (17, 33)])
def test_the_kernel_gives_the_exact_product_rounded_once_to_bf16(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    packed = amx_gemm.pack(w)
    assert packed.shape == (-(-n // 16) * 16, -(-k // 32) * 32)
    for b in (None, bias):
        got = amx_gemm.linear(x, packed, n, b)
        exact = x.double() @ w.double().t() + (0 if b is None else b.double())
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        # fp32 sums of exact products, rounded once: within one bf16 step of the exact value.
        step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
        assert bool(((got.double() - exact).abs() <= step + 1e-4 * k).all())


def test_bad_shapes_and_dtypes_are_refused_with_the_field_named():
    w = torch.randn(32, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        amx_gemm.pack(w.float())
    packed = amx_gemm.pack(w)
    with pytest.raises(ValueError, match="x:"):
        amx_gemm.linear(torch.randn(3, 64), packed, 32)
    with pytest.raises(ValueError, match="x:"):
        amx_gemm.linear(torch.randn(3, 96).to(torch.bfloat16), packed, 32)
    with pytest.raises(ValueError, match="bias"):
        amx_gemm.linear(torch.randn(3, 64).to(torch.bfloat16), packed, 32, torch.randn(31).to(torch.bfloat16))


def test_packed_bf16_layers_take_the_kernel_up_to_its_rows_and_onednn_beyond(tiny_llama, monkeypatch):
    llm = LLM(tiny_llama, dtype="bfloat16", kv_cache_memory=1 << 24)
    model = llm.engine.executor.worker.model
    projection = model.layers[0].mlp.gate_up_proj
    assert projection.amx_weight.dtype == torch.bfloat16 and projection.weight.is_meta
    assert model.amx_lm_head is not None
    calls = []
    kernel = amx_gemm.linear
    monkeypatch.setattr(amx_gemm, "linear", lambda x, *a: calls.append(x.shape[0]) or kernel(x, *a))
    for rows in (1, amx_gemm.MAX_ROWS, amx_gemm.MAX_ROWS + 1):
        x = torch.randn(rows, projection.in_features).to(torch.bfloat16)
        got = llama.project(x, projection)
        want = llama.onednn_linear(x, projection.packed_weight)
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -6)
    assert calls == [1, amx_gemm.MAX_ROWS]


def test_the_gemm_benchmark_times_both_kernels_on_the_models_projections(tmp_path, capsys):
    """benchmarks/bf16_gemm.py: SmolLM2's four fused projections per layer, both GEMMs timed at
    each row count asked for, written to its JSON."""
    import json
    from types import SimpleNamespace

    from benchmarks import bf16_gemm

    config = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    assert bf16_gemm.projection_shapes(config) == [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    out = tmp_path / "gemm.json"
    bf16_gemm.main(["--rows", "1", "3", "--repeats", "1", "--result-json", str(out)])
    result = json.loads(out.read_text())
    assert [r["rows"] for r in result["results"]] == [1, 3]
    assert all(r["amx_s"] > 0 and r["onednn_s"] > 0 for r in result["results"])
    if amx_gemm.isa() == "avx512_bf16":
        assert all(r["no_next_s"] > 0 for r in result["results"])
    assert result["weight_bytes"] == 30 * 2 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536)
    assert "oneDNN/ker." in capsys.readouterr().out


@pytest.mark.skipif(amx_gemm.isa() != "avx512_bf16", reason="the next pair's prefetch is the AVX512-BF16 path's")
def test_the_build_without_the_next_pairs_prefetch_gives_the_same_bits():
    """The first row tile of a pair of blocks prefetches the next pair from 3 rows: row counts below
    and from there, one tile and more, an odd last block, give bit for bit what the build without
    it gives."""
    without = amx_gemm.build_variant("-DDP_NEXT_GROUP=0")
    torch.manual_seed(3)
    for rows in (1, 2, 3, 8, 12, 13, 40):
        for n, k in [(960, 576), (48, 100)]:
            w, x = torch.randn(n, k).to(torch.bfloat16), torch.randn(rows, k).to(torch.bfloat16)
            packed = amx_gemm.pack(w)
            assert torch.equal(amx_gemm.linear(x, packed, n), amx_gemm.linear(x, packed, n, lib=without)), (rows, n)


def test_a_weight_that_is_not_contiguous_packs_as_its_contiguous_copy():
    w = torch.randn(40, 96).to(torch.bfloat16)
    x = torch.randn(3, 40).to(torch.bfloat16)
    transposed = w.t()  # [96, 40], not contiguous
    torch.testing.assert_close(amx_gemm.linear(x, amx_gemm.pack(transposed), 96),
                               amx_gemm.linear(x, amx_gemm.pack(transposed.contiguous()), 96), rtol=0, atol=0)
