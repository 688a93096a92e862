"""A GGUF file's converted parts, kept on local disk so that only the first load converts them.

transformers reads a GGUF file in Python: its config takes ~7 s, its tokenizer ~9 s and its
dequantized weights ~25 s (SmolLM2 here), and every process that loads the model (the
coordinator for the tokenizer, each worker for the config and its weights) would pay again. The
first load writes each part in Hugging Face form under

    cache_dir()/gguf/<file stem>-<key>/{config/, tokenizer/, model.safetensors}

keyed by the file's path, size, mtime and the transformers version; every later load reads them
in well under a second. The config's every attribute is kept as plain JSON too, which the
coordinator and the workers read without importing transformers (seconds more). Torch-free at
import: the coordinator loads tokenizers through it.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pagedserve.config import ModelSource, cache_dir

log = logging.getLogger(__name__)
ATTRIBUTES_FILE = "attributes.json"


def cache_folder(source: ModelSource) -> Path:
    """The folder holding `source`'s converted parts (a GGUF source only)."""
    path = Path(source.directory, source.gguf_file).resolve()
    stat = path.stat()
    # The version from the package's metadata: importing transformers costs seconds.
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{importlib.metadata.version('transformers')}".encode()
    return cache_dir() / "gguf" / f"{path.stem}-{hashlib.blake2b(key, digest_size=8).hexdigest()}"


def dense_weights_path(source: ModelSource) -> Path:
    return cache_folder(source) / "model.safetensors"


def load_tokenizer(source: ModelSource, folder: str | None = None):
    """The model's tokenizer: from its folder, or from a GGUF file's cached conversion; or the one
    in `folder` (a tokenizer kept apart from the weights)."""
    if folder is None and source.gguf_file:
        return _cached_part(source, "tokenizer", _auto_tokenizer, read_cached=_saved_tokenizer)
    folder = folder if folder is not None else source.directory
    try:
        return _auto_tokenizer(folder)
    except Exception as e:  # transformers' reasons run over several lines
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise ValueError(f"tokenizer: none could be loaded from {folder} ({reason}); where the tokenizer is "
                         "kept apart from the weights, name its folder with tokenizer= (--tokenizer)") from e


def _auto_tokenizer(path: str, **kwargs):
    from transformers import AutoTokenizer  # here: importing it imports torch

    return AutoTokenizer.from_pretrained(path, **kwargs)


def _saved_tokenizer(folder: str):
    """A tokenizer this cache saved, loaded by the class its tokenizer_config.json names.
    AutoTokenizer would read the model's config first, and that import pulls in torch: 2 of the
    coordinator's 3 s to load the tokenizer, on the cores the workers are loading the model on."""
    import transformers

    name = json.loads((Path(folder) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    tokenizer_class = getattr(transformers, name, None) if isinstance(name, str) else None
    return tokenizer_class.from_pretrained(folder) if tokenizer_class is not None else _auto_tokenizer(folder)


def load_config(source: ModelSource):
    """The model's transformers config: from its folder, or from a GGUF file's cached conversion."""
    from transformers import AutoConfig

    if not source.gguf_file:
        return AutoConfig.from_pretrained(source.directory)
    return _cached_part(source, "config", AutoConfig.from_pretrained)


def cached_config_attributes(source: ModelSource) -> dict | None:
    """Every attribute of a GGUF file's converted config (defaults included), read as plain JSON
    without importing transformers; None when not cached (or not a GGUF source)."""
    if not source.gguf_file:
        return None
    try:
        return json.loads((cache_folder(source) / "config" / ATTRIBUTES_FILE).read_text())
    except (OSError, ValueError):
        return None


def _save_config(config, folder: str) -> None:
    config.save_pretrained(folder)  # only what differs from the class defaults
    Path(folder, ATTRIBUTES_FILE).write_text(config.to_json_string(use_diff=False))


def _cached_part(source: ModelSource, part: str, from_pretrained, read_cached=None):
    """`part` of a GGUF source from the cache (`read_cached`, else `from_pretrained`, reads it),
    or converted by `from_pretrained` and cached."""
    folder = cache_folder(source) / part
    if folder.is_dir():
        try:
            return (read_cached or from_pretrained)(str(folder))
        except Exception as e:  # noqa: BLE001 - a damaged cache (of any error) costs a conversion, never the load
            log.warning("the cached %s at %s could not be read (%s); converting the GGUF file again",
                        part, folder, e)
            shutil.rmtree(folder, ignore_errors=True)
    loaded = from_pretrained(source.directory, gguf_file=source.gguf_file)
    save = _save_config if part == "config" else type(loaded).save_pretrained
    _write_atomically(folder, lambda tmp: save(loaded, tmp), is_dir=True)
    return loaded


def write_dense_weights(state: dict, source: ModelSource) -> None:
    """Keep dequantized weights. Tied tensors (one storage under two names) are kept once, under
    the first name; the model ties them again itself."""
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
    _write_atomically(dense_weights_path(source), lambda tmp: save_file(unique, tmp), is_dir=False)


def _write_atomically(target: Path, write, is_dir: bool) -> None:
    """Best effort: a part that cannot be cached only costs the next load its conversion. Written
    under a temporary name, then renamed: concurrent loads (the ranks of one group, the
    coordinator beside its workers) never read half a part, and the first rename wins."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_folders(target.parent)
        tmp = tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent) if is_dir else \
            _temp_file(target)
        try:
            write(tmp)
            if is_dir:
                _rename_dir(tmp, target)
            else:
                os.replace(tmp, target)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            elif os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        log.warning("%s could not be cached (%s); the next load converts the GGUF file again", target, e)


def _temp_file(target: Path) -> str:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    os.close(fd)
    return tmp


def _rename_dir(tmp: str, target: Path) -> None:
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # not "another load got there first"
            raise


def _remove_stale_folders(current: Path) -> None:
    """The same file's parts under an older key (a reinstalled package gives it a new mtime):
    each holds the model's size, and nothing reads them again. Also the dense weights of
    releases that kept them in cache_dir()/weights."""
    stem = current.name.rsplit("-", 1)[0]
    for path in current.parent.glob(f"{glob.escape(stem)}-*"):
        if path != current and path.name.rsplit("-", 1)[0] == stem:
            shutil.rmtree(path, ignore_errors=True)
    for path in (cache_dir() / "weights").glob(f"{glob.escape(stem)}-*.safetensors"):
        try:
            path.unlink()
        except OSError:
            pass
