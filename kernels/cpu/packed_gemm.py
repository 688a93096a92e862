"""fp32 GEMM on a weight packed once in panels, pagedserve's own (kernels/cpu/packed_gemm.c): the
third packed GEMM an fp32 linear layer can run on, beside MKL's (kernels/cpu/mkl_packed.py) and
oneDNN's; a worker measures which its machine runs (workers/kernel_choice.py).

Why: on an AMD EPYC (Zen 3, AVX2, 2 cores), SmolLM2's 30 layers of projections, random weights,
best of 3 (this kernel against oneDNN's packed GEMM): 8 rows 23.0 against 29.6 ms, 24 rows 39.6 /
51.6, 48 rows 65.2 / 86.3 (156 against 118 GFLOP/s), 64 rows 84.7 / 106.0, 2,048 rows 2,518 /
2,737 (173 against 159); MKL's was slower than oneDNN's there at every row count up to 128.

The packed copy is the plain weight's size (rounded up to a whole panel of output channels), a
plain tensor: it may be copied, moved and pickled. `compute_address()` is the entry point
kernels/cpu/decoder_layer.c calls for its projections beyond the C weight kernel's rows.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kernels import cpu

_SOURCE = Path(__file__).with_name("packed_gemm.c")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# Any row count (the C side's int64), up to what the cblas-typed entry point's int takes.
MAX_ROWS = 2**31 - 1


_GEMM_ARGTYPES = (_P, _P, _P, _I64, _I64, _I64, ctypes.c_int)


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib`'s entry points given their C signatures."""
    lib.packed_gemm_f32.restype, lib.packed_gemm_f32.argtypes = None, list(_GEMM_ARGTYPES)
    lib.packed_f32_size.restype, lib.packed_f32_size.argtypes = _I64, [_I64, _I64]
    lib.pack_f32_panels.restype, lib.pack_f32_panels.argtypes = None, [_P, _P, _I64, _I64]
    lib.packed_f32_panel_width.restype, lib.packed_f32_panel_width.argtypes = _I64, []
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu._library(_SOURCE, "packed_gemm_f32", _GEMM_ARGTYPES)
    return None if lib is None else _typed(lib)


def build_variant(*defines: str) -> ctypes.CDLL:
    """packed_gemm.c built with `defines` (its compile-time knobs, e.g. `-DPACKED_GEMM_STEAL=0`)
    beside the production build, typed alike: for tests and benchmarks that compare the two."""
    return _typed(cpu.load_variant(_SOURCE, defines, "the packed GEMM kernel"))


def available() -> bool:
    """Whether the kernel built (a C compiler with OpenMP)."""
    return _library() is not None


def compute_address() -> int | None:
    """`packed_gemm_f32_cblas`'s address (cblas_sgemm_compute's signature), for C callers."""
    lib = _library()
    return None if lib is None else ctypes.cast(lib.packed_gemm_f32_cblas, _P).value


class PackedWeight:
    """A [n_out, k_in] fp32 weight in the kernel's panels, for y = x @ weight^T."""

    __slots__ = ("buffer", "n_out", "k_in")

    def __init__(self, weight: torch.Tensor):
        lib = _library()
        if lib is None:
            raise RuntimeError("the packed GEMM kernel did not build (kernels.cpu.packed_gemm.available())")
        weight = cpu.packable_f32_weight(weight)
        self.n_out, self.k_in = weight.shape
        self.buffer = torch.empty(lib.packed_f32_size(self.n_out, self.k_in), dtype=torch.float32)
        lib.pack_f32_panels(self.buffer.data_ptr(), weight.data_ptr(), self.n_out, self.k_in)

    def data_ptr(self) -> int:
        return self.buffer.data_ptr()


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) for a 2-d fp32 `x` (any row count), W packed in `packed`; on `lib` (a
    `build_variant`) where given, else the production build."""
    x = cpu.packed_gemm_input(x, packed.k_in, MAX_ROWS)
    out = torch.empty(x.shape[0], packed.n_out, dtype=torch.float32)
    if x.shape[0]:
        (lib or _library()).packed_gemm_f32(out.data_ptr(), x.data_ptr(), packed.data_ptr(), x.shape[0],
                                            packed.n_out, packed.k_in, torch.get_num_threads())
    return out if bias is None else out.add_(bias)
