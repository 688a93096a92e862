"""The decoder layer's element-wise C kernels (kernels/cpu/elementwise.c) against torch's own ops,
in fp32 and in bf16 (where they must round as torch's bf16 ops round), on contiguous and on
transposed inputs (the layers' products may be either), and their refusal where they do not
apply. Whole-model equality with transformers: test_model_correctness and test_bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu

EPS = 0.25  # large enough that a kernel ignoring it fails
pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernels")


def _maybe_transposed(rows: int, cols: int, transposed: bool, dtype=torch.float32) -> torch.Tensor:
    """[rows, cols]: contiguous, or a transposed view as `mm(weight, x.t()).t()` returns."""
    return torch.randn(cols, rows, dtype=dtype).t() if transposed else torch.randn(rows, cols, dtype=dtype)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows, dim", [(1, 64), (5, 61), (70, 576)])
def test_add_rms_norm_adds_into_the_residual_and_norms_the_sum(rows, dim, transposed):
    torch.manual_seed(rows)
    residual, delta, weight = torch.randn(rows, dim), _maybe_transposed(rows, dim, transposed), torch.randn(dim)
    total = residual + delta
    expected = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS))
    stream = residual.clone()
    out = cpu.add_rms_norm(delta, stream, weight, EPS)
    torch.testing.assert_close(stream, total, rtol=0, atol=0)  # the add, in place, exact
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    alone = cpu.add_rms_norm(None, residual.clone(), weight, EPS)  # no delta: the norm alone
    torch.testing.assert_close(alone, weight * (residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + EPS)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows, inter", [(1, 8), (3, 13), (40, 1536)])
def test_silu_mul_equals_torchs_silu_times_up(rows, inter, transposed):
    torch.manual_seed(inter)
    gate_up = _maybe_transposed(rows, 2 * inter, transposed) * 4  # reach silu's saturated ends
    gate, up = gate_up.split(inter, dim=-1)
    out = cpu.silu_mul(gate_up)
    assert out.is_contiguous() and out.shape == (rows, inter)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_silu_mul_of_gates_beyond_exps_range_is_finite_and_torchs(dtype, transposed):
    # e^-g overflows fp32 for g below -88.7: the fast-math division once turned g / (1 + inf) into
    # NaN there, poisoning the row. Every such gate, in whole vectors and in a loop's tail.
    extremes = torch.tensor([-3e38, -1e30, -1e4, -200.0, -100.0, -89.0, -88.8, -88.0, -87.0, -20.0, 0.0, 20.0,
                             88.0, 89.0, 100.0, 1e4, 1e30])
    inter = 3 * len(extremes)
    gate = extremes.repeat(3)
    gate_up = torch.cat([gate, torch.linspace(-1, 1, inter)]).view(1, 2 * inter).repeat(5, 1).to(dtype)
    if transposed:
        gate_up = gate_up.t().contiguous().t()
    out = cpu.silu_mul(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), (F.silu(gate) * up).float(), rtol=2 ** -7, atol=1e-30)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows, heads, dim", [(1, 3, 8), (6, 9, 64), (33, 2, 128)])
def test_rope_equals_the_rotate_half_form(rows, heads, dim, transposed):
    torch.manual_seed(dim)
    # q as the attention layer takes it: the first heads * dim columns of the QKV product.
    qkv = _maybe_transposed(rows, heads * dim + 16, transposed)
    x = qkv[:, :heads * dim].reshape(rows, heads, dim)
    cos, sin = torch.randn(rows, 1, dim), torch.randn(rows, 1, dim)
    half = dim // 2
    expected = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    out = cpu.rope(x, cos, sin)
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows, dim", [(1, 64), (5, 61), (70, 576)])
def test_bf16_add_rms_norm_rounds_as_torchs_bf16_ops_round(rows, dim, transposed):
    from workers.models.llama import RMSNorm

    torch.manual_seed(rows)
    bf16 = torch.bfloat16
    residual, delta = torch.randn(rows, dim, dtype=bf16) * 3, _maybe_transposed(rows, dim, transposed, bf16)
    norm = RMSNorm(dim, EPS).to(bf16)
    norm.weight.data = torch.randn(dim, dtype=bf16)
    total = residual + delta  # torch's bf16 add
    stream = residual.clone()
    out = cpu.add_rms_norm(delta, stream, norm.weight.data, EPS)
    assert out.dtype == bf16
    assert torch.equal(stream, total)
    # The torch module's form (fp32 statistics, rounded, times the bf16 weight), bit for bit but
    # where the fp32 sum of squares differs in its last bit: torch sums in an order of its own,
    # which depends on the CPU's vector width, and a last-bit change flips a rounding now and then
    # (70 x 576 on an AVX-512 machine: 7 of 40,320 elements, each one bf16 step away).
    expected = norm(total).detach()
    differ = out != expected
    assert differ.sum() <= max(2, out.numel() // 1000)
    torch.testing.assert_close(out[differ].float(), expected[differ].float(), rtol=2 ** -6, atol=0)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows, inter", [(1, 8), (3, 13), (40, 1536)])
def test_bf16_silu_mul_rounds_as_torchs_bf16_ops_round(rows, inter, transposed):
    torch.manual_seed(inter)
    gate_up = _maybe_transposed(rows, 2 * inter, transposed, torch.bfloat16) * 4
    gate, up = gate_up.split(inter, dim=-1)
    out = cpu.silu_mul(gate_up)
    expected = F.silu(gate) * up
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    # Within a bf16 step or two of torch's: its exp and glibc's differ in the last fp32 bit, which
    # moves a silu that lies on a bf16 rounding midpoint (about one in a thousand here).
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -6, atol=2 ** -7)
    assert (out != expected).float().mean() < 0.01


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows, heads, dim", [(1, 3, 8), (6, 9, 64), (33, 2, 128)])
def test_bf16_rope_rounds_as_torchs_bf16_ops_round(rows, heads, dim, transposed):
    torch.manual_seed(dim)
    bf16 = torch.bfloat16
    x = _maybe_transposed(rows, heads * dim + 16, transposed, bf16)[:, :heads * dim].reshape(rows, heads, dim)
    cos, sin = torch.randn(rows, 1, dim, dtype=bf16), torch.randn(rows, 1, dim, dtype=bf16)
    half = dim // 2
    out = cpu.rope(x, cos, sin)
    assert torch.equal(out, x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def test_the_kernels_refuse_what_they_do_not_compute():
    x16, h16 = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.float16)
    assert cpu.add_rms_norm(None, x16, torch.ones(64), EPS) is None  # a bf16 stream with an fp32 weight
    assert cpu.add_rms_norm(torch.randn(4, 64), x16, torch.ones(64, dtype=torch.bfloat16), EPS) is None
    assert cpu.add_rms_norm(None, h16, torch.ones(64, dtype=torch.float16), EPS) is None  # no fp16 kernels
    assert cpu.add_rms_norm(None, torch.randn(64, 4).t(), torch.ones(64), EPS) is None  # the stream must be contiguous
    assert cpu.silu_mul(h16) is None
    assert cpu.rope(x16.view(4, 1, 64), torch.randn(4, 1, 64), torch.randn(4, 1, 64)) is None  # mixed dtypes
