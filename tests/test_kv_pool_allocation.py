"""The CPU KV pool is zeroed lazily: its pages come from the kernel zero-filled on first touch, so
allocating the pool costs neither time nor resident memory until blocks are written, and the
memory goes back when the pool is freed (a rebuilt worker group allocates a new one)."""

import gc

import psutil
import pytest
import torch

from pagedserve import LLM
from workers.kv_cache import KVCacheSpec, available_memory

MIB = 1 << 20


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_reads_as_zeros_in_the_spec_shape(dtype):
    spec = KVCacheSpec(num_layers=3, block_size=16, num_kv_heads=2, head_dim=8, dtype=dtype)
    pool = spec.allocate(7, "cpu")
    assert pool.shape == (7, 3, 2, 16, 2, 8) and pool.dtype == dtype and pool.is_contiguous()
    assert pool.data_ptr() % 4096 == 0  # page-aligned: a block copy never straddles a stray page
    assert not pool.any()
    pool[4, 1] = 1.5
    assert pool.sum().item() == 1.5 * 2 * 16 * 2 * 8
    assert pool[:4].abs().sum().item() == 0 and pool[5:].abs().sum().item() == 0


def test_an_empty_pool_is_allowed():
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    assert spec.allocate(0, "cpu").shape == (0, 2, 2, 16, 1, 4)


def test_pool_is_resident_only_where_written_and_freed_with_the_tensor():
    spec = KVCacheSpec(num_layers=4, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    num_blocks = (384 * MIB) // spec.block_bytes  # 384 MiB of pool, 128 KiB blocks
    before = _rss()
    pool = spec.allocate(num_blocks, "cpu")
    allocated = _rss()
    # torch.zeros would have written (made resident) all 384 MiB here.
    assert allocated - before < 32 * MIB, f"allocating made {(allocated - before) / MIB:.0f} MiB resident"
    pool[:8].fill_(2.0)  # 8 blocks: 1 MiB
    assert _rss() - allocated < 32 * MIB
    pool.fill_(1.0)
    touched = _rss()
    assert touched - before > 300 * MIB  # the pool is real memory once written
    view = pool[10:12]
    del pool
    assert _rss() > touched - 32 * MIB  # a view keeps the mapping alive
    assert view.sum().item() == view.numel()
    del view
    assert _rss() < touched - 300 * MIB  # unmapped with its last tensor


def test_a_pool_larger_than_the_nodes_available_memory_is_refused_naming_the_field(tiny_llama):
    """Its pages would be taken only as blocks fill: unchecked, it would start and be killed later."""
    available = available_memory()
    assert available is not None and available > 0
    spec = KVCacheSpec(num_layers=4, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    too_many = 2 * available // spec.block_bytes
    with pytest.raises(ValueError, match=r"kv_cache_memory: a KV pool of \d+ blocks .* does not fit in this "
                                         r"node's available memory"):
        spec.allocate(too_many, "cpu")
    assert spec.allocate(4, "cpu").shape[0] == 4
    with pytest.raises(ValueError, match="lower kv_cache_memory"):
        LLM(tiny_llama, kv_cache_memory=2 * available)
