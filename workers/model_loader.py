"""Load a Llama-family model from a Hugging Face folder (safetensors, read tensor by tensor) or
a GGUF file (through transformers' GGUF loader, dequantized to dense tensors).

Dequantizing a GGUF file takes most of a cold start (SmolLM2: ~25 s here), so its dense tensors
are kept as a safetensors file in the local cache (workers/gguf_cache.py): every later load (a
worker rebuilt after a fault, the next `pagedserve serve`) reads that file instead.
"""

from __future__ import annotations

import contextlib
import glob
import os

import torch
from torch import nn

from pagedserve.config import ModelSource
from workers.gguf_cache import dense_weights_path, write_dense_weights
from workers.kernel_choice import kept_f32_gemm
from workers.models.llama import LlamaForCausalLM, pack_weights
from workers.parallel import TensorParallel
from workers.quantization import check_supported, quantize_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return _DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`kv_cache_dtype`: 'auto' is the model's dtype."""
    return model_dtype if name == "auto" else _DTYPES[name]


def load_model(source: ModelSource, hf_config, dtype: torch.dtype, device: str, max_positions: int,
               tp: TensorParallel = TensorParallel(), quantization: str = "none") -> LlamaForCausalLM:
    """This rank's shard of the model: every rank reads the checkpoint and keeps its slices
    (then quantizes them, with `quantization` "int8": workers/quantization.py)."""
    # Built on the device with its parameters left uninitialized (the loaded weights fill them):
    # building on "meta" and then to_empty() cost a second here, where torch's empty_like on meta
    # tensors goes through its reference ops and imports sympy.
    with torch.device(device), _no_weight_init():
        model = LlamaForCausalLM(hf_config, max_positions, tp)
    model.load_weights(_named_tensors(source))
    model = model.to(dtype=dtype).eval()
    if quantization != "none":
        check_supported(quantization, device)
        quantize_model(model, dtype)
    # fp32 for the GEMM this machine was measured to run fastest, where that is kept (else the
    # default, until measured), and bf16 with bf16 arithmetic (oneDNN's)
    pack_weights(model, kept_f32_gemm(model) if device == "cpu" else None)
    return model


@contextlib.contextmanager
def _no_weight_init():
    """Skip the random init of layers whose weights are loaded next: seconds of a worker's start
    on a CPU for nothing (on the meta device no work, but torch routes it through its reference
    ops, whose first use imports torch._dynamo)."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    for cls in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, reset in saved.items():
            cls.reset_parameters = reset


def _named_tensors(source: ModelSource):
    if source.gguf_file:
        yield from _gguf_tensors(source)
        return
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(source.directory, "*.safetensors")))
    if not files:
        raise ValueError(f"model folder {source.directory!r} holds no .safetensors files")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _gguf_tensors(source: ModelSource):
    cached = dense_weights_path(source)
    if cached.exists():
        from safetensors import safe_open

        with safe_open(str(cached), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
        return
    from transformers import AutoModelForCausalLM, GgufConfig

    # Dense weights asked for explicitly: otherwise transformers keeps them packed when the
    # Hugging Face `kernels` package happens to be installed.
    hf_model = AutoModelForCausalLM.from_pretrained(
        source.directory, gguf_file=source.gguf_file, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    state = hf_model.state_dict()
    del hf_model
    write_dense_weights(state, source)
    yield from state.items()
