"""Triton paged attention for GPUs, tested on the CPU under `TRITON_INTERPRET=1`.

The same contract as `kernels/reference.py` (varlen steps of prefill chunks and decodes over
block tables, K/V written before attention), with metadata built once per step
(`build_metadata`). Triton is imported only when this package is: the CPU install never needs it.
"""

from kernels.triton.attention import TritonMetadata, build_metadata, paged_attention
from kernels.triton.write_kv import write_kv

__all__ = ["TritonMetadata", "build_metadata", "paged_attention", "write_kv"]
