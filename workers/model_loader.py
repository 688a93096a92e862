"""Load a Llama-family model from a Hugging Face folder (safetensors, read tensor by tensor) or
a GGUF file (through transformers' GGUF loader, dequantized to dense tensors).

Dequantizing a GGUF file takes most of a cold start (SmolLM2: ~25 s here), so its dense tensors
are kept as a safetensors file in the local cache (`pagedserve.config.cache_dir()`), keyed by the
file's path, size, mtime and the transformers version: every later load (a worker rebuilt after
a fault, the next `pagedserve serve`) reads that file instead.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from pagedserve.config import ModelSource, cache_dir
from workers.models.llama import LlamaForCausalLM, rope_tables
from workers.parallel import TensorParallel
from workers.quantization import check_supported, quantize_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger(__name__)


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return _DTYPES[name]


def load_model(source: ModelSource, hf_config, dtype: torch.dtype, device: str, max_positions: int,
               tp: TensorParallel = TensorParallel(), quantization: str = "none") -> LlamaForCausalLM:
    """This rank's shard of the model: every rank reads the checkpoint and keeps its slices
    (then quantizes them, with `quantization` "int8": workers/quantization.py)."""
    with torch.device("meta"), _no_weight_init():
        model = LlamaForCausalLM(hf_config, max_positions, tp)
    # Buffers (rope tables) are computed, not loaded: build them for real on the target device.
    model = model.to_empty(device=device)
    model.rope_cos, model.rope_sin = (t.to(device) for t in rope_tables(hf_config, max_positions))
    model.load_weights(_named_tensors(source))
    model = model.to(dtype=dtype).eval()
    if quantization != "none":
        check_supported(quantization, device)
        quantize_model(model, dtype)
    return model


@contextlib.contextmanager
def _no_weight_init():
    """Skip the random init of layers whose weights are loaded next: on the meta device it does
    no work, but torch routes it through its reference ops, whose first use imports
    torch._dynamo (seconds of a worker's start)."""
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


def dense_cache_path(source: ModelSource) -> Path:
    """Where the dequantized tensors of a GGUF source are kept."""
    import transformers

    path = Path(source.directory, source.gguf_file).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}".encode()
    return cache_dir() / "weights" / f"{path.stem}-{hashlib.blake2b(key, digest_size=8).hexdigest()}.safetensors"


def _gguf_tensors(source: ModelSource):
    cached = dense_cache_path(source)
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
    _write_dense_cache(state, cached)
    yield from state.items()


def _write_dense_cache(state: dict, target: Path) -> None:
    """Best effort: a cache that cannot be written only costs the next load its time. Tied
    tensors (one storage under two names) are kept once, under the first name; the model ties
    them again itself. Written to a temporary name, then renamed: concurrent loads (the ranks of
    one group) never read half a file."""
    from safetensors.torch import save_file

    seen_tensors, seen_storages, unique = set(), set(), {}
    for name, tensor in state.items():
        storage = tensor.untyped_storage().data_ptr()
        ident = (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        if ident in seen_tensors:
            continue  # tied: the same tensor under a second name
        seen_tensors.add(ident)
        # Another view of a storage already kept must not share it: safetensors refuses that.
        unique[name] = tensor.clone() if storage in seen_storages else tensor.contiguous()
        seen_storages.add(storage)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".safetensors", dir=target.parent)
        os.close(fd)
        try:
            save_file(unique, tmp)
            os.replace(tmp, target)
            _remove_stale_caches(target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        log.warning("the dense weights could not be cached at %s (%s); the next load dequantizes again",
                    target, e)


def _remove_stale_caches(current: Path) -> None:
    """Older caches of the same file (a reinstalled package gives it a new mtime, hence a new
    key): each is the model's size, and nothing reads them again."""
    stem = current.stem.rsplit("-", 1)[0]
    for path in current.parent.glob(f"{glob.escape(stem)}-*.safetensors"):
        if path != current and path.stem.rsplit("-", 1)[0] == stem:
            try:
                path.unlink()
            except OSError:
                pass
