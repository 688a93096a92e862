"""MKL's packed fp32 GEMM (kernels/cpu/mkl_packed.py), which fp32 linear layers take above the C
kernel's rows where torch exports it: its results against torch's at every kind of row count, and
its refusals."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import mkl_packed

pytestmark = pytest.mark.skipif(not mkl_packed.available(), reason="this torch exports no MKL packed GEMM")


@pytest.mark.parametrize("rows", [0, 1, 7, 17, 64, 600])
@pytest.mark.parametrize("n_out,k_in", [(80, 96), (203, 77), (3072, 576)])
def test_the_packed_product_equals_torchs(rows, n_out, k_in):
    torch.manual_seed(rows + n_out)
    w, x, bias = torch.randn(n_out, k_in), torch.randn(rows, k_in), torch.randn(n_out)
    packed = mkl_packed.PackedWeight(w)
    got = mkl_packed.linear(x, packed)
    assert got.shape == (rows, n_out) and got.dtype == torch.float32
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(mkl_packed.linear(x, packed, bias), x @ w.t() + bias, rtol=1e-5, atol=1e-4)


def test_the_packed_copy_is_the_weight_as_it_was_when_packed():
    torch.manual_seed(0)
    w, x = torch.randn(48, 32), torch.randn(20, 32)
    packed = mkl_packed.PackedWeight(w)
    expected = x @ w.t()
    w.zero_()  # the plain weight changed (or freed) afterwards: the packed copy is its own
    torch.testing.assert_close(mkl_packed.linear(x, packed), expected, rtol=1e-5, atol=1e-5)


def test_a_non_contiguous_input_is_read_as_its_values():
    torch.manual_seed(1)
    w = torch.randn(40, 64)
    x = torch.randn(64, 33).t()  # [33, 64], strided
    torch.testing.assert_close(mkl_packed.linear(x, mkl_packed.PackedWeight(w)), x.contiguous() @ w.t(),
                               rtol=1e-5, atol=1e-4)


def test_wrong_inputs_are_refused_by_name():
    packed = mkl_packed.PackedWeight(torch.randn(40, 64))
    with pytest.raises(ValueError, match=r"x: \[rows <= \d+, 64\] fp32"):
        mkl_packed.linear(torch.randn(3, 65), packed)
    with pytest.raises(ValueError, match=r"x: \[rows <= \d+, 64\] fp32"):
        mkl_packed.linear(torch.randn(3, 64, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="weight: a 2-d fp32 CPU tensor"):
        mkl_packed.PackedWeight(torch.randn(40, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weight: a 2-d fp32 CPU tensor"):
        mkl_packed.PackedWeight(torch.randn(64))


def test_a_packed_weight_refuses_to_be_copied():
    """MKL's packed bytes may not move: a copy would be unusable, so none is made."""
    import copy
    import pickle

    packed = mkl_packed.PackedWeight(torch.randn(8, 16))
    for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            attempt(packed)
