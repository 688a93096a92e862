"""Weight-only int8 (`quantization="int8"`): the rounding's error bound, the CPU kernel against a
dequantized matmul, and a whole engine against transformers running the same dequantized weights."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from workers.models.llama import linear
from workers.quantization import INT8_LAYERS, quantize_int8

PROMPT = [(37 * i + 11) % 900 + 5 for i in range(40)]


def test_each_weight_is_within_half_its_rows_scale_and_each_rows_largest_maps_to_127():
    torch.manual_seed(0)
    w = torch.randn(96, 64) * torch.linspace(0.01, 3.0, 96)[:, None]  # rows of very different ranges
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (96,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(q.abs().amax(dim=1), torch.full((96,), 127, dtype=torch.int8))
    error = (w - q.float() * scale[:, None]).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 130])
def test_the_int8_linear_equals_a_matmul_with_the_dequantized_weight(dtype, tokens):
    torch.manual_seed(tokens)
    w, x = torch.randn(48, 64), torch.randn(tokens, 64)
    q, scale = quantize_int8(w)
    expected = x.float() @ (q.float() * scale[:, None]).t()
    got = linear(x.to(dtype), q, None, scale.to(dtype)).float()
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(got, expected, atol=tolerance, rtol=tolerance if dtype == torch.float32 else 0.02)


@pytest.mark.parametrize("kind", ["int8", "bf16", "f32"])  # bf16 layers and engine: tests/test_bf16.py
# Activation rows four at a time, then 3, 2 or 1 (one row alone: its own loop); fp32 on AVX-512
# streams 2-8 rows with two accumulators each, 9-16 with one (8, 9: either side)
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 8, 9, 13, 16, 32])
@pytest.mark.parametrize("width", [64, 61])  # 61: a row's tail beyond the kernel's 8- and 16-wide pieces
# 203 outputs: weight rows in tiles of 4 and a last tile of 3
def test_a_c_weight_kernel_for_a_few_rows_equals_the_widened_weights_product(kind, rows, width):
    from kernels import cpu

    if not cpu.available():
        pytest.skip("no C compiler for the CPU kernels")
    torch.manual_seed(rows * width)
    x = torch.randn(rows, width)
    if kind == "int8":
        q, scale = quantize_int8(torch.randn(203, width))
        kernel, widened = (lambda x: cpu.int8_linear(x, q, scale)), q.float() * scale[:, None]
        assert cpu.int8_linear(x, q, scale.to(torch.bfloat16)) is None  # fp32 scales only
    elif kind == "bf16":
        w = torch.randn(203, width).to(torch.bfloat16)
        kernel, widened = (lambda x: cpu.bf16_linear(x, w)), w.float()
        assert cpu.bf16_linear(x, w.float()) is None  # bf16 weights only
    else:
        w = torch.randn(203, width)
        kernel, widened = (lambda x: cpu.f32_linear(x, w)), w
        assert cpu.f32_linear(x, w.to(torch.bfloat16)) is None  # fp32 weights only
        assert cpu.f32_linear(x[:1], torch.randn(width, 203).t()) is None  # a contiguous weight only
    max_rows = cpu.F32_GEMV_MAX_ROWS if kind == "f32" else cpu.GEMV_MAX_ROWS
    got = kernel(x)
    if rows > max_rows:  # where it does not apply, it says so and the caller takes a GEMM
        assert got is None
        return
    assert got is not None and got.shape == (rows, 203) and got.dtype == torch.float32
    torch.testing.assert_close(got, x @ widened.t(), rtol=1e-5, atol=1e-4)
    assert kernel(torch.randn(max_rows + 1, width)) is None
    assert kernel(x.to(torch.bfloat16)) is None


@pytest.mark.parametrize("rows", [3, 5, 7])
@pytest.mark.parametrize("outputs, width", [(256, 64), (48, 96), (256, 61), (250, 64)])
def test_the_fp32_kernel_folding_16_outputs_at_a_time_equals_the_product(rows, outputs, width):
    """fp32, 3-7 rows on AVX-512: 16 output channels' sums folded at once where the outputs are a
    multiple of 16 and the width of 32 (the first two shapes); the others take the per-channel
    path."""
    from kernels import cpu

    if not cpu.available():
        pytest.skip("no C compiler for the CPU kernels")
    torch.manual_seed(rows + outputs + width)
    x, w = torch.randn(rows, width), torch.randn(outputs, width)
    torch.testing.assert_close(cpu.f32_linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("width", [1536, 4096])  # a row of x 6 and 16 KB: beyond 4 or 1 rows, not in L1 at once
def test_the_fp32_kernel_takes_wide_rows_in_chunks_each_row_summed_alike(width):
    """fp32, 3-16 rows whose x is too wide for L1 in one piece go in chunks of rows over each
    group of 16 outputs (weight_gemv.c's GROUP_X_BYTES): every row equals the product, and sums
    in the same order whatever the chunks, so its result is the same at every row count from 3
    to 16 (at 8 rows and more the per-channel path summed in another order)."""
    from kernels import cpu

    if not cpu.available():
        pytest.skip("no C compiler for the CPU kernels")
    torch.manual_seed(width)
    x, w = torch.randn(16, width), torch.randn(64, width)
    alone = {rows: cpu.f32_linear(x[:rows].contiguous(), w) for rows in range(3, 17)}
    torch.testing.assert_close(alone[16], x @ w.t(), rtol=1e-4, atol=1e-3)
    for rows, out in alone.items():
        assert torch.equal(out, alone[16][:rows]), rows


@pytest.mark.parametrize("rows", [3, 7, 8, 16])
def test_the_fp32_kernel_keeps_a_weight_too_wide_for_chunks_in_one_piece(rows):
    """A group of 16 outputs beyond 512 KB of weight (k_in > 8,192 floats) is not re-read per chunk
    of rows: one piece, the product all the same."""
    from kernels import cpu

    if not cpu.available():
        pytest.skip("no C compiler for the CPU kernels")
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 8192 + 64), torch.randn(32, 8192 + 64)
    torch.testing.assert_close(cpu.f32_linear(x, w), x @ w.t(), rtol=1e-4, atol=2e-3)


def _dequantized_hf(model_dir: str):
    """transformers' model with every decoder projection replaced by its int8 round trip."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    names = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.rsplit(".", 1)[-1] in names:
                # Rows are quantized one by one, so q/k/v alone round as inside the fused qkv_proj.
                q, scale = quantize_int8(module.weight)
                module.weight.copy_(q.float() * scale[:, None])
    return hf


def test_an_int8_engine_computes_what_transformers_computes_with_the_dequantized_weights(tiny_llama):
    with LLM(tiny_llama, kv_cache_memory=1 << 24, quantization="int8") as llm:
        model = llm.engine.executor.worker.model
        layer = model.layers[0]
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert module.weight.dtype == torch.int8 and module.weight_scale.dtype == torch.float32
        assert model.embed_tokens.weight.dtype == torch.float32  # and the tied LM head
        out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
        assert llm.stats()["kv_blocks_used"] == 0
    with torch.inference_mode():
        reference = torch.log_softmax(_dequantized_hf(tiny_llama)(torch.tensor([PROMPT])).logits[0].float(), -1)
    for position, step in enumerate(out.prompt_logprobs[1:]):
        token = PROMPT[position + 1]
        assert abs(step[token].logprob - reference[position, token].item()) < 1e-4


def test_int8_logprobs_differ_from_fp32_but_only_slightly(tiny_llama):
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    runs = {}
    for quantization in ("none", "int8"):
        with LLM(tiny_llama, kv_cache_memory=1 << 24, quantization=quantization) as llm:
            out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
        runs[quantization] = [step[PROMPT[i + 1]].logprob for i, step in enumerate(out.prompt_logprobs[1:])]
    diffs = [abs(a - b) for a, b in zip(runs["none"], runs["int8"])]
    scale = sum(abs(a) for a in runs["none"]) / len(diffs)  # ~log(vocab): a random model's logprobs
    assert 0 < sum(diffs) / len(diffs) < 0.02 * scale


def test_unknown_or_unsupported_quantization_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="quantization must be one of none, int8; got 'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization 'int8' runs on the CPU path only; device 'cuda'"):
        EngineConfig(quantization="int8", device="cuda")
    assert EngineConfig(quantization=None).quantization == "none"  # vLLM's spelling
    assert set(INT8_LAYERS) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
