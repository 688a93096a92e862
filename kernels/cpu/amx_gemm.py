"""bf16 GEMM on Intel AMX's tiles (kernels/cpu/amx_gemm.c), on a weight packed once into the tiles
the kernel loads (`pack`: a plain bf16 tensor [n padded to 16, k padded to 32], which a module may
hold as a buffer); on a CPU with AVX512-BF16 but no AMX (AMD Zen 4), on its dot products over the
same packed weight (`isa()` says which). pagedserve's bf16 layers take it for steps of up to
MAX_ROWS rows where oneDNN's packed copy of the weight is kept too, and for every step where it
is not (workers/models/llama.py's `pack_weights`). `available()` is False where the CPU has
neither, or the compiler or the kernel refuse them.

Why: at a decode step's rows a GEMM reads its weight once, and oneDNN's, on its own packed
weight, read it at about half the memory rate. SmolLM2's 30 layers of projections, 2 threads,
AMX kernel against oneDNN packed (alternated runs): 1-16 rows 7.6-7.8 against 10.4-11.1 ms, 32
rows 8.9 / 12.8, 64 rows 11.3 / 14.5, 128 rows 15.6 / 20.4, 160 rows 18.2 / 21.7; 192 rows 21.1
/ 19.9 and 2,048 rows 179 / 140: beyond MAX_ROWS oneDNN's GEMM is the faster (its blocking for
many rows, which the kernel's 32-row blocks do not match).
On AVX512-BF16 (Zen 4): 1 row 5.8 against 11.7 ms, 16 rows 11.6 / 15.1, 160 rows 88.0 / 92.2,
256 rows 144 / 141: the same crossover.

    packed = amx_gemm.pack(weight)                 # [n, k] bf16
    out = amx_gemm.linear(x, packed, n, bias)      # x [rows, k] bf16 -> [rows, n] bf16
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kernels import cpu

MAX_ROWS = 160
_SOURCE = Path(__file__).with_name("amx_gemm.c")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


_GEMM_ARGTYPES = (_P, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int)


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib`'s entry points given their C signatures."""
    lib.amx_linear_bf16.restype, lib.amx_linear_bf16.argtypes = None, list(_GEMM_ARGTYPES)
    lib.amx_available.restype, lib.amx_available.argtypes = ctypes.c_int, []
    lib.amx_kernel_isa.restype, lib.amx_kernel_isa.argtypes = ctypes.c_int, []
    lib.amx_packed_elements.restype, lib.amx_packed_elements.argtypes = _I64, [_I64, _I64]
    lib.amx_pack_bf16.restype, lib.amx_pack_bf16.argtypes = None, [_P, _P, _I64, _I64]
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu._library(_SOURCE, "amx_linear_bf16", _GEMM_ARGTYPES)
    if lib is None:
        return None
    lib = _typed(lib)
    return lib if lib.amx_available() else None


def build_variant(*defines: str) -> ctypes.CDLL:
    """amx_gemm.c built with `defines` (its compile-time knobs, e.g. `-DDP_NEXT_GROUP=0`) beside the
    production build, typed alike, for `linear(..., lib=)`: for tests and benchmarks that compare
    the two."""
    return _typed(cpu.load_variant(_SOURCE, defines, "the bf16 GEMM kernel"))


def available() -> bool:
    """Whether the kernel built with AMX and this process may use the tile unit, or built with
    AVX512-BF16 on a CPU without AMX."""
    return _library() is not None


def isa() -> str | None:
    """What the kernel runs on here: "amx", "avx512_bf16", or None where it is not available."""
    lib = _library()
    return None if lib is None else {2: "amx", 1: "avx512_bf16"}.get(lib.amx_kernel_isa())


def address() -> int | None:
    """The kernel's entry point, for C callers (kernels/cpu/decoder_layer_bf16.c); None where it is
    not available."""
    lib = _library()
    return None if lib is None else ctypes.cast(lib.amx_linear_bf16, _P).value


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [n, k] bf16 in the kernel's tiles: [n padded to 16, k padded to 32] bf16."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"weight: a 2-d bf16 CPU tensor, got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    weight = weight.detach().contiguous()  # held while C reads it
    out = torch.empty(-(-n // 16) * 16, -(-k // 32) * 32, dtype=torch.bfloat16)
    _library().amx_pack_bf16(out.data_ptr(), weight.data_ptr(), n, k)
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, bias: torch.Tensor | None = None,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) for a 2-d bf16 `x` [rows, k], W [n_out, k] packed by `pack`: [rows, n_out]
    bf16, summed in fp32 and rounded once (the bias added before the rounding); on `lib` (a
    `build_variant`) where given, else the production build."""
    k = x.shape[-1]
    if x.dim() != 2 or x.dtype != torch.bfloat16 or packed.shape != (-(-n_out // 16) * 16, -(-k // 32) * 32):
        raise ValueError(f"x: [rows, k] bf16 for a packed [{n_out}, k] weight, got {x.dtype} {tuple(x.shape)} "
                         f"against packed {tuple(packed.shape)}")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n_out,)):
        raise ValueError(f"bias: [{n_out}] bf16, got {bias.dtype} {tuple(bias.shape)}")
    x, bias = x.contiguous(), None if bias is None else bias.contiguous()  # held while C reads them
    out = torch.empty(x.shape[0], n_out, dtype=torch.bfloat16)
    if x.shape[0]:
        (lib or _library()).amx_linear_bf16(out.data_ptr(), x.data_ptr(), packed.data_ptr(),
                                            None if bias is None else bias.data_ptr(), x.shape[0], n_out, k,
                                            torch.get_num_threads())
    return out
