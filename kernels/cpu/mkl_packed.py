"""fp32 GEMM on a weight packed once in MKL's own layout: `cblas_sgemm_pack` at load, then
`cblas_sgemm_compute` at every step, both exported by torch's CPU library where torch was built
with MKL (the x86 wheels). `available()` is False elsewhere, and the caller keeps oneDNN.

Why: a step of a few dozen rows (a decode batch) is where a serving engine spends most of its
steps, and there oneDNN's GEMM on its own packed weight left much of the CPU idle. SmolLM2's 30
layers of projections, 2 threads, Xeon with AVX-512, oneDNN packed against MKL packed (for
PACK_ROWS): 48 rows 54.0 against 40.9 ms, 64 rows 64.3 / 46.7 (211 against 291 GFLOP/s), 128
rows 97.0 / 73.8, 256 rows 168 / 137, 2,048 rows 1,165 / 1,083. The packed copy takes
the same memory as oneDNN's (+407 MB resident for SmolLM2, the plain weights' size), though
`cblas_sgemm_pack_get_size` asks for 2-9x that: the rest of the allocation is never written, so
never resident.

MKL picks the packed format by the row count it is told at packing (PACK_ROWS), and a format
suits some counts: the same 30 layers packed for 1 row took 55.9 ms at 64 rows, for 2,048 rows
65.9 ms, for 256 rows 45.8 ms (and 133 ms at 256 rows, 1,117 at 2,048); 512 measured as well
as 256 below 256 rows and better above (1,083 ms at 2,048).

The compute entry point's address (`compute_address()`) is also what kernels/cpu/decoder_layer.c calls
for its projections beyond the C weight kernel's rows.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from kernels import cpu

# cblas' enumerations (mkl_cblas.h).
ROW_MAJOR, NO_TRANS, TRANS, PACKED, B_MATRIX = 101, 111, 112, 151, 162

# The row count a weight is packed for (see above); any count may then be computed, up to
# MAX_ROWS (MKL's LP64 interface takes an int).
PACK_ROWS = 512
MAX_ROWS = 2**31 - 1

_I = ctypes.c_int
_P = ctypes.c_void_p


@functools.cache
def _library() -> ctypes.CDLL | None:
    """torch's CPU library with MKL's packed-GEMM entry points typed, or None without them."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    get_size.restype, get_size.argtypes = ctypes.c_size_t, [_I] * 4
    pack.restype, pack.argtypes = None, [_I] * 6 + [ctypes.c_float, _P, _I, _P]
    compute.restype = None
    compute.argtypes = [_I] * 6 + [_P, _I, _P, _I, ctypes.c_float, _P, _I]
    return lib


def available() -> bool:
    return _library() is not None


def compute_address() -> int | None:
    """`cblas_sgemm_compute`'s address, for C callers; None without MKL."""
    lib = _library()
    return None if lib is None else ctypes.cast(lib.cblas_sgemm_compute, _P).value


class PackedWeight:
    """A [n_out, k_in] fp32 weight in MKL's packed layout, for y = x @ weight^T. The packed bytes
    are MKL's own: only `cblas_sgemm_compute` reads them."""

    __slots__ = ("buffer", "n_out", "k_in")

    def __init__(self, weight: torch.Tensor):
        lib = _library()
        if lib is None:
            raise RuntimeError("this torch build exports no MKL packed GEMM (kernels.cpu.mkl_packed.available())")
        weight = cpu.packable_f32_weight(weight)
        self.n_out, self.k_in = weight.shape
        size = lib.cblas_sgemm_pack_get_size(B_MATRIX, PACK_ROWS, self.n_out, self.k_in)
        self.buffer = torch.empty(size, dtype=torch.uint8)
        lib.cblas_sgemm_pack(ROW_MAJOR, B_MATRIX, TRANS, PACK_ROWS, self.n_out, self.k_in, 1.0, weight.data_ptr(),
                             self.k_in, self.buffer.data_ptr())

    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    def __reduce__(self):
        # MKL's packed bytes may not move to another address (its documentation): pack the
        # weight again instead (copy and deepcopy come here too).
        raise TypeError("an MKL-packed weight cannot be copied or pickled; pack the plain weight again")


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) for a 2-d fp32 `x` (any row count), W packed in `packed`."""
    x = cpu.packed_gemm_input(x, packed.k_in, MAX_ROWS)
    rows = x.shape[0]
    out = torch.empty(rows, packed.n_out, dtype=torch.float32)
    if rows:
        _library().cblas_sgemm_compute(ROW_MAJOR, NO_TRANS, PACKED, rows, packed.n_out, packed.k_in, x.data_ptr(),
                                       packed.k_in, packed.data_ptr(), packed.k_in, 0.0, out.data_ptr(),
                                       packed.n_out)
    return out if bias is None else out.add_(bias)
