"""Triton paged attention for GPUs, tested on the CPU under `TRITON_INTERPRET=1`.

The same contract as `kernels/reference.py` (varlen steps of prefill chunks and decodes over
block tables, K/V written before attention), with metadata built once per step
(`build_metadata`). Triton is imported only when this package is: the CPU install never needs it.
"""

from kernels.triton.attention import TritonMetadata, build_metadata, paged_attention
from kernels.triton.write_kv import write_kv

__all__ = ["TritonBackend", "TritonMetadata", "build_metadata", "paged_attention", "write_kv"]


class TritonBackend:
    """The kernels read block size and strides from the cache itself: `build_metadata` only
    splits the step into prefills and decodes and moves it to the device."""

    name = "triton"

    def __init__(self, device: str):
        self.device = device

    def build_metadata(self, query_lens, context_lens, block_tables, slot_mapping, block_size: int,
                       max_gather_tokens: int = 1 << 30) -> TritonMetadata:
        meta = build_metadata(query_lens, context_lens, block_tables, slot_mapping, self.device)
        meta.backend = self
        return meta

    def write_kv(self, key, value, kv_cache, meta: TritonMetadata) -> None:
        write_kv(key, value, kv_cache, meta.slot_mapping)

    def paged_attention(self, query, key, value, kv_cache, meta: TritonMetadata, scale: float):
        return paged_attention(query, kv_cache, meta, scale)
