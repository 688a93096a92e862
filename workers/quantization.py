"""Weight-only int8 quantization of the decoder's linear layers (`quantization="int8"`).

Each output channel (a row of a `[out, in]` weight) gets its own scale, amax / 127, and its
weights are rounded to int8 in [-127, 127]: the error of any weight is at most half its row's
scale. Activations stay in the model dtype; torch's CPU kernel `_weight_int8pack_mm` multiplies
them by the int8 rows and applies the scales, so a decode step streams a quarter of fp32's
weight bytes. The embeddings and the LM head (tied to them in SmolLM2) stay in the model dtype,
as in vLLM's and llama.cpp's int8 schemes: they hold most of a small model's sampling accuracy.

Each rank quantizes its own shard after loading (a row-parallel layer's scales cover the rank's
columns only), so nothing about the checkpoint or tensor parallelism changes.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATIONS = ("none", "int8")
INT8_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def check_supported(quantization: str, device: str) -> None:
    """Refuse what this build cannot run, naming the setting and why."""
    if quantization == "none":
        return
    if device != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on torch's CPU int8 kernel "
                         f"(_weight_int8pack_mm); device {device!r} is not supported")
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        raise ValueError(f"quantization {quantization!r} needs torch's _weight_int8pack_mm "
                         f"(torch >= 2.4); this torch {torch.__version__} lacks it")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight `[out, in]`, fp32 scale per output row): weight ~= int8 * scale[:, None]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def quantize_model(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace the weights of every decoder linear layer (INT8_LAYERS) by int8 rows and a
    `weight_scale` in the activations' dtype (the kernel's contract). Returns the layers done."""
    done = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in INT8_LAYERS:
            q, scale = quantize_int8(module.weight)
            module.weight = nn.Parameter(q, requires_grad=False)
            module.register_buffer("weight_scale", scale.to(dtype), persistent=False)
            done += 1
    return done


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x `[T, in]` (model dtype) @ int8 weight `[out, in]`^T, scaled per output channel."""
    return torch.ops.aten._weight_int8pack_mm(x.contiguous(), weight, scale)
