"""fp32 linear layers on a GEMM with weights packed once (`pack_weights`: MKL's packed GEMM where
torch exports it, else oneDNN's; both are tested where both are there): above
F32_KERNEL_ROWS rows the packed copy, at a decode's few rows the C kernel on the plain weight,
which fp32 keeps beside it. The routing, its results against torch's, and an fp32 engine whose
layers and LM head carry both (its greedy tokens against transformers are
tests/test_model_correctness.py's and tests/test_smollm2.py's, which now run through it)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import mkl_packed
from pagedserve import LLM, SamplingParams
from workers.models import llama

pytestmark = pytest.mark.skipif(not llama.PACK_F32, reason="torch has no packed fp32 GEMM here")

PACKINGS = {"mkl": mkl_packed.PackedWeight, "onednn": torch.ops.mkldnn._reorder_linear_weight}
if not mkl_packed.available():
    del PACKINGS["mkl"]
if not llama._mkldnn_f32():
    del PACKINGS["onednn"]


def _count_calls(monkeypatch, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(llama, name)
    monkeypatch.setattr(llama, name, lambda x, *args: calls.append(x.shape[0]) or original(x, *args))
    return calls


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("tokens", [1, 4, 5, 17, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_rows_above_the_kernels_take_the_packed_weight(tokens, with_bias, packing, monkeypatch):
    onednn = _count_calls(monkeypatch, "packed_linear")
    kernel = _count_calls(monkeypatch, "f32_linear")
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 96)
    w = torch.randn(80, 96)
    bias = torch.randn(80) if with_bias else None
    got = llama.linear(x, w, bias, packed=PACKINGS[packing](w))
    assert onednn == ([tokens] if tokens > llama.F32_KERNEL_ROWS else [])
    assert kernel == ([tokens] if tokens <= llama.F32_KERNEL_ROWS else [])
    assert got.dtype == torch.float32 and got.shape == (tokens, 80)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    # Unpacked, the same rows never reach oneDNN's packed path.
    onednn.clear()
    torch.testing.assert_close(llama.linear(x, w, bias), got, rtol=1e-5, atol=1e-5)
    assert onednn == []


@pytest.mark.parametrize("packing", PACKINGS)
def test_a_strided_input_gives_the_same_result(packing):
    """The attention's output and the weight-major GEMM's are views."""
    torch.manual_seed(0)
    x = torch.randn(96, 33).t()  # [33, 96], not contiguous
    w = torch.randn(80, 96)
    got = llama.linear(x, w, packed=PACKINGS[packing](w))
    torch.testing.assert_close(got, x.contiguous() @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("tokens", [1, 4, 5, 64])
def test_the_lm_head_takes_its_packed_copy_above_the_kernels_rows(tokens, packing, monkeypatch):
    onednn = _count_calls(monkeypatch, "packed_linear")
    torch.manual_seed(tokens)
    x, w = torch.randn(tokens, 64), torch.randn(3000, 64)
    got = llama.lm_head(x, w, PACKINGS[packing](w))
    assert onednn == ([tokens] if tokens > llama.F32_KERNEL_ROWS else [])
    assert got.is_contiguous() and got.shape == (tokens, 3000)
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-4)


def test_an_fp32_engine_packs_every_linear_layer_and_keeps_the_plain_weights(tiny_llama, monkeypatch):
    onednn = _count_calls(monkeypatch, "packed_linear")
    with LLM(tiny_llama, kv_cache_memory=1 << 24, dtype="float32") as llm:
        model = llm.engine.executor.worker.model
        for layer in (model.layers[0].self_attn.qkv_proj, model.layers[-1].self_attn.o_proj,
                      model.layers[0].mlp.gate_up_proj, model.layers[-1].mlp.down_proj):
            # MKL's packing where torch has it (the faster: kernels/cpu/mkl_packed.py), else oneDNN's.
            if mkl_packed.available():
                assert isinstance(layer.packed_weight, mkl_packed.PackedWeight)
            else:
                assert layer.packed_weight.is_mkldnn
            assert not layer.weight.is_meta and layer.weight.dtype == torch.float32  # the C kernel's
        assert hasattr(model, "packed_lm_head")
        # The Python path's routing (the C layers, which call MKL's packed GEMM themselves, are
        # tests/test_fused_layers.py's).
        model._fused_layers = None
        prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 5 for i in range(24)]} for j in range(6)]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
        assert llm.stats()["kv_blocks_used"] == 0
    # The 6 prompts' prefill (144 rows) and their 6-row decode steps ran on the packed weights.
    assert 144 in onednn and 6 in onednn


def test_row_counts_are_rounded_to_a_few_with_little_padding():
    rounded = [llama.onednn_rows(rows) for rows in range(1, 4097)]
    assert rounded[:16] == list(range(1, 17))
    assert len(set(rounded[:2048])) <= 64
    for rows, padded in enumerate(rounded, start=1):
        assert padded >= rows and (padded - rows < 8 if rows < 64 else 8 * (padded - rows) <= rows)


@pytest.mark.skipif(not llama._mkldnn_f32(), reason="torch has no oneDNN linear here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_runs_each_row_count_at_its_rounded_count(dtype, monkeypatch):
    """Its kernels are built per shape: the GEMM sees only rounded row counts, and the padding
    rows change nothing in the rows asked for."""
    if dtype == torch.bfloat16 and not llama._mkldnn_bf16():
        pytest.skip("no native bf16 GEMM on this CPU")
    seen = _count_calls(monkeypatch, "_onednn_gemm")
    torch.manual_seed(0)
    w, bias = torch.randn(80, 96, dtype=dtype), torch.randn(80, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    for rows in (3, 16, 17, 63, 100, 1000):
        x = torch.randn(rows, 96, dtype=dtype) * 4
        got = llama.onednn_linear(x, packed, bias)
        assert seen[-1] == llama.onednn_rows(rows) and got.shape == (rows, 80) and got.is_contiguous()
        tolerance = 1e-4 if dtype == torch.float32 else 0.05
        torch.testing.assert_close(got.float(), torch.nn.functional.linear(x.float(), w.float(), bias.float()),
                                   rtol=tolerance, atol=tolerance * 10)
    assert seen == [3, 16, 24, 64, 104, 1024]
