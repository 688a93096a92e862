"""Paged-attention kernels: the KV-cache write and varlen attention over block tables.

Backends share one contract (see `reference.py`); the torch one runs on any device and is the
oracle every other backend is tested against. `get_backend` is the one place that picks one.
This package knows no model and no scheduler. Importing it is cheap: a backend's module (and
triton) loads only when `get_backend` returns it. It must not define `__version__`:
transformers probes an unrelated Hugging Face package also imported as `kernels`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["BACKENDS", "AttentionBackend", "get_backend"]

BACKENDS = ("auto", "torch", "cpu", "triton")


class AttentionBackend(Protocol):
    """`build_metadata` runs once per step, from the step plan's CPU tensors; its metadata
    carries the backend (`meta.backend`) and serves every layer's `write_kv` and
    `paged_attention`. `block_size` and `max_gather_tokens` are for backends that gather."""

    name: str

    def build_metadata(self, query_lens: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                       slot_mapping: torch.Tensor, block_size: int, max_gather_tokens: int = 1 << 30): ...

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta) -> None: ...

    def paged_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                        meta, scale: float) -> torch.Tensor: ...


def get_backend(name: str, device: str, dtype: torch.dtype) -> AttentionBackend:
    """`auto`: triton on a GPU; on a CPU in fp32 or bf16 the C decode kernel when it builds; else torch."""
    from kernels import cpu

    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "auto":
        name = "triton" if device == "cuda" else "cpu" if cpu.usable(device, dtype) else "torch"
    if name == "triton":
        if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend 'triton' needs device cuda (on a CPU it runs only in Triton's "
                             "interpreter, TRITON_INTERPRET=1, for tests): use 'auto' or 'torch'")
        from kernels.triton import TritonBackend  # fails here, clearly, when triton is missing

        return TritonBackend(device)
    if name == "cpu":
        if not cpu.usable(device, dtype):
            raise ValueError("attention_backend 'cpu' needs device cpu, dtype float32 or bfloat16 and a C "
                             "compiler (cc)")
        return cpu.CpuBackend(dtype)
    from kernels.reference import TorchBackend

    return TorchBackend(device)

