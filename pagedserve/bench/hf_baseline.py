"""The transformers baseline: the same prompts through Hugging Face `generate` on static batches,
greedy, never stopping early: what serving looks like without paging or continuous batching."""

from __future__ import annotations

import gc
import time

import torch

from pagedserve.bench.dataset import BenchRequest
from pagedserve.config import resolve_model
from workers.gguf_cache import load_tokenizer


def load_hf_model(model: str, dtype: torch.dtype, device: str = "cpu"):
    """The model as transformers loads it (a GGUF dequantized to dense weights, as pagedserve
    loads it) and its tokenizer."""
    from transformers import AutoModelForCausalLM, GgufConfig

    src = resolve_model(model)
    tokenizer = load_tokenizer(src)
    kwargs = {"gguf_file": src.gguf_file, "quantization_config": GgufConfig(dequantize=True)} if src.gguf_file else {}
    if device != "cpu":  # straight onto the device, not through a host copy of every weight
        kwargs["device_map"] = device
    hf = AutoModelForCausalLM.from_pretrained(src.directory, dtype=dtype, **kwargs)
    return hf.to(device).eval(), tokenizer


def left_pad(batch: list[BenchRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids):] = 1
    return ids, mask


def hf_generate(model, batch: list[BenchRequest], pad_id: int) -> list[list[int]]:
    ids, mask = (t.to(model.device) for t in left_pad(batch, pad_id))
    new = max(r.max_tokens for r in batch)  # a static batch runs until its longest request is done
    # eos_token_id=None: never stop early, the counterpart of ignore_eos (min_new_tokens would
    # instead ban EOS and change the greedy tokens).
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=pad_id)
    generated = out[:, ids.shape[1]:]
    assert generated.shape[1] == new, f"HF stopped early: {generated.shape[1]} != {new}"
    return [generated[i, :r.max_tokens].tolist() for i, r in enumerate(batch)]


def batches(requests: list, size: int):
    for i in range(0, len(requests), size):
        yield requests[i:i + size]


def run_transformers(model_name: str, requests: list[BenchRequest], batch_size: int,
                     dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict:
    """Seconds and output tokens/s of the whole workload, batch after batch, in request order;
    only each request's own max_tokens count as output."""
    model, tokenizer = load_hf_model(model_name, dtype, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        hf_generate(model, [BenchRequest([1, 2, 3], 2), BenchRequest([4, 5], 2)], pad_id)  # first-call costs
        outputs = []
        start = time.perf_counter()
        for batch in batches(requests, batch_size):
            outputs += hf_generate(model, batch, pad_id)
        if device != "cpu":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    del model
    gc.collect()
    output_tokens = sum(r.max_tokens for r in requests)
    return {"seconds": seconds, "output_tokens": output_tokens, "output_token_throughput": output_tokens / seconds,
            "batch_size": batch_size, "outputs": outputs}
