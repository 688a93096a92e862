"""The `cpu` attention backend: C kernels for decode attention and (fp32 caches) for prompt
chunks, kernels/cpu/paged_decode_attention.c and paged_prefill_attention.c, compiled on first use
with the system C compiler; the rest runs on the torch reference. Also the int8 and bf16 weight-only
linear layers for a few fp32 rows (`f32_linear`, `int8_linear`, `bf16_linear`) and for a few bf16
rows on AVX512-BF16 (`bf16_dot_linear`), kernels/cpu/weight_gemv.c; the decoder layer's fp32 and
bf16 element-wise steps (`add_rms_norm`, `silu_mul`, `rope`, kernels/cpu/elementwise.c), which
kernels/cpu/decoder_layer.py also strings together into whole layers for fp32 steps (and
kernels/cpu/decoder_layer_bf16.py between the oneDNN GEMMs of bf16 ones); and the OpenMP thread
pinning of `cpu_threads_bind` (`pin_omp_threads`, kernels/cpu/threads.c), built the same way.

Why: decode attention is memory-bound, and the torch path reads each sequence's K/V three
times (gather copy out, copy in, SDPA read). Reading the paged cache in place once measured
2.3-2.6 ms against 4.5-5.0 ms per layer for 48 SmolLM2 decodes of 40-800 tokens (2 cores).
fp32 or bf16 caches (queries and sums in fp32). When no compiler is found, or the build fails,
`available()` is False and `auto` takes the torch backend. The torch library's own libgomp is
already loaded when this one loads, so both share one OpenMP runtime (same soname).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import reference

_SOURCE = Path(__file__).with_name("paged_decode_attention.c")
# -ffast-math lets the dot products reassociate, and the softmax's expf vectorize: glibc declares
# its vector expf (libmvec) only under finite math, so the kernels assume no infinities (the
# running maximum starts at the first score). With the kernel's division-free loops, 30 layers
# of 64 decodes of ~300 tokens measured 111-130 -> 87-97 ms (the previous build called scalar
# expf; glibc's headers hid the vector one from it).
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-shared", "-fPIC")
log = logging.getLogger(__name__)


def _cache_dir() -> Path:
    base = os.environ.get("PAGEDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve")
    return Path(base)


@functools.cache
def cpu_signature() -> bytes:
    """This CPU's model and instruction-set flags: `-march=native` builds for them, so a library
    built on one CPU is not taken on another that shares the cache folder (a home directory on
    several machines, a VM whose host changes) where it could run instructions that CPU lacks;
    workers/kernel_choice.py keys its measured answers by it too."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(dict.fromkeys(lines)).encode()  # the first processor's; the others repeat it
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()


def _with_local_headers(source_path: Path) -> bytes:
    """The source and every header beside it that it includes (`#include "name.h"`): the build's
    cache key, so that a header's change rebuilds its includers."""
    source = source_path.read_bytes()
    headers = re.findall(rb'^\s*#\s*include\s+"([^"]+)"', source, flags=re.MULTILINE)
    return source + b"".join(source_path.with_name(h.decode()).read_bytes() for h in headers)


def _build(source_path: Path = _SOURCE, defines: tuple[str, ...] = ()) -> Path | None:
    """`source_path` compiled with _FLAGS and `defines` (`-DNAME=value`, for a kernel's variants
    in tests and benchmarks) into the local cache, once per content and CPU; None without a
    compiler."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    source = _with_local_headers(source_path)
    flags = (*_FLAGS, *defines)
    tag = hashlib.blake2b(source + compiler.encode() + " ".join(flags).encode() + cpu_signature(),
                          digest_size=8).hexdigest()
    target = _cache_dir() / f"{source_path.stem}_{tag}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build to a temporary name, then rename: concurrent first uses never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *flags, str(source_path), "-o", tmp, "-lm"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        log.warning("CPU kernel %s did not build (%s); using the torch path", source_path.name, result.stderr[-500:])
        os.unlink(tmp)
        return None
    os.replace(tmp, target)
    return target


@functools.cache
def _library(source: Path, symbol: str, argtypes: tuple) -> ctypes.CDLL | None:
    """`source` built (once per process) and loaded, with `symbol`'s C signature set; None
    when it cannot be built."""
    path = _build(source)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    fn = getattr(lib, symbol)
    fn.restype = None
    fn.argtypes = list(argtypes)
    return lib


def load_variant(source_path: Path, defines: tuple[str, ...], what: str) -> ctypes.CDLL:
    """`source_path` built with `defines` beside its production build and loaded (untyped), for
    tests and benchmarks that compare the two; RuntimeError naming `what` without a compiler."""
    path = _build(source_path, defines)
    if path is None:
        raise RuntimeError(f"{what} did not build (no C compiler with OpenMP)")
    return ctypes.CDLL(str(path))


_DECODE_ARGTYPES = (ctypes.c_void_p,) * 5 + (ctypes.c_int64,) * 10 + (ctypes.c_float, ctypes.c_int, ctypes.c_int)


def load() -> ctypes.CDLL | None:
    return _library(_SOURCE, "paged_decode_attention_f32", _DECODE_ARGTYPES)


def decode_variant(*defines: str) -> ctypes.CDLL:
    """The decode kernel built with `defines` (its compile-time knobs), for `decode_attention`'s
    `lib`: benchmarks compare it with the production build."""
    lib = load_variant(_SOURCE, defines, "the decode attention kernel")
    lib.paged_decode_attention_f32.restype = None
    lib.paged_decode_attention_f32.argtypes = list(_DECODE_ARGTYPES)
    return lib


def available() -> bool:
    return load() is not None


_GEMV_SOURCE = Path(__file__).with_name("weight_gemv.c")
# Up to this many rows the C kernels win (they read the weight once), on SmolLM2's
# layers: int8 61 against 118 ms for widening at 16 rows, 112 against 150 at 32, and at 64 rows
# widening the weight for one GEMM wins (198 against 214 ms); bf16 123 against 230 ms at 32.
GEMV_MAX_ROWS = 32
# fp32 weights compete with MKL's GEMM, which wins from ~24-32 rows on 2 threads (30 layers,
# tiled kernel against MKL: 16 rows 40.6 against 66.9 ms, 24 rows 51-52 against 52-65, 32 rows
# 66-72 against 66-76, 48 rows 119 against 86; this machine's runs vary by ~20%).
F32_GEMV_MAX_ROWS = 16


def _load_gemv(symbol: str) -> ctypes.CDLL | None:
    scale = (ctypes.c_void_p,) if symbol == "int8_gemv_f32" else ()
    return _library(_GEMV_SOURCE, symbol, (ctypes.c_void_p,) * 3 + scale + (ctypes.c_int64,) * 3 + (ctypes.c_int,))


def packable_f32_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` detached and contiguous, for a packed fp32 GEMM (kernels/cpu/mkl_packed.py,
    kernels/cpu/packed_gemm.py); ValueError unless it is a 2-d fp32 CPU tensor."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"weight: a 2-d fp32 CPU tensor, got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    return weight.detach().contiguous()


def packed_gemm_input(x: torch.Tensor, k_in: int, max_rows: int) -> torch.Tensor:
    """`x` contiguous, for a packed fp32 GEMM of `k_in` inputs; ValueError unless it is
    [rows <= max_rows, k_in] fp32."""
    if x.dim() != 2 or x.shape[1] != k_in or x.dtype != torch.float32 or x.shape[0] > max_rows:
        raise ValueError(f"x: [rows <= {max_rows}, {k_in}] fp32, got {x.dtype} {tuple(x.shape)}")
    return x.contiguous()


def _fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _few_fp32_rows(x: torch.Tensor, max_rows: int = GEMV_MAX_ROWS) -> bool:
    return _fp32_cpu(x) and x.shape[0] <= max_rows


def f32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight^T for fp32 `x` [rows, in] with rows <= F32_GEMV_MAX_ROWS and a contiguous fp32
    `weight` [out, in] (a decode step's few rows); None where the kernel does not apply (or did
    not build): the caller takes torch's GEMM."""
    if not _few_fp32_rows(x, F32_GEMV_MAX_ROWS) or weight.dtype != torch.float32 or not weight.is_contiguous():
        return None
    lib = _load_gemv("f32_gemv_f32")
    if lib is None:
        return None
    x = x.contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    lib.f32_gemv_f32(out.data_ptr(), x.data_ptr(), weight.data_ptr(),
                     x.shape[0], weight.shape[0], weight.shape[1], torch.get_num_threads())
    return out


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """x @ (weight * scale[:, None])^T for fp32 `x` [rows, in] with rows <= GEMV_MAX_ROWS, int8
    `weight` [out, in] and fp32 `scale` [out]; None where the kernel does not apply (or did not
    build): the caller widens the weight instead."""
    if not _few_fp32_rows(x) or scale.dtype != torch.float32:
        return None
    lib = _load_gemv("int8_gemv_f32")
    if lib is None:
        return None
    x, weight, scale = x.contiguous(), weight.contiguous(), scale.contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    lib.int8_gemv_f32(out.data_ptr(), x.data_ptr(), weight.data_ptr(), scale.data_ptr(),
                      x.shape[0], weight.shape[0], weight.shape[1], torch.get_num_threads())
    return out


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight^T in fp32 for fp32 `x` [rows, in] with rows <= GEMV_MAX_ROWS and a bf16 `weight`
    [out, in] (each weight widened exactly, products summed in fp32); None where the kernel does
    not apply (or did not build)."""
    if not _few_fp32_rows(x) or weight.dtype != torch.bfloat16:
        return None
    lib = _load_gemv("bf16_gemv_f32")
    if lib is None:
        return None
    x, weight = x.contiguous(), weight.contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    lib.bf16_gemv_f32(out.data_ptr(), x.data_ptr(), weight.data_ptr(),
                      x.shape[0], weight.shape[0], weight.shape[1], torch.get_num_threads())
    return out


def bf16_dot_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight^T for bf16 `x` [rows, in] with rows <= GEMV_MAX_ROWS and a bf16 `weight` [out, in],
    on AVX512-BF16's bf16 dot products (summed in fp32, the result rounded to bf16); None where
    the kernel does not apply, did not build, or the CPU lacks the instruction."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.shape[0] > GEMV_MAX_ROWS:
        return None
    lib = _library(_GEMV_SOURCE, "bf16_gemv_bf16", (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 3 + (ctypes.c_int,))
    if lib is None:
        return None
    lib.bf16_gemv_bf16.restype = ctypes.c_int
    x, weight = x.contiguous(), weight.contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    done = lib.bf16_gemv_bf16(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.shape[0], weight.shape[0],
                              weight.shape[1], torch.get_num_threads())
    return out if done else None


_ELEMENTWISE_SOURCE = Path(__file__).with_name("elementwise.c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ELEMENTWISE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _elementwise(name: str, argtypes: tuple, *tensors: torch.Tensor):
    """The C function `name`_f32 or `name`_bf16 for CPU tensors all of one of those dtypes; None
    where they are not, or where the kernels did not build."""
    dtype = tensors[0].dtype
    suffix = _ELEMENTWISE_SUFFIX.get(dtype)
    if suffix is None or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        return None
    symbol = f"{name}_{suffix}"
    lib = _library(_ELEMENTWISE_SOURCE, symbol, argtypes)
    return None if lib is None else getattr(lib, symbol)


def add_rms_norm(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """RMSNorm of `residual + delta` (the decoder's residual stream), in one pass: `residual`
    [rows, dim] contiguous becomes the sum, in place (with no `delta`, it stays), and the normed
    rows come back. fp32, or bf16 rounded as torch's bf16 ops round. None where the kernel does
    not apply or did not build."""
    if not (residual.is_contiguous() and weight.is_contiguous()):
        return None
    fn = _elementwise("add_rms_norm", (_PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_float, ctypes.c_int),
                      residual, weight, *(() if delta is None else (delta,)))
    if fn is None:
        return None
    rows, dim = residual.shape
    out = torch.empty_like(residual)
    d_ptr, (d_row, d_col) = (None, (0, 0)) if delta is None else (delta.data_ptr(), delta.stride())
    fn(residual.data_ptr(), d_ptr, d_row, d_col, weight.data_ptr(), out.data_ptr(), rows, dim, eps,
       torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for the gate/up projection's output [rows, 2 * inter] (any strides, fp32 or
    bf16), into a new contiguous [rows, inter]; None where the kernel does not apply or did not
    build."""
    fn = _elementwise("silu_mul", (_PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int), gate_up)
    if fn is None:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    fn(out.data_ptr(), gate_up.data_ptr(), *gate_up.stride(), rows, inter, torch.get_num_threads())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotary embedding of `x` [rows, heads, dim] (any strides) with `cos`/`sin` [rows, 1, dim]
    contiguous, all fp32 or all bf16, into a new contiguous tensor (transformers' rotate_half
    form); None where the kernel does not apply or did not build."""
    if not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    fn = _elementwise("rope", (_PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int), x, cos, sin)
    if fn is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    fn(out.data_ptr(), x.data_ptr(), *x.stride(), cos.data_ptr(), sin.data_ptr(), *x.shape, torch.get_num_threads())
    return out


def pin_omp_threads(cores: list[int]) -> bool:
    """Pin thread i of the calling thread's OpenMP pool (torch's intra-op threads) to cores[i],
    sizing the pool to len(cores) (kernels/cpu/threads.c). False where the helper did not build
    or a core could not be taken (the pool is sized all the same)."""
    torch.set_num_threads(len(cores))
    lib = _library(Path(__file__).with_name("threads.c"), "bind_omp_threads", (_PTR, ctypes.c_int))
    if lib is None:
        return False
    lib.bind_omp_threads.restype = ctypes.c_int
    return lib.bind_omp_threads((ctypes.c_int * len(cores))(*cores), len(cores)) == len(cores)


KV_DTYPES = (torch.float32, torch.bfloat16)  # what the decode kernel's cache may hold


def decode_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     lib: ctypes.CDLL | None = None) -> None:
    """out, query: [S, H, D] contiguous fp32; kv_cache: one layer's [blocks, 2, bs, kv_heads, D]
    view with contiguous head_dim, fp32 or bf16 (read widened, summed in fp32); block_tables
    [S, max_blocks] int32; context_lens [S] int32. `lib`: a variant build (`decode_variant`)."""
    lib = lib or load()
    s_block, s_kv, s_tok, s_head, s_d = kv_cache.stride()
    assert s_d == 1 and query.is_contiguous() and out.is_contiguous()
    assert query.dtype == out.dtype == torch.float32 and kv_cache.dtype in KV_DTYPES
    num_seqs, num_heads, head_dim = query.shape
    lib.paged_decode_attention_f32(
        out.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        num_seqs, num_heads, kv_cache.shape[3], head_dim, kv_cache.shape[2], block_tables.shape[1],
        s_block, s_kv, s_tok, s_head, scale, torch.get_num_threads(), int(kv_cache.dtype == torch.bfloat16))


_PREFILL_SOURCE = Path(__file__).with_name("paged_prefill_attention.c")


@functools.cache
def load_prefill() -> ctypes.CDLL | None:
    lib = _library(_PREFILL_SOURCE, "paged_prefill_attention",
                   (_PTR,) * 7 + (_I64,) * 10 + (ctypes.c_float, ctypes.c_int, ctypes.c_int))
    if lib is not None:
        lib.paged_prefill_attention.restype = ctypes.c_int
        lib.paged_prefill_attention_has_bf16.restype = ctypes.c_int
    return lib


@functools.cache
def prefill_takes(dtype: torch.dtype) -> bool:
    """Whether the C prefill kernel takes queries and a cache of `dtype`: fp32 wherever it builds,
    bf16 where the CPU has AVX512-BF16 (its dot products). Asked once per dtype: every layer of a
    prompt step asks."""
    lib = load_prefill()
    return lib is not None and (dtype == torch.float32
                                or dtype == torch.bfloat16 and bool(lib.paged_prefill_attention_has_bf16()))


@dataclass(slots=True)
class PrefillSeqs:
    """The step's prompt chunks for the C prefill kernel (int32, contiguous): each one's first
    row in the step, its new tokens, its whole context so far, its block table."""
    q_start: torch.Tensor
    q_len: torch.Tensor
    ctx_len: torch.Tensor
    block_tables: torch.Tensor


def prefill_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, seqs: PrefillSeqs,
                      scale: float) -> bool:
    """Causal attention of every chunk's rows of `query` over its paged context, into the same
    rows of `out` (kernels/cpu/paged_prefill_attention.c); both [T, H, D] contiguous, of the
    cache's dtype (`prefill_takes`). False, with nothing written, for dtypes and shapes the kernel
    does not take (head sizes other than 64 and 128, more than 8 query heads per KV head)."""
    if not (query.dtype == out.dtype == kv_cache.dtype and prefill_takes(kv_cache.dtype)):
        return False
    lib = load_prefill()
    s_block, s_kv, s_tok, s_head, s_d = kv_cache.stride()
    assert s_d == 1 and query.is_contiguous() and out.is_contiguous()
    num_heads, head_dim = query.shape[1], query.shape[2]
    return lib.paged_prefill_attention(
        out.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), seqs.block_tables.data_ptr(), seqs.q_start.data_ptr(),
        seqs.q_len.data_ptr(), seqs.ctx_len.data_ptr(), seqs.q_len.shape[0], num_heads, kv_cache.shape[3], head_dim,
        kv_cache.shape[2], seqs.block_tables.shape[1], s_block, s_kv, s_tok, s_head, scale,
        torch.get_num_threads(), int(kv_cache.dtype == torch.bfloat16)) == 0


def usable(device: str, dtype: torch.dtype) -> bool:
    """Checks the device and dtype before building: only a CPU fp32 or bf16 run compiles the kernel."""
    return str(device) == "cpu" and dtype in KV_DTYPES and available()


@dataclass(slots=True)
class CpuMetadata:
    prefills: reference.AttentionMetadata  # every token's slot, the prefills' groups: the torch path
    decode_rows: torch.Tensor  # [D] flat index of each decode's query (and each small chunk token's)
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32, contiguous
    decode_context_lens: torch.Tensor  # [D] int32
    backend: CpuBackend
    only_decodes: bool = False  # every row of the step is a decode row, in order (no prefill work)
    prefill_seqs: PrefillSeqs | None = None  # the prompt chunks, for the C prefill kernel (no groups then)
    torch_prefill_groups: object = None  # () -> the same chunks as torch groups, if the kernel declines


# Chunks over cached context of up to this many tokens (speculative drafts, a P/D decode
# replica's prompt tails) run on the C kernel too, as one decode query per token whose context
# ends at that token: their context is read once per token, which for a few tokens costs less
# than the torch path's gather into a fresh layout plus SDPA (a 5-token verify step of SmolLM2
# at 200-token contexts went through the gather path before).
SMALL_CHUNK = 8


class CpuBackend:
    """Decodes (and small chunks over cached context) on the C decode kernel, prompt chunks on the
    C prefill kernel (fp32 caches; bf16 ones on CPUs with AVX512-BF16), both reading the paged
    cache in place (no gather); the rest (shapes and dtypes the kernels decline) on the torch
    reference."""

    name = "cpu"

    def __init__(self, kv_dtype: torch.dtype = torch.float32):
        self._torch = reference.TorchBackend("cpu")
        # Prompt chunks on the C prefill kernel where it takes the cache's dtype, until a model's
        # shape (or a query dtype other than the cache's) is one it declines: then the torch
        # path, from that step on.
        self._prefill_in_c = prefill_takes(kv_dtype)

    def build_metadata(self, query_lens, context_lens, block_tables, slot_mapping, block_size: int,
                       max_gather_tokens: int = 1 << 30) -> CpuMetadata:
        query_lens, context_lens = query_lens.long(), context_lens.long()
        starts = reference.query_starts(query_lens)
        small = (query_lens > 1) & (query_lens <= SMALL_CHUNK) & (context_lens > query_lens)
        chunks = (query_lens > 1) & ~small

        def torch_groups() -> list:
            groups = reference.prefill_groups(query_lens, context_lens, block_tables, block_size)
            if bool(small.any()):
                small_starts = set(starts[small].tolist())
                groups = [g for g in groups if int(g.token_index[0, 0]) not in small_starts]
            return groups

        seqs = None
        if self._prefill_in_c and bool(chunks.any()):
            index = torch.nonzero(chunks).flatten()
            seqs = PrefillSeqs(*(t[index].to(torch.int32).contiguous() for t in (starts, query_lens, context_lens)),
                               block_tables[index].to(torch.int32).contiguous())
            groups = []
        else:
            groups = torch_groups()
        prefills = reference.metadata_for(groups, slot_mapping, block_size)
        prefills.backend = self._torch
        # One query row per decode, and per token of each small chunk (its context ends there).
        owner = torch.nonzero((query_lens == 1) | small).flatten()
        counts = query_lens[owner]
        per_row = owner.repeat_interleave(counts)
        offset = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
        rows = starts[per_row] + offset
        lens = context_lens[per_row] - query_lens[per_row] + 1 + offset
        return CpuMetadata(prefills, rows, block_tables[per_row].to(torch.int32).contiguous(),
                           lens.to(torch.int32).contiguous(), self,
                           only_decodes=not groups and seqs is None and rows.numel() == int(query_lens.sum()),
                           prefill_seqs=seqs, torch_prefill_groups=torch_groups)

    def write_kv(self, key, value, kv_cache, meta: CpuMetadata) -> None:
        reference.write_kv(key, value, kv_cache, meta.prefills)

    def paged_attention(self, query, key, value, kv_cache, meta: CpuMetadata, scale: float) -> torch.Tensor:
        if meta.only_decodes:  # the kernel's rows are the step's rows: no gather, no scatter
            o = torch.empty(query.shape, dtype=torch.float32)
            decode_attention(o, query.float().contiguous(), kv_cache, meta.decode_block_tables,
                             meta.decode_context_lens, scale)
            return o.to(query.dtype)
        out = self._torch.paged_attention(query, key, value, kv_cache, meta.prefills, scale)
        if meta.prefill_seqs is not None:
            if not prefill_attention(out, query.contiguous(), kv_cache, meta.prefill_seqs, scale):
                self._prefill_in_c = False  # a shape the kernel declines: torch's path from now on
                meta.prefills.groups = meta.torch_prefill_groups()
                meta.prefill_seqs = None
                return self.paged_attention(query, key, value, kv_cache, meta, scale)
        if meta.decode_rows.numel():
            # fp32 queries and results whatever the cache holds: the kernel sums in fp32.
            o = torch.empty(meta.decode_rows.shape[0], query.shape[1], query.shape[2], dtype=torch.float32)
            decode_attention(o, query[meta.decode_rows].float().contiguous(), kv_cache, meta.decode_block_tables,
                             meta.decode_context_lens, scale)
            out[meta.decode_rows] = o.to(out.dtype)
        return out
