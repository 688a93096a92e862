"""Load a Llama-family model from a Hugging Face folder (safetensors, read tensor by tensor) or
a GGUF file (through transformers' GGUF loader, dequantized to dense tensors)."""

from __future__ import annotations

import glob
import os

import torch

from pagedserve.config import ModelSource
from workers.models.llama import LlamaForCausalLM, rope_tables
from workers.parallel import TensorParallel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return _DTYPES[name]


def load_model(source: ModelSource, hf_config, dtype: torch.dtype, device: str, max_positions: int,
               tp: TensorParallel = TensorParallel()) -> LlamaForCausalLM:
    """This rank's shard of the model: every rank reads the checkpoint and keeps its slices."""
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, max_positions, tp)
    # Buffers (rope tables) are computed, not loaded: build them for real on the target device.
    model = model.to_empty(device=device)
    model.rope_cos, model.rope_sin = (t.to(device) for t in rope_tables(hf_config, max_positions))
    model.load_weights(_named_tensors(source))
    return model.to(dtype=dtype).eval()


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
    from transformers import AutoModelForCausalLM, GgufConfig

    # Dense weights asked for explicitly: otherwise transformers keeps them packed when the
    # Hugging Face `kernels` package happens to be installed.
    hf_model = AutoModelForCausalLM.from_pretrained(
        source.directory, gguf_file=source.gguf_file, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    state = hf_model.state_dict()
    del hf_model
    yield from state.items()
