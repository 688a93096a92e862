"""The Llama family (Llama, Mistral, Qwen2, SmolLM) on paged attention, built from a transformers
config. Projections are fused as vLLM fuses them (`qkv_proj`, `gate_up_proj`): one larger GEMM
is faster than three small ones on a CPU at decode batch sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import (F32_GEMV_MAX_ROWS, GEMV_MAX_ROWS, add_rms_norm, bf16_dot_linear, bf16_linear, f32_linear,
                         int8_linear, rope, silu_mul)
from kernels.cpu import amx_gemm, mkl_packed, packed_gemm
from kernels.cpu.decoder_layer import FusedLayers
from kernels.cpu.decoder_layer_bf16 import Bf16Layers
from workers.kv_cache import available_memory
from workers.parallel import TensorParallel


# Up to this many tokens (decode batches), MKL's sgemm computes the weight-major product
# W @ x^T 15-45% faster than x @ W^T (measured on SmolLM2's shapes, 2 cores: 30 layers at 16
# tokens 31 vs 44 ms, at 64 tokens 103 vs 125 ms; above ~96 tokens the usual order wins). The
# result is a transposed view; the element-wise ops after it take strided input as it is.
SKINNY_TOKENS = 96


def _native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (x86 AVX512-BF16 or AMX, Arm BF16), where torch's
    bf16 GEMM is fast: read from /proc/cpuinfo's flags (False where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = {word for line in f if line.startswith(("flags", "Features")) for word in line.split()}
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


# Without native bf16 FMA, torch's CPU bf16 GEMM converts as it goes: on SmolLM2's 30 layers 231
# against 57 ms for the C kernel at 16 rows, 784 against 259 ms for a widened fp32 GEMM at 64,
# 25.3 against 3.9 s at 2048. bf16 weights then take those paths, in fp32, rounded to bf16 after.
WIDEN_BF16 = not _native_cpu_bf16()
# With native bf16, torch's bf16 GEMM (oneDNN, AMX where there is AMX) is fast once the weight is
# in its blocked layout, which F.linear redoes on every call: SmolLM2's 30 layers, 2 cores with
# AMX, F.linear / the weight packed once (`pack_weights`): 1 row 19.9 / 13.8 ms, 16 rows
# 21.7 / 14.5, 64 rows 27.4 / 18.6, 256 rows 53.0 / 42.4. At a decode's few rows the C kernel on
# AVX512-BF16 dot products (bf16 rows as they are, kernels/cpu/weight_gemv.c) beats both, 10.2 ms
# at 1 and at 4 rows, 18.1 at 8, but it reads the plain weight, which packing gives up: it serves
# the LM head tied to the embeddings (which keep theirs), and layers that could not be packed.
NATIVE_BF16_KERNEL_ROWS = 4


def _mkldnn_bf16() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


# fp32 layers too run a GEMM on a weight packed once: oneDNN's blocked layout was 1.2-1.5x MKL's
# plain sgemm at every row count above a few (SmolLM2's 30 layers, 2 cores, the faster of
# F.linear and W @ x^T against packed: 8 rows 24.2 / 20.0 ms, 64 rows 112 / 80, 256 rows 443 /
# 311, 2,048 rows 2,566 / 2,022; its LM head at 64 rows 33 / 18), and MKL's own packed GEMM is
# faster again where torch has it (kernels/cpu/mkl_packed.py). Up to this many rows the C
# kernel on the plain weight is faster still (4 rows 15.7 / 17.0, 1 row 13.6 / 20.8 ms), so fp32
# keeps the plain weight beside the packed copy: the linear weights are held twice. Where the
# crossover lies is the CPU's: a worker measures it for its model's layers and gives each its own
# (`f32_kernel_rows`, workers/kernel_choice.py; a Xeon with AVX-512 measured 8-12, then 16 once
# fp32's 2-16 rows streamed the weight there). This is the default.
F32_KERNEL_ROWS = 4


def _mkldnn_f32() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


PACK_F32 = mkl_packed.available() or _mkldnn_f32() or packed_gemm.available()


def onednn_rows(rows: int) -> int:
    """The row count oneDNN's GEMM runs `rows` at. oneDNN builds a kernel for every new shape it
    is called with (bf16 on AMX, one SmolLM2 projection: 0.4 ms the first time at 1-16 rows, 1-2
    ms at 64-256, 6.5 ms at 2,048), and a serving engine's steps come in every row count: the
    64-request benchmark's bf16 run called it at 56. So up to 16 rows run as they are; beyond, the
    count is rounded up to a multiple of 8, and from 64 rows to one of 8 steps per doubling (at most
    12.5% padding rows): 62 counts cover 1-2,048 rows. That run's 276 (rows, weight) shapes,
    replayed in a fresh process: 0.39-0.44 s as they came against 0.20-0.21 s rounded, and the
    same 0.12-0.13 s once every kernel was built."""
    if rows <= 16:
        return rows
    step = max(8, 1 << (rows.bit_length() - 4))
    return -(-rows // step) * step


def _onednn_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) on oneDNN's GEMM, W packed by `pack_weights`, at `onednn_rows` rows (zero
    padding rows, cut off the result; each row's result is its own)."""
    rows = x.shape[0]
    padded = onednn_rows(rows) if x.dim() == 2 else rows
    if padded == rows:
        return _onednn_gemm(x, packed, bias)
    return _onednn_gemm(F.pad(x, (0, 0, 0, padded - rows)), packed, bias)[:rows]


def packed_linear(x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) on the GEMM W was packed for by `pack_weights`: for fp32 MKL's,
    pagedserve's (kernels/cpu/packed_gemm.c) or oneDNN's; for bf16 oneDNN's."""
    if isinstance(packed, mkl_packed.PackedWeight):
        return mkl_packed.linear(x, packed, bias)
    if isinstance(packed, packed_gemm.PackedWeight):
        return packed_gemm.linear(x, packed, bias)
    return onednn_linear(x, packed, bias)


# The packed GEMMs fp32 layers can run on: MKL's where torch exports it, oneDNN's, and
# pagedserve's own (kernels/cpu/packed_gemm.c). Which is fastest is the CPU's: on a Xeon with
# AVX-512 MKL's (1.3-1.4x oneDNN at a decode batch's rows, kernels/cpu/mkl_packed.py); on an AMD
# EPYC (AVX2) pagedserve's, 1.2-1.4x oneDNN's at 1-64 rows, which was 1.4-2.3x MKL's at 4-64.
# MKL's is the default, and a worker measures which its machine runs (workers/kernel_choice.py).
F32_GEMMS = (("mkl",) * mkl_packed.available() + ("onednn",) * _mkldnn_f32()
             + ("pagedserve",) * packed_gemm.available())
DEFAULT_F32_GEMM = F32_GEMMS[0] if F32_GEMMS else None


def _pack(weight: torch.Tensor, f32_gemm: str | None = None):
    """`weight` packed once for its GEMM: fp32 for `f32_gemm` (DEFAULT_F32_GEMM unless given),
    MKL's layout, pagedserve's panels or oneDNN's; bf16 for oneDNN's."""
    if weight.dtype == torch.float32:
        f32_gemm = f32_gemm or DEFAULT_F32_GEMM
        if f32_gemm == "mkl":
            return mkl_packed.PackedWeight(weight)
        if f32_gemm == "pagedserve":
            return packed_gemm.PackedWeight(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def f32_gemm_of(packed) -> str:
    """Which GEMM an fp32 weight was packed for."""
    if isinstance(packed, mkl_packed.PackedWeight):
        return "mkl"
    return "pagedserve" if isinstance(packed, packed_gemm.PackedWeight) else "onednn"


def repack_f32(model: nn.Module, f32_gemm: str) -> int:
    """Re-pack every fp32 layer's packed weight (and the LM head's) for `f32_gemm` (one of
    F32_GEMMS); returns the weights re-packed (0 where all were packed for it)."""
    if f32_gemm not in F32_GEMMS:
        raise ValueError(f"f32_gemm: one of {F32_GEMMS}, got {f32_gemm!r}")
    done = 0
    with torch.no_grad():
        head = getattr(model, "packed_lm_head", None)
        if head is not None and model.lm_head_weight().dtype == torch.float32 and f32_gemm_of(head) != f32_gemm:
            model.packed_lm_head = _pack(model.lm_head_weight(), f32_gemm)
            done += 1
        for m in model.modules():
            packed = getattr(m, "packed_weight", None)
            if (isinstance(m, nn.Linear) and packed is not None and m.weight.dtype == torch.float32
                    and f32_gemm_of(packed) != f32_gemm):
                m.packed_weight = _pack(m.weight, f32_gemm)
                done += 1
    return done


def pack_weights(model: LlamaForCausalLM, f32_gemm: str | None = None) -> int:
    """Pack every CPU linear layer's weight once for its GEMM (`_pack`: `packed_weight`; the LM
    head's is the model's `packed_lm_head`), for `linear`: fp32 layers for `f32_gemm` (the
    default unless given; keeping the plain weight for the C kernel's few-row steps), and bf16
    layers on a CPU that multiplies bf16 natively, where the plain weight gives way to a meta
    tensor; an LM head tied to the embeddings keeps it, as the embeddings. Where that CPU has
    AMX (or AVX512-BF16: `amx_gemm.available()`), a bf16 weight is also packed for the AMX
    kernel (`amx_weight`, the head's `amx_lm_head`), which takes steps of up to its MAX_ROWS
    rows, oneDNN's copy the larger ones: bf16 weights are then held twice, as fp32 ones are,
    while both copies fit in a quarter of the memory available (`_second_copy_fits`); beyond, the
    AMX kernel alone takes every row count. int8 layers are left as they are. Returns the weights
    packed."""
    bf16 = not WIDEN_BF16 and _mkldnn_bf16()

    def packable(weight: torch.Tensor) -> bool:
        if weight.device.type != "cpu":
            return False
        return (weight.dtype == torch.bfloat16 and bf16) or (weight.dtype == torch.float32 and PACK_F32)

    head = model.lm_head_weight()
    amx = bf16 and amx_gemm.available()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and packable(m.weight)]
    onednn_too = not amx or _second_copy_fits([head, *(m.weight for m in linears if m.weight is not head)])
    done = 0
    with torch.no_grad():
        if packable(head):
            if onednn_too or head.dtype != torch.bfloat16:
                model.packed_lm_head = _pack(head, f32_gemm)
            if amx and head.dtype == torch.bfloat16:
                model.register_buffer("amx_lm_head", amx_gemm.pack(head), persistent=False)
            done += 1
        for module in linears:
            if module.weight is not head:
                if onednn_too or module.weight.dtype != torch.bfloat16:
                    module.packed_weight = _pack(module.weight, f32_gemm)
                if amx and module.weight.dtype == torch.bfloat16:
                    # A buffer: workers/huge_pages.py moves it with the rest.
                    module.register_buffer("amx_weight", amx_gemm.pack(module.weight), persistent=False)
                done += 1
            if module.weight.dtype == torch.bfloat16:
                module.weight = nn.Parameter(module.weight.to("meta"), requires_grad=False)
    return done


def _second_copy_fits(weights: list[torch.Tensor]) -> bool:
    """Whether a bf16 model's weights packed twice (the AMX kernel's copy and oneDNN's) fit in a
    quarter of the memory available now (True where /proc does not say)."""
    available = available_memory()
    nbytes = sum(w.numel() * w.element_size() for w in weights if w.dtype == torch.bfloat16)
    return available is None or 2 * nbytes <= available // 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None, packed: torch.Tensor | None = None,
           kernel_rows: int = F32_KERNEL_ROWS, amx: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias): `scale`, an int8 weight's per-channel scales; `packed`, the weight
    packed for its GEMM (`pack_weights`; a bf16 `weight` is then a meta tensor unless it is kept
    for another use); `kernel_rows`, up to how many fp32 rows the C kernel beats the packed GEMM;
    `amx`, a bf16 weight packed for the AMX kernel (kernels/cpu/amx_gemm.py)."""
    if weight.dtype == torch.bfloat16 and x.device.type == "cpu":
        if not WIDEN_BF16:
            # Native bf16: the AMX kernel where the CPU has AMX, up to its MAX_ROWS rows where
            # oneDNN's packed copy is kept too (every row count where not); else a few rows on the
            # C kernel's bf16 dot products where the plain weight is at hand, and oneDNN's GEMM (on
            # the packed weight where there is one).
            if amx is not None and x.dim() == 2 and (x.shape[0] <= amx_gemm.MAX_ROWS or packed is None):
                return amx_gemm.linear(x, amx, weight.shape[0], bias)
            out = None
            if x.shape[0] <= NATIVE_BF16_KERNEL_ROWS and not weight.is_meta:
                out = bf16_dot_linear(x, weight)
            if out is None:
                if packed is not None:
                    return onednn_linear(x, packed, bias)
                return F.linear(x, weight, bias)
            return out if bias is None else out + bias
        # No bf16 arithmetic: a few rows through the C kernel, which widens each bf16 weight as it
        # reads it; more widen the weight for one fp32 GEMM. The result rounded to bf16 either way.
        x32 = x.float()
        out = bf16_linear(x32, weight)
        if out is None:
            out = linear(x32, weight.float())
        out = out.to(x.dtype)
        return out if bias is None else out + bias
    if weight.dtype == torch.int8:  # quantization="int8": workers/quantization.py
        # A few rows (decode at small batch): the C kernel reads the int8 rows as they are.
        # Otherwise the rows widened for one GEMM (torch's _weight_int8pack_mm is far slower
        # here), then each output channel scaled.
        out = int8_linear(x, weight, scale)
        if out is None:
            out = linear(x, weight.to(x.dtype)) * scale
        return out if bias is None else out + bias
    if packed is not None and x.shape[0] > kernel_rows:
        return packed_linear(x, packed, bias)
    if x.shape[0] > SKINNY_TOKENS:
        return F.linear(x, weight, bias)
    out = f32_linear(x, weight)  # up to 16 fp32 rows: the C kernel
    if out is None:
        out = torch.mm(weight, x.t()).t()
    return out if bias is None else out + bias


# The LM head's skinny product is computed this many vocabulary rows at a time: each piece's
# transposed result is copied into place while it is still in cache, where transposing the whole
# [vocab, n] product afterwards reads it back from DRAM (SmolLM2, 64 rows: 57 against 70 ms).
LM_HEAD_CHUNK = 2048


def lm_head(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None,
            kernel_rows: int = F32_KERNEL_ROWS, amx: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T for the rows that sample, `[n, vocab rows]` contiguous (`packed`, `kernel_rows`,
    `amx`: as `linear`)."""
    if packed is not None and x.shape[0] > kernel_rows and x.dtype == torch.float32:
        return packed_linear(x, packed)
    out = f32_linear(x, weight)  # up to 16 fp32 rows: the C kernel (1 row: 4 against 11 ms)
    if out is not None:
        return out
    if x.shape[0] > SKINNY_TOKENS or weight.dtype != x.dtype or weight.dtype == torch.bfloat16:
        return linear(x, weight, packed=packed, amx=amx).contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    xt = x.t()
    for start in range(0, weight.shape[0], LM_HEAD_CHUNK):
        piece = torch.mm(weight[start:start + LM_HEAD_CHUNK], xt)
        out[:, start:start + piece.shape[0]].copy_(piece.t())
    return out


def project(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """`layer` applied to x: dense, int8 rows with their scales once quantized, or bf16 packed."""
    return linear(x, layer.weight, layer.bias, getattr(layer, "weight_scale", None),
                  getattr(layer, "packed_weight", None), getattr(layer, "f32_kernel_rows", F32_KERNEL_ROWS),
                  layer._buffers.get("amx_weight"))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, as transformers computes them, so low-precision runs stay token-exact.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, delta: torch.Tensor | None, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm of `residual + delta` (of `residual` alone without `delta`), and that sum:
        the residual stream's add fused with the next norm, as vLLM fuses them. In fp32 or bf16 on a
        CPU one C pass, which updates `residual` in place."""
        out = add_rms_norm(delta, residual, self.weight, self.eps)
        if out is not None:
            return out, residual
        if delta is not None:
            residual = residual + delta
        return self(residual), residual


def rope_tables(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, as transformers' rotary module computes them: its own
    init functions for every scaled rope_type (llama3, yarn, ...), so they match it exactly.
    Its rope utilities, not its modeling module, whose import costs a worker's start seconds."""
    rope = config.rope_parameters
    if rope["rope_type"] == "default":
        dim = head_dim_of(config)
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if not hasattr(config, "to_dict"):  # a ConfigSnapshot: the init functions want the real class
            config = config.to_transformers()
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, torch.device("cpu"))
    # On the CPU whatever the default device: built under "meta", torch would route arange
    # through its reference ops, whose first use imports torch._dynamo (seconds).
    positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
    freqs = torch.outer(positions, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    out = rope(x, cos, sin)  # fp32 or bf16 on a CPU: one C pass
    if out is not None:
        return out
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """QKV column-parallel (this rank's heads), O row-parallel plus an all-reduce."""

    def __init__(self, config, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = tp.heads(config.num_attention_heads)[1]
        self.num_kv_heads = tp.kv_heads(config.num_key_value_heads)[1]
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, kv_cache: torch.Tensor, meta):
        t = x.shape[0]
        q, k, v = project(x, self.qkv_proj).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = _apply_rope(q.reshape(t, self.num_heads, self.head_dim), cos, sin)
        k = _apply_rope(k.reshape(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        # kv_cache: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
        layer_cache = kv_cache[:, self.layer_idx]
        meta.backend.write_kv(k, v, layer_cache, meta)
        out = meta.backend.paged_attention(q, k, v, layer_cache, meta, self.scale)
        return self.tp.all_reduce(project(out.view(t, self.q_size), self.o_proj))


class LlamaMLP(nn.Module):
    """gate/up column-parallel, down row-parallel plus an all-reduce."""

    def __init__(self, config, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.intermediate_size = tp.rows(config.intermediate_size)[1]
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate_up = project(x, self.gate_up_proj)
        h = silu_mul(gate_up)  # fp32 or bf16 on a CPU: one C pass
        if h is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            h = F.silu(gate) * up
        return self.tp.all_reduce(project(h, self.down_proj))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """x: the previous layer's output; residual: the stream it adds to (None at the first
        layer, whose x is the embeddings). Returns this layer's output and the stream, for the
        next layer's norm to add them (vLLM's form: each add is fused with the norm after it)."""
        if residual is None:
            x, residual = None, x
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


_UNSET = object()
# Backends whose write_kv stores each token's K/V at its slot as it is (reference.write_kv): the
# fused layers write them the same way.
_SLOT_WRITING_BACKENDS = ("CpuBackend", "TorchBackend")


class LlamaForCausalLM(nn.Module):
    """One rank's shard of the model (the whole model when `tp.size == 1`)."""

    def __init__(self, config, max_positions: int, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.config = config
        self.tp = tp
        self.vocab_start, vocab_rows = tp.vocab_rows(config.vocab_size)
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)
        # rope_tables computes on the CPU: the tables then go where the model is built.
        cos, sin = (t.to(self.embed_tokens.weight.device) for t in rope_tables(config, max_positions))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._fused_layers = _UNSET  # FusedLayers, or None where the layers do not qualify: set on first use
        self._bf16_layers = _UNSET  # Bf16Layers, likewise

    def forward(self, input_ids, positions, kv_cache, meta) -> torch.Tensor:
        """Hidden states `[T, hidden]` of the step's tokens (their K/V now in the cache). `meta`:
        the step's attention metadata, built by the worker's backend (`kernels.get_backend`); it
        carries that backend (`meta.backend`) to every layer."""
        x = self._embed(input_ids)
        cos = self.rope_cos[positions].unsqueeze(1).to(x.dtype)  # shared by every layer
        sin = self.rope_sin[positions].unsqueeze(1).to(x.dtype)
        if self._fusable(x, kv_cache, meta):
            return self._fused_forward(x, cos, sin, kv_cache, meta)
        if self._bf16_fusable(x, kv_cache, meta):
            return self._bf16_forward(x, cos, sin, kv_cache, meta)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.norm.add_forward(x, residual)[0]

    def _fusable(self, x: torch.Tensor, kv_cache: torch.Tensor, meta) -> bool:
        """Whether this step's layers may run as two C calls each (kernels/cpu/decoder_layer.py):
        fp32 rows that the C path's projections take as the Python path would (`_fused_rows`), an
        fp32 cache, and a backend that writes K/V to the plain slots (the CPU and torch ones)."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or kv_cache.dtype != torch.float32:
            return False
        if self._fused_layers is _UNSET:
            self._fused_layers = FusedLayers.of(list(self.layers))
        fused = self._fused_layers
        if fused is None:
            return False
        return (x.shape[0] <= self._fused_rows(fused) and kv_cache.is_contiguous()
                and type(meta.backend).__name__ in _SLOT_WRITING_BACKENDS)

    def _bf16_fusable(self, x: torch.Tensor, kv_cache: torch.Tensor, meta) -> bool:
        """Whether this step's layers may run with C between their GEMMs
        (kernels/cpu/decoder_layer_bf16.py): bf16 rows and cache on the CPU, every projection
        packed (`Bf16Layers.of`), and a backend that writes K/V to the plain slots."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or kv_cache.dtype != torch.bfloat16:
            return False
        if self._bf16_layers is _UNSET:
            self._bf16_layers = Bf16Layers.of(list(self.layers))
        return (self._bf16_layers is not None and kv_cache.is_contiguous()
                and type(meta.backend).__name__ in _SLOT_WRITING_BACKENDS)

    def _bf16_forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        """`forward`'s layers on the bf16 C path: the same kernels on the same inputs as the Python
        path, so the same results bit for bit. A step of decode rows alone (the CPU backend's
        only_decodes) attends in C, on the kernel the backend would call."""
        slots = getattr(meta, "prefills", meta)
        layers = self._bf16_layers
        decode = None
        if getattr(meta, "only_decodes", False) and layers.decodes_in_c:
            decode = (meta.decode_block_tables, meta.decode_context_lens)
        delta = layers.run(x, cos.contiguous(), sin.contiguous(), kv_cache, meta, slots.slot_blocks,
                           slots.slot_offsets, project, decode)
        return self.norm.add_forward(delta, x)[0]

    def _fused_rows(self, fused: FusedLayers) -> int:
        """The most rows a step may have on the C path and still take, in every projection, the
        kernel `project` would: int8 projections their C kernel (to GEMV_MAX_ROWS); fp32 ones the
        C kernel up to the model's crossover (which C is told) and the packed GEMM beyond it,
        where all have a copy packed for one GEMM C can call (MKL's or kernels/cpu/packed_gemm.c's),
        else only up to the crossover. 0 where an fp32 projection's
        own crossover differs from the model's: the Python path alone then runs."""
        if fused.all_int8:
            return GEMV_MAX_ROWS
        kernel_rows = getattr(self, "f32_kernel_rows", F32_KERNEL_ROWS)
        if any(getattr(m, "f32_kernel_rows", F32_KERNEL_ROWS) != kernel_rows for m in fused.fp32_projections):
            return 0
        if kernel_rows <= F32_GEMV_MAX_ROWS and fused.all_packed:
            return min(mkl_packed.MAX_ROWS, packed_gemm.MAX_ROWS)
        return min(kernel_rows, F32_GEMV_MAX_ROWS)

    def _fused_forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        """`forward`'s layers, each as C before and after the backend's attention: the same kernels
        on the same inputs as the Python path, so the same results bit for bit."""
        slots = getattr(meta, "prefills", meta)  # the CPU backend's per-token slots, or the torch one's own
        step = self._fused_layers.step(x, cos, sin, kv_cache, slots.slot_blocks, slots.slot_offsets,
                                       getattr(self, "f32_kernel_rows", F32_KERNEL_ROWS))
        # A step of decode rows alone (the CPU backend's only_decodes) runs whole in C, its attention
        # on the decode kernel the backend would call; any other step, layer by layer around it.
        if not (getattr(meta, "only_decodes", False) and step.all_layers_decoding(
                meta.decode_block_tables, meta.decode_context_lens, kv_cache.shape[3], self.layers[0].self_attn.scale)):
            attention = meta.backend.paged_attention
            for i, layer in enumerate(self.layers):
                q, k, v = step.before_attention(i)
                step.after_attention(i, attention(q, k, v, kv_cache[:, i], meta, layer.self_attn.scale))
        return self.norm.add_forward(step.mlp_out, x)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        # Vocabulary-parallel: rows of other ranks' tokens are zero here; the all-reduce fills them.
        local = input_ids - self.vocab_start
        foreign = (local < 0) | (local >= self.embed_tokens.num_embeddings)
        x = self.embed_tokens(local.masked_fill(foreign, 0))
        return self.tp.all_reduce(x.masked_fill(foreign.unsqueeze(-1), 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits `[n, vocab]` on rank 0; None on the other ranks."""
        logits = self.tp.gather_to_first(lm_head(hidden, self.lm_head_weight(), getattr(self, "packed_lm_head", None),
                                                 getattr(self, "f32_kernel_rows", F32_KERNEL_ROWS),
                                                 self._buffers.get("amx_lm_head")))
        if logits is None:
            return None
        return logits[:, :self.config.vocab_size].float().contiguous()

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def load_weights(self, named_tensors) -> None:
        """Take (Hugging Face name, full tensor) pairs one at a time, keep this rank's shard of
        each, and fuse q/k/v and gate/up."""
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded = set()
        for name, tensor in named_tensors:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            parts = name.split(".")
            target = name
            shard = None
            for i, p in enumerate(parts):
                if p in fused:
                    target_mod, shard = fused[p]
                    target = ".".join(parts[:i] + [target_mod] + parts[i + 1:])
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            param = params[target]
            local = self._local_part(name, tensor)
            with torch.no_grad():
                if shard is not None:
                    param.narrow(0, self._shard_offset(target, shard), local.shape[0]).copy_(local)
                elif local.shape[0] < param.shape[0]:  # the last rank's padded vocabulary shard
                    param[:local.shape[0]].copy_(local)
                    param[local.shape[0]:].zero_()
                else:
                    param.copy_(local)
            loaded.add((target, shard))
        expected = set()
        for name in params:
            if "qkv_proj" in name:
                expected |= {(name, 0), (name, 1), (name, 2)}
            elif "gate_up_proj" in name:
                expected |= {(name, 0), (name, 1)}
            else:
                expected.add((name, None))
        missing = sorted(n for n, _ in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))

    def _local_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor (a view; the whole tensor at tp=1)."""
        if self.tp.size == 1:
            return tensor
        config, tp = self.config, self.tp
        head_dim = head_dim_of(config)
        kind = name.split(".")[-2]
        if kind in ("q_proj", "o_proj"):
            first, count = tp.heads(config.num_attention_heads)
            first, count = first * head_dim, count * head_dim
        elif kind in ("k_proj", "v_proj"):
            first, count = tp.kv_heads(config.num_key_value_heads)
            first, count = first * head_dim, count * head_dim
        elif kind in ("gate_proj", "up_proj", "down_proj"):
            first, count = tp.rows(config.intermediate_size)
        elif kind in ("embed_tokens", "lm_head"):
            first, count = tp.vocab_rows(config.vocab_size)
            count = max(0, min(count, config.vocab_size - first))
        else:  # norms: replicated
            return tensor
        # Row-parallel layers (O, down) are split along their input columns.
        dim = 1 if kind in ("o_proj", "down_proj") else 0
        return tensor.narrow(dim, first, count)

    def _shard_offset(self, target: str, shard: int) -> int:
        attn = self.layers[0].self_attn
        if "qkv_proj" in target:
            return (0, attn.q_size, attn.q_size + attn.kv_size)[shard]
        return shard * self.layers[0].mlp.intermediate_size
