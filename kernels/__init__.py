"""Paged-attention kernels: the KV-cache write and varlen attention over block tables.

Implementations share one contract (see `reference.py`); the torch one runs on any device and
is the oracle every other backend is tested against. This package knows no model and no
scheduler. It must not define `__version__`: transformers probes an unrelated Hugging Face
package also imported as `kernels`.
"""

from kernels import reference
from kernels.reference import AttentionMetadata, build_attention_metadata

__all__ = ["AttentionMetadata", "build_attention_metadata", "paged_attention", "write_kv"]


def write_kv(key, value, kv_cache, meta) -> None:
    """Store the step's new K/V; the backend is the one that built `meta` (torch/C or Triton)."""
    if isinstance(meta, AttentionMetadata):
        reference.write_kv(key, value, kv_cache, meta)
    else:
        meta.write_kv(key, value, kv_cache)


def paged_attention(query, key, value, kv_cache, meta, scale: float):
    if isinstance(meta, AttentionMetadata):
        return reference.paged_attention(query, key, value, kv_cache, meta, scale)
    return meta.paged_attention(query, kv_cache, scale)
