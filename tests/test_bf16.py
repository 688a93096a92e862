"""bf16 weights. On a CPU without native bf16 arithmetic the linear layers widen each bf16 weight
exactly and sum in fp32 (the C kernel for a few rows, a widened fp32 GEMM otherwise), rounding
the result to bf16 as torch's own bf16 GEMM does; with it, a few rows take the C kernel's bf16
dot products and more oneDNN's bf16 GEMM on weights packed once. Here: the routing against
torch's bf16 linear, the dot-product kernel, and a whole bf16 engine against transformers in bf16
(the widening kernel against the widened product is in tests/test_quantization.py, beside the
int8 one)."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from workers.models import llama

PROMPT = [(37 * i + 11) % 900 + 5 for i in range(40)]


@pytest.mark.parametrize("tokens", [1, 5, 130])  # the kernel, and the widened GEMM beyond its rows
def test_a_bf16_linear_layer_gives_torchs_bf16_result(tokens):
    if not llama.WIDEN_BF16:
        pytest.skip("this CPU multiplies bf16 natively: torch's own bf16 GEMM runs")
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    w, bias = torch.randn(48, 64).to(torch.bfloat16), torch.randn(48).to(torch.bfloat16)
    got = llama.linear(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, 48)
    exact = x.float() @ w.float().t() + bias.float()
    # Both round an fp32 sum to bf16 (and the bias add once more): within two bf16 steps.
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=2 ** -6)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), rtol=2 ** -7, atol=2 ** -6)


@pytest.mark.parametrize("tokens", [1, 4, 5, 130])
@pytest.mark.parametrize("packed", [False, True])
def test_with_native_bf16_a_few_rows_take_the_c_kernel_and_more_take_onednns_gemm(tokens, packed, monkeypatch):
    """Where the CPU multiplies bf16 natively (routing forced here whatever this CPU is): up to
    NATIVE_BF16_KERNEL_ROWS rows on the C kernel's bf16 dot products, more on oneDNN's bf16 GEMM,
    on the weight packed once where it is; all torch's bf16 result to its rounding."""
    if packed and not llama._mkldnn_bf16():
        pytest.skip("torch has no oneDNN bf16 GEMM here")
    monkeypatch.setattr(llama, "WIDEN_BF16", False)
    calls = []
    kernel = llama.bf16_dot_linear
    monkeypatch.setattr(llama, "bf16_dot_linear", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    w, bias = torch.randn(48, 64).to(torch.bfloat16), torch.randn(48).to(torch.bfloat16)
    weight_copy = torch.ops.mkldnn._reorder_linear_weight(w) if packed else None
    got = llama.linear(x, w, bias, packed=weight_copy)
    assert calls == ([tokens] if tokens <= llama.NATIVE_BF16_KERNEL_ROWS else [])
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, 48)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), rtol=2 ** -7, atol=2 ** -6)


@pytest.mark.parametrize("tokens", [1, 130])
def test_a_packed_layer_without_its_plain_weight_runs_on_the_packed_one(tokens, monkeypatch):
    """After pack_weights a layer's weight is a meta tensor: every row count, a decode's few
    included, runs oneDNN's GEMM on the packed weight, and gives torch's bf16 result."""
    if not llama._mkldnn_bf16():
        pytest.skip("torch has no oneDNN bf16 GEMM here")
    monkeypatch.setattr(llama, "WIDEN_BF16", False)
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    w, bias = torch.randn(48, 64).to(torch.bfloat16), torch.randn(48).to(torch.bfloat16)
    got = llama.linear(x, w.to("meta"), bias, packed=torch.ops.mkldnn._reorder_linear_weight(w))
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, 48)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), rtol=2 ** -7, atol=2 ** -6)


@pytest.mark.parametrize("rows, n_out, k_in", [(1, 48, 64), (3, 9, 77), (4, 333, 1536), (7, 16, 32), (32, 20, 96)])
def test_the_bf16_dot_kernel_sums_exact_products_in_fp32(rows, n_out, k_in):
    """kernels/cpu/weight_gemv.c's AVX512-BF16 kernel, on tile and row-count remainders and a
    width that is no multiple of its 32 columns: the exact product's fp32 sum, rounded once."""
    from kernels import cpu

    torch.manual_seed(k_in)
    x, w = torch.randn(rows, k_in).to(torch.bfloat16), torch.randn(n_out, k_in).to(torch.bfloat16)
    got = cpu.bf16_dot_linear(x, w)
    if got is None:
        pytest.skip("no AVX512-BF16 on this CPU (or no C compiler)")
    exact = x.double() @ w.double().t()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n_out)
    # One bf16 rounding of an fp32 sum: half a bf16 step, plus the fp32 sum's own error.
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-4)
    assert cpu.bf16_dot_linear(x.float(), w) is None  # bf16 rows only
    assert cpu.bf16_dot_linear(torch.randn(33, k_in).to(torch.bfloat16), w) is None  # a few rows only


def test_a_bf16_engine_computes_what_transformers_computes_in_bf16(tiny_llama):
    from transformers import AutoModelForCausalLM

    with LLM(tiny_llama, kv_cache_memory=1 << 24, dtype="bfloat16") as llm:
        model = llm.engine.executor.worker.model
        assert model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
        # Where torch's bf16 GEMM is native, every linear layer and the LM head carry it packed.
        packs = not llama.WIDEN_BF16 and llama._mkldnn_bf16()
        assert hasattr(model.layers[0].mlp.gate_up_proj, "packed_weight") == packs
        assert hasattr(model.layers[-1].self_attn.o_proj, "packed_weight") == packs
        assert hasattr(model, "packed_lm_head") == packs
        # ... and holds it once: the plain weight gives way to a meta tensor (the tied LM head's
        # stays: it is the embeddings).
        assert model.layers[0].self_attn.qkv_proj.weight.is_meta == packs
        assert not model.embed_tokens.weight.is_meta
        out = llm.generate({"prompt_token_ids": PROMPT},
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0),
                           use_tqdm=False)[0]
        assert llm.stats()["kv_blocks_used"] == 0
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        reference = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), -1)
        greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
    diffs = [abs(step[PROMPT[i + 1]].logprob - reference[i, PROMPT[i + 1]].item())
             for i, step in enumerate(out.prompt_logprobs[1:])]
    # bf16 rounding, summed in another order (torch's own bf16 GEMMs here: max 0.063, mean 0.018)
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.03
    assert list(out.outputs[0].token_ids) == greedy
