"""The CPU KV pool is zeroed lazily: its pages come from the kernel zero-filled on first touch, so
allocating the pool costs neither time nor resident memory until blocks are written, and the
memory goes back when the pool is freed (a rebuilt worker group allocates a new one)."""

import ctypes
import errno
import gc
import mmap

import pytest
import torch

from pagedserve import LLM
from workers.kv_cache import KVCacheSpec, available_memory

MIB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def _resident_bytes(address: int, nbytes: int) -> int | None:
    """How much of [address, address + nbytes) is resident, by mincore(2) over exactly that range
    (the process's RSS moved by hundreds of MiB on a CI machine as other memory came and went);
    None once the range is no longer mapped (ENOMEM)."""
    page = mmap.PAGESIZE
    start = address - address % page  # mincore takes a page-aligned start
    nbytes += address - start
    pages = (nbytes + page - 1) // page
    vector = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(nbytes), vector) != 0:
        if ctypes.get_errno() == errno.ENOMEM:
            return None
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(byte & 1 for byte in vector) * page


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
    pool = spec.allocate(num_blocks, "cpu")
    address, nbytes = pool.data_ptr(), pool.numel() * pool.element_size()
    # torch.zeros would have written (made resident) all 384 MiB here.
    assert _resident_bytes(address, nbytes) == 0
    pool[:8].fill_(2.0)  # 8 blocks: 1 MiB
    # Those pages only (a machine with transparent huge pages faults in 2 MiB at a time).
    assert 8 * spec.block_bytes <= _resident_bytes(address, nbytes) <= 8 * MIB
    pool.fill_(1.0)
    assert _resident_bytes(address, nbytes) > 300 * MIB  # the pool is real memory once written
    view = pool[10:12]
    del pool
    gc.collect()
    assert _resident_bytes(address, nbytes) > 300 * MIB  # a view keeps the mapping alive
    assert view.sum().item() == view.numel()
    del view
    gc.collect()
    assert (_resident_bytes(address, nbytes) or 0) < 32 * MIB  # unmapped with its last tensor


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
