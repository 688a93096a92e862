"""Paged-attention kernels: the KV-cache write and varlen attention over block tables.

Implementations share one contract (see `reference.py`); the torch one runs on any device and
is the oracle every other backend is tested against. This package knows no model and no
scheduler. It must not define `__version__`: transformers probes an unrelated Hugging Face
package also imported as `kernels`.
"""

from kernels.reference import AttentionMetadata, build_attention_metadata, paged_attention, write_kv

__all__ = ["AttentionMetadata", "build_attention_metadata", "paged_attention", "write_kv"]
