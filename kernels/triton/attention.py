"""Paged attention in Triton: a tiled kernel for prefill chunks (over their cached context), and a
split-K kernel for decodes, whose long contexts are cut into splits that run in parallel and are
combined afterwards (flash-decoding).

Every kernel reads K/V straight from the paged cache, one token tile at a time, looking up each
token's block in the block table (so any block size works with tiles of 16+ tokens, as
`tl.dot` needs); softmax is online (running max and sum) in fp32 whatever the cache dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
PREFILL_BLOCK_M = 16  # query rows per program
BLOCK_N = 32  # context tokens per iteration
SPLIT_MIN_TOKENS = 512  # a decode split covers at least this much context
MAX_SPLITS = 16
TARGET_PROGRAMS = 256  # ~2 waves of an H200's 132 SMs: below it, decodes split their context
# "sum" is the default: it is the one measured on a GPU so far (13% of an H200's bandwidth at 64 x
# 4,096 tokens, benchmarks/gpu/README.md); "dot" is the candidate that check.sh times beside it.
DECODE_KERNELS = ("sum", "dot")
# The engine's choice, for comparing the two end to end on a GPU without a code change (read at
# each launch whose metadata names none: benchmarks/gpu/check.py sets it between engines).
DEFAULT_DECODE_KERNEL = os.environ.get("PAGEDSERVE_TRITON_DECODE", "sum")
if DEFAULT_DECODE_KERNEL not in DECODE_KERNELS:
    raise ValueError(f"PAGEDSERVE_TRITON_DECODE must be one of {', '.join(DECODE_KERNELS)}; "
                     f"got {DEFAULT_DECODE_KERNEL!r}")


@triton.jit
def _load_kv_tile(cache_ptr, table_ptr, start, end, kv_head, d, d_ok, stride_block, stride_kv, stride_slot,
                  stride_head, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """K and V `[BLOCK_N, D_PAD]` of positions start.. of one sequence (`table_ptr`: its block
    table row), each token's block looked up in the table; positions >= end read as zeros."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < end
    block = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    k_ptrs = (cache_ptr + block[:, None] * stride_block + (n % BLOCK_SIZE)[:, None] * stride_slot
              + kv_head * stride_head + d[None, :])
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(k_ptrs + stride_kv, mask=kv_mask, other=0.0)
    return k, v, n, n_ok


@triton.jit
def _decode_program(q_ptr, rows_ptr, context_lens_ptr, stride_qt, stride_qh, NUM_SPLITS: tl.constexpr,
                    REP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """What a decode program (one per decode, KV head and split) works on: its context positions
    [lo, hi), equal chunks of whole tiles per split, and the query rows `[ROWS, D_PAD]` of the REP
    heads that share its KV head (rows past REP zero, as are columns past HEAD_DIM)."""
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + i)
    row = tl.load(rows_ptr + i).to(tl.int64)
    per_split = (ctx + NUM_SPLITS - 1) // NUM_SPLITS
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(ctx, lo + chunk)
    r = tl.arange(0, ROWS)
    r_ok = r < REP
    heads = kv_head * REP + r
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    return i, kv_head, split, lo, hi, heads, r_ok, d, d_ok, q


@triton.jit
def _softmax_step(qk, n_ok, m_i, l_i):
    """One tile of a decode's running softmax: the tile's scores `qk` [rows, BLOCK_N] (positions
    past the context masked by `n_ok`) against the running max `m_i` and sum `l_i`. Returns the
    tile's weights, the factor rescaling what was summed before, and the new max and sum."""
    qk = tl.where(n_ok[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp(qk - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _store_partials(part_acc_ptr, part_ml_ptr, acc, m_i, l_i, i, heads, r_ok, split, d, d_ok,
                    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A split's unnormalized output and (max, sum) for the combine: part_acc [decodes, heads,
    splits, HEAD_DIM]; part_ml [decodes, heads, splits, 2]."""
    slot = (i * NUM_HEADS + heads) * NUM_SPLITS + split
    tl.store(part_acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], acc, mask=r_ok[:, None] & d_ok[None, :])
    tl.store(part_ml_ptr + slot * 2, m_i, mask=r_ok)
    tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=r_ok)


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, out_ptr, tables_ptr, query_start_ptr, query_lens_ptr, context_lens_ptr,
                    scale, stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_block, stride_kv, stride_slot, stride_head, stride_table,
                    REP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    DOT_IN_FP32: tl.constexpr):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(query_lens_ptr + seq)
    if tile * BLOCK_M < q_len:
        ctx = tl.load(context_lens_ptr + seq)
        first = tl.load(query_start_ptr + seq).to(tl.int64)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_pos = ctx - q_len + rows  # each query row's position in its sequence
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + (first + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            q = q.to(tl.float32)
        kv_head = head // REP
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, D_PAD], 0.0, tl.float32)
        end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)  # causal: up to the tile's last row
        for start in range(0, end, BLOCK_N):
            k, v, n, n_ok = _load_kv_tile(cache_ptr, tables_ptr + seq * stride_table, start, end, kv_head, d, d_ok,
                                          stride_block, stride_kv, stride_slot, stride_head, BLOCK_SIZE, BLOCK_N)
            if DOT_IN_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            qk = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (first + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_kernel(q_ptr, cache_ptr, part_acc_ptr, part_ml_ptr, tables_ptr, rows_ptr, context_lens_ptr,
                   scale, stride_qt, stride_qh, stride_block, stride_kv, stride_slot, stride_head, stride_table,
                   NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (decode, KV head, split): the REP query heads sharing the KV head read its
    context once. Writes its unnormalized output and (max, sum) for the combine."""
    i, kv_head, split, lo, hi, heads, r_ok, d, d_ok, q = _decode_program(
        q_ptr, rows_ptr, context_lens_ptr, stride_qt, stride_qh, NUM_SPLITS, REP, REP_PAD, HEAD_DIM, D_PAD, BLOCK_N)
    q = q.to(tl.float32)
    m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([REP_PAD], 0.0, tl.float32)
    acc = tl.full([REP_PAD, D_PAD], 0.0, tl.float32)
    for start in range(lo, hi, BLOCK_N):
        k, v, n, n_ok = _load_kv_tile(cache_ptr, tables_ptr + i * stride_table, start, hi, kv_head, d, d_ok,
                                      stride_block, stride_kv, stride_slot, stride_head, BLOCK_SIZE, BLOCK_N)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        qk = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [REP_PAD, BLOCK_N]
        p, alpha, m_i, l_i = _softmax_step(qk, n_ok, m_i, l_i)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    _store_partials(part_acc_ptr, part_ml_ptr, acc, m_i, l_i, i, heads, r_ok, split, d, d_ok,
                    NUM_HEADS, NUM_SPLITS, HEAD_DIM)


@triton.jit
def _decode_dot_kernel(q_ptr, cache_ptr, part_acc_ptr, part_ml_ptr, tables_ptr, rows_ptr, context_lens_ptr,
                       scale, stride_qt, stride_qh, stride_block, stride_kv, stride_slot, stride_head, stride_table,
                       NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, REP: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """`_decode_kernel`'s contract on the matrix units: the REP query heads of a KV head are the
    rows of a GROUP-row tile (GROUP >= 16, as `tl.dot` needs; the padding rows are zero and never
    stored), so q.K^T and p.V are `tl.dot`s over BLOCK_N tokens at a time, whose loads Triton can
    pipeline, instead of broadcast products held in registers."""
    i, kv_head, split, lo, hi, heads, r_ok, d, d_ok, q = _decode_program(
        q_ptr, rows_ptr, context_lens_ptr, stride_qt, stride_qh, NUM_SPLITS, REP, GROUP, HEAD_DIM, D_PAD, BLOCK_N)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP], float("-inf"), tl.float32)
    l_i = tl.full([GROUP], 0.0, tl.float32)
    acc = tl.full([GROUP, D_PAD], 0.0, tl.float32)
    for start in range(lo, hi, BLOCK_N):
        k, v, n, n_ok = _load_kv_tile(cache_ptr, tables_ptr + i * stride_table, start, hi, kv_head, d, d_ok,
                                      stride_block, stride_kv, stride_slot, stride_head, BLOCK_SIZE, BLOCK_N)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [GROUP, BLOCK_N]
        p, alpha, m_i, l_i = _softmax_step(qk, n_ok, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    _store_partials(part_acc_ptr, part_ml_ptr, acc, m_i, l_i, i, heads, r_ok, split, d, d_ok,
                    NUM_HEADS, NUM_SPLITS, HEAD_DIM)


@dataclass
class TritonMetadata:
    """One step's inputs on the device, for every layer."""

    slot_mapping: torch.Tensor  # [T] int64
    prefill_query_start: torch.Tensor  # [P] int32, flat index of each prefill's first query
    prefill_query_lens: torch.Tensor
    prefill_context_lens: torch.Tensor
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    max_prefill_query_len: int
    decode_rows: torch.Tensor  # [D] int64, flat index of each decode's query
    decode_context_lens: torch.Tensor  # [D] int32
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    max_decode_context: int
    num_splits: int | None = None  # decodes' split-K factor; None: chosen per launch
    decode_kernel: str | None = None  # "sum" (_decode_kernel), "dot" (_decode_dot_kernel); None: the default
    backend: object = None  # the TritonBackend that built it: model layers call through it


def build_metadata(query_lens: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                   slot_mapping: torch.Tensor, device, num_splits: int | None = None) -> TritonMetadata:
    """From a step plan's arrays (CPU tensors): split its sequences into prefills and decodes."""
    query_lens = query_lens.long()
    starts = torch.zeros_like(query_lens)
    starts[1:] = torch.cumsum(query_lens, 0)[:-1]
    is_decode = query_lens == 1
    pre, dec = (~is_decode).nonzero().flatten(), is_decode.nonzero().flatten()

    def to(t, dtype):
        return t.to(device=device, dtype=dtype).contiguous()

    return TritonMetadata(
        slot_mapping=to(slot_mapping, torch.int64),
        prefill_query_start=to(starts[pre], torch.int32), prefill_query_lens=to(query_lens[pre], torch.int32),
        prefill_context_lens=to(context_lens[pre], torch.int32), prefill_block_tables=to(block_tables[pre], torch.int32),
        max_prefill_query_len=int(query_lens[pre].max()) if len(pre) else 0,
        decode_rows=to(starts[dec], torch.int64), decode_context_lens=to(context_lens[dec], torch.int32),
        decode_block_tables=to(block_tables[dec], torch.int32),
        max_decode_context=int(context_lens[dec].max()) if len(dec) else 0,
        num_splits=num_splits)


def choose_num_splits(num_decodes: int, num_kv_heads: int, max_context: int) -> int:
    """Split long contexts only while the grid is too small to fill the GPU."""
    programs = num_decodes * num_kv_heads
    if programs >= TARGET_PROGRAMS:
        return 1
    by_length = max(1, max_context // SPLIT_MIN_TOKENS)
    return max(1, min(MAX_SPLITS, by_length, triton.cdiv(TARGET_PROGRAMS, max(programs, 1))))


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: TritonMetadata, scale: float) -> torch.Tensor:
    """query `[T, heads, head_dim]` (K/V of the step already written); returns `[T, heads, head_dim]`."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    rep = num_heads // num_kv_heads
    if query.stride(2) != 1:
        query = query.contiguous()
    out = torch.empty_like(query)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    cache_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
    num_prefills = meta.prefill_query_lens.shape[0]
    if num_prefills:
        grid = (num_prefills, triton.cdiv(meta.max_prefill_query_len, PREFILL_BLOCK_M), num_heads)
        _prefill_kernel[grid](
            query, kv_cache, out, meta.prefill_block_tables, meta.prefill_query_start, meta.prefill_query_lens,
            meta.prefill_context_lens, scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *cache_strides, meta.prefill_block_tables.stride(0),
            REP=rep, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=PREFILL_BLOCK_M,
            BLOCK_N=BLOCK_N, **_dot_options(query, kv_cache))
    num_decodes = meta.decode_rows.shape[0]
    if num_decodes:
        splits = meta.num_splits or choose_num_splits(num_decodes, num_kv_heads, meta.max_decode_context)
        part_acc = torch.empty((num_decodes, num_heads, splits, head_dim), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((num_decodes, num_heads, splits, 2), dtype=torch.float32, device=query.device)
        args = (query, kv_cache, part_acc, part_ml, meta.decode_block_tables, meta.decode_rows,
                meta.decode_context_lens, scale, query.stride(0), query.stride(1), *cache_strides,
                meta.decode_block_tables.stride(0))
        grid = (num_decodes, num_kv_heads, splits)
        if (meta.decode_kernel or DEFAULT_DECODE_KERNEL) == "dot":
            _decode_dot_kernel[grid](*args, NUM_HEADS=num_heads, NUM_SPLITS=splits, REP=rep,
                                     GROUP=max(16, triton.next_power_of_2(rep)), BLOCK_SIZE=block_size,
                                     HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_N=BLOCK_N, **_dot_options(query, kv_cache))
        else:
            _decode_kernel[grid](*args, NUM_HEADS=num_heads, NUM_SPLITS=splits, REP=rep,
                                 REP_PAD=triton.next_power_of_2(rep), BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
                                 D_PAD=d_pad, BLOCK_N=BLOCK_N)
        out[meta.decode_rows] = combine_splits(part_acc, part_ml).to(query.dtype)
    return out


def _dot_options(query: torch.Tensor, kv_cache: torch.Tensor) -> dict:
    """How the kernels' `tl.dot`s run: fp32 operands exactly ("ieee", not tf32); in fp32 when the
    query and cache dtypes differ, and under Triton's CPU interpreter (3.9) for bf16, whose tl.dot
    of bf16 operands it computes wrongly."""
    fp32 = query.dtype != kv_cache.dtype or (query.dtype == torch.bfloat16 and _INTERPRETED)
    return {"DOT_PRECISION": "ieee" if torch.float32 in (query.dtype, kv_cache.dtype) or fp32 else "tf32",
            "DOT_IN_FP32": fp32}


def combine_splits(part_acc: torch.Tensor, part_ml: torch.Tensor) -> torch.Tensor:
    """Merge the splits' partial softmaxes: weights exp(m_split - m_max); an empty split has
    m = -inf and weighs nothing. [D, H, S, hd] + [D, H, S, 2] -> [D, H, hd]."""
    m, l = part_ml[..., 0], part_ml[..., 1]
    m_max = m.max(dim=-1, keepdim=True).values
    w = torch.exp(m - m_max)
    return (part_acc * w[..., None]).sum(2) / (l * w).sum(-1)[..., None]
