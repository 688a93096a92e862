"""pagedserve's packed fp32 GEMM (kernels/cpu/packed_gemm.c): its results against torch's at every
kind of shape its tiling cuts (row remainders of a register tile and of an L2 chunk, a last panel
of fewer channels, k beyond one L1 block), on one thread and several, the AVX-512 build's tiling
too, the schedule's hand-over of panels between threads, and its refusals."""

from __future__ import annotations

import copy
import ctypes
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu import packed_gemm

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not packed_gemm.available(), reason="the packed GEMM kernel did not build")


def _expected(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).float()


# rows: none, under one register tile (6 on AVX2, 12 on AVX-512), a tile and a remainder, beyond an
# L2 chunk (144 / 288 rows) with a remainder; n_out: under one panel, a panel and a remainder,
# SmolLM2's; k_in: under, at and beyond one L1 block (256).
@pytest.mark.parametrize("rows", [0, 1, 5, 13, 64, 301])
@pytest.mark.parametrize("n_out,k_in", [(7, 33), (80, 256), (203, 300), (960, 576)])
def test_the_packed_product_equals_torchs(rows, n_out, k_in):
    torch.manual_seed(rows * 7 + n_out)
    w, x, bias = torch.randn(n_out, k_in), torch.randn(rows, k_in), torch.randn(n_out)
    packed = packed_gemm.PackedWeight(w)
    got = packed_gemm.linear(x, packed)
    assert got.shape == (rows, n_out) and got.dtype == torch.float32
    torch.testing.assert_close(got, _expected(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed_gemm.linear(x, packed, bias), _expected(x, w) + bias, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_gives_the_same_bits(threads):
    """Threads split the output channels, never a sum: each output is one thread's, in one order,
    whichever thread takes it."""
    torch.manual_seed(3)
    w, x = torch.randn(500, 600), torch.randn(50, 600)
    packed = packed_gemm.PackedWeight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = packed_gemm.linear(x, packed)
        torch.set_num_threads(threads)
        assert torch.equal(packed_gemm.linear(x, packed), alone)
    finally:
        torch.set_num_threads(before)


def test_a_smaller_team_than_asked_for_still_computes_every_panel():
    """Under OMP_THREAD_LIMIT=1 a call asking for 3 threads runs on one: the panels set aside for the
    other two are taken from their backs by the one there is, the same products bit for bit."""
    script = """
import ctypes, torch
from kernels.cpu import packed_gemm
assert ctypes.CDLL("libgomp.so.1").omp_get_thread_limit() == 1
torch.manual_seed(5)
w, x = torch.randn(500, 600), torch.randn(50, 600)
packed = packed_gemm.PackedWeight(w)
torch.set_num_threads(1)
alone = packed_gemm.linear(x, packed)
out = torch.empty(50, 500)
packed_gemm._library().packed_gemm_f32(out.data_ptr(), x.data_ptr(), packed.data_ptr(), 50, 500, 600, 3)
assert torch.equal(out, alone), (out - alone).abs().max()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_THREAD_LIMIT": "1"}, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def _variant_product(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, threads: int) -> torch.Tensor:
    (rows, k_in), n_out = x.shape, w.shape[0]
    packed = torch.empty(lib.packed_f32_size(n_out, k_in))
    lib.pack_f32_panels(packed.data_ptr(), w.data_ptr(), n_out, k_in)
    out = torch.empty(rows, n_out)
    lib.packed_gemm_f32(out.data_ptr(), x.data_ptr(), packed.data_ptr(), rows, n_out, k_in, threads)
    return out


def test_passes_beyond_one_group_of_shares_run_in_order():
    """Built with room for 4 shares, a call runs its passes a group at a time (one or two passes
    with 3 or 2 threads): every row chunk, each panel whole or, for a k_in too long for L2, one k
    block a pass, the next adding to the last."""
    lib = packed_gemm.build_variant("-DPACKED_GEMM_MAX_SHARES=4")
    torch.manual_seed(6)
    for rows, n_out, k_in in [(301, 100, 1000), (50, 203, 600), (400, 20, 300)]:
        w, x = torch.randn(n_out, k_in), torch.randn(rows, k_in)
        for threads in (1, 2, 3):
            torch.testing.assert_close(_variant_product(lib, x, w, threads), _expected(x, w), rtol=1e-5, atol=1e-4)


def test_the_fixed_split_build_computes_the_same_products():
    """benchmarks/gemm_imbalance.py's baseline, each thread on its own share only, is a whole GEMM
    with the team it asks for."""
    lib = packed_gemm.build_variant("-DPACKED_GEMM_STEAL=0")
    torch.manual_seed(7)
    for rows, n_out, k_in in [(64, 960, 576), (301, 100, 1000)]:
        w, x = torch.randn(n_out, k_in), torch.randn(rows, k_in)
        torch.testing.assert_close(_variant_product(lib, x, w, 2), _expected(x, w), rtol=1e-5, atol=1e-4)


def test_the_build_without_next_block_prefetch_gives_the_same_bits():
    """The prefetch of a block's successor rides in a block's second row tile (a whole one, or the
    remainder after the first): row counts with and without one, in one L2 chunk and over two,
    give bit for bit what the build without it gives, and what torch gives."""
    without = packed_gemm.build_variant("-DNEXT_BLOCK_PREFETCH=0")
    torch.manual_seed(8)
    for rows in (6, 7, 8, 13, 39, 150):
        for n_out, k_in in [(960, 576), (203, 1000)]:
            w, x = torch.randn(n_out, k_in), torch.randn(rows, k_in)
            packed = packed_gemm.PackedWeight(w)
            ours = packed_gemm.linear(x, packed)
            assert torch.equal(ours, packed_gemm.linear(x, packed, lib=without)), (rows, n_out, k_in)
            torch.testing.assert_close(ours, _expected(x, w), rtol=1e-5, atol=1e-4)


def test_the_packed_copy_is_its_own_and_may_be_copied_and_pickled():
    torch.manual_seed(0)
    w, x = torch.randn(48, 32), torch.randn(20, 32)
    packed = packed_gemm.PackedWeight(w)
    expected = packed_gemm.linear(x, packed)
    w.zero_()  # the plain weight changed (or freed) afterwards: the packed copy is its own
    assert torch.equal(packed_gemm.linear(x, packed), expected)
    for other in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):
        assert other.data_ptr() != packed.data_ptr() and torch.equal(packed_gemm.linear(x, other), expected)


def test_a_non_contiguous_input_is_read_as_its_values():
    torch.manual_seed(1)
    w = torch.randn(40, 64)
    x = torch.randn(64, 33).t()  # [33, 64], strided
    torch.testing.assert_close(packed_gemm.linear(x, packed_gemm.PackedWeight(w)), _expected(x.contiguous(), w),
                               rtol=1e-5, atol=1e-4)


def test_wrong_inputs_are_refused_by_name():
    packed = packed_gemm.PackedWeight(torch.randn(40, 64))
    with pytest.raises(ValueError, match=r"x: \[rows <= \d+, 64\] fp32"):
        packed_gemm.linear(torch.randn(3, 65), packed)
    with pytest.raises(ValueError, match=r"x: \[rows <= \d+, 64\] fp32"):
        packed_gemm.linear(torch.randn(3, 64, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="weight: a 2-d fp32 CPU tensor"):
        packed_gemm.PackedWeight(torch.randn(40, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weight: a 2-d fp32 CPU tensor"):
        packed_gemm.PackedWeight(torch.randn(64))


def test_the_cblas_typed_entry_point_honours_its_strides():
    """decoder_layer.c calls the GEMM through cblas_sgemm_compute's type: lda and ldc are kept."""
    torch.manual_seed(2)
    w, x = torch.randn(40, 24), torch.randn(9, 30)
    packed = packed_gemm.PackedWeight(w)
    out = torch.full((9, 50), 7.0)
    entry = ctypes.CFUNCTYPE(None, *[ctypes.c_int] * 6, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                             ctypes.c_float, ctypes.c_void_p, ctypes.c_int)(packed_gemm.compute_address())
    entry(101, 111, 151, 9, 40, 24, x.data_ptr(), 30, packed.data_ptr(), 24, 0.0, out.data_ptr(), 50)
    torch.testing.assert_close(out[:, :40], _expected(x[:, :24].contiguous(), w), rtol=1e-5, atol=1e-4)
    assert torch.equal(out[:, 40:], torch.full((9, 10), 7.0))  # beyond n: untouched


def test_the_avx512_tiling_computes_the_same_products():
    """The 16-float build's tiles (PACKED_GEMM_W=16: 12 rows x 32 channels, for AVX-512) can be run
    on any x86 CPU by building at that width with the machine's own instructions (GCC splits the
    vectors where they are wider than its registers): its loops, not the instructions, are what
    this checks."""
    lib = packed_gemm.build_variant("-DPACKED_GEMM_W=16")
    assert lib.packed_f32_panel_width() == 32
    torch.manual_seed(4)
    for rows, n_out, k_in in [(1, 7, 33), (11, 40, 300), (25, 70, 256), (300, 97, 513)]:
        w, x = torch.randn(n_out, k_in), torch.randn(rows, k_in)
        torch.testing.assert_close(_variant_product(lib, x, w, 2), _expected(x, w), rtol=1e-5, atol=1e-4)
