"""Weight-only int8 quantization of the decoder's linear layers (`quantization="int8"`).

Each output channel (a row of a `[out, in]` weight) gets its own scale, amax / 127, and its
weights are rounded to int8 in [-127, 127]: the error of any weight is at most half its row's
scale. Activations stay in the model dtype; steps of up to 32 fp32 tokens run a C kernel that
reads the int8 rows as they are (kernels/cpu/weight_gemv.c), larger ones widen the rows for one
GEMM and scale the output per channel (`workers.models.llama.linear`), so the weights held (and
read from memory) are a quarter of fp32's. torch's own CPU kernel, `_weight_int8pack_mm`, measured
here 4x slower than the fp32 GEMM at 1 token and ~60x at 256 (a 3072x576 weight: 1.44 vs
0.33 ms, 522 vs 10 ms), so it is not used. The embeddings and the LM head (tied to them in SmolLM2) stay in the model dtype,
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
    if quantization != "none" and device != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on the CPU path only; device {device!r} "
                         "is not supported")


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
