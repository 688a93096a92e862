"""Store a step's new K/V at their slots: one program per token, K and V of every KV head of the
token in one pass. A negative slot is a padding token (a CUDA graph's batch padded to its
captured size) and writes nothing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, stride_key, stride_value,
                     stride_block, stride_kv, stride_slot,
                     BLOCK_SIZE: tl.constexpr, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # token * stride may pass 2**31
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        cols = tl.arange(0, ROW_PAD)
        valid = cols < ROW
        k = tl.load(key_ptr + token * stride_key + cols, mask=valid)
        v = tl.load(value_ptr + token * stride_value + cols, mask=valid)
        base = cache_ptr + block * stride_block + offset * stride_slot
        tl.store(base + cols, k, mask=valid)
        tl.store(base + stride_kv + cols, v, mask=valid)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[T, kv_heads, head_dim] with each token's heads contiguous: a view of a QKV projection
    already is; any other layout is copied into it."""
    if (t.stride(2) != 1 and t.shape[2] > 1) or (t.stride(1) != t.shape[2] and t.shape[1] > 1):
        return t.contiguous()
    return t


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value `[T, kv_heads, head_dim]`; kv_cache one layer's `[num_blocks, 2, block_size,
    kv_heads, head_dim]` view; slot_mapping `[T]` (block * block_size + offset, or < 0 to skip)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key, value = _rows(key), _rows(value)
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    if kv_cache.stride(4) != 1 or kv_cache.stride(3) != head_dim or kv_cache.stride(2) != kv_heads * head_dim:
        raise ValueError("each KV cache slot's [kv_heads, head_dim] must be contiguous")
    row = kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, key.stride(0), value.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        BLOCK_SIZE=block_size, ROW=row, ROW_PAD=triton.next_power_of_2(row))
