"""The decoder layers of a bf16 step whose projections are packed (a CPU that multiplies bf16
natively): per layer, the four GEMMs as the Python path runs them (kernels/cpu/amx_gemm.py up to
its rows where the CPU has AMX, oneDNN's beyond), and between them one C call each over the
step's preallocated buffers (kernels/cpu/decoder_layer_bf16.c: residual add and norm; rotary,
the K/V's cache writes and, for a step of decode rows, the attention; residual add and norm;
silu * up). Other steps' attention stays the backend's. A step of decode rows whose every
projection takes the AMX kernel runs whole in one C call, which calls that kernel itself.

    layers = Bf16Layers.of(list(model.layers))  # None where the layers do not qualify
    delta = layers.run(residual, cos, sin, kv_cache, meta, slot_blocks, slot_offsets, gemm, decode)

Why: at a decode step's rows oneDNN's GEMMs read the weights in about 10 ms (SmolLM2, 16 rows, 2
cores), and the Python between them (wrappers, views, the K/V's scatter through index_put, the
query's widening) took about as long again: that step measured 27.0 ms on the Python path, 20.0
here (both on oneDNN's GEMMs); 16.1 with the AMX kernel's GEMMs, 13.9 as one C call.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels import cpu
from kernels.cpu import amx_gemm
from kernels.cpu.decoder_layer import _ELEMENTWISE, _projections, layer_shape, row_views

_SOURCE = Path(__file__).with_name("decoder_layer_bf16.c")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Kernels(ctypes.Structure):
    _fields_ = [("add_rms_norm", _P), ("rope", _P), ("silu_mul", _P), ("attend", _P), ("gemm", _P)]


_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _Layer(ctypes.Structure):
    _fields_ = ([("input_norm", _P), ("post_norm", _P), ("cache", _P)] + [(name, _P) for name in _PROJECTIONS]
                + [(name + "_bias", _P) for name in _PROJECTIONS])


class _Step(ctypes.Structure):
    _fields_ = ([(name, _I64) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim", "inter")]
                + [("eps", ctypes.c_float), ("num_threads", ctypes.c_int)]
                + [(name, _P) for name in ("residual", "normed", "q", "k", "attention", "act", "qkv", "o", "gate_up",
                                           "mlp_out", "query32", "out32", "cos_t", "sin_t", "slot_blocks",
                                           "slot_offsets")]
                + [(name, _I64) for name in ("s_block", "s_kv", "s_tok")]
                + [("block_tables", _P), ("context_lens", _P), ("max_blocks", _I64), ("block_size", _I64),
                   ("scale", ctypes.c_float)])


def _functions() -> tuple[ctypes.CDLL, _Kernels] | None:
    """The library and the table of the kernels it calls (the element-wise ones in _Kernels' order,
    as the fp32 layers' table has them; the decode attention's entry NULL where that kernel did not
    build: the backend then attends); None where the rest did not build."""
    lib = cpu._library(_SOURCE, "bf16_input_norm", (_P,) * 4)
    elementwise = [cpu._elementwise(name, argtypes, torch.empty(1, dtype=torch.bfloat16))
                   for name, argtypes in _ELEMENTWISE]
    if lib is None or None in elementwise:
        return None
    for name in ("bf16_post_attention_norm", "bf16_attention"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = None, [_P] * 4
    lib.bf16_silu_mul.restype, lib.bf16_silu_mul.argtypes = None, [_P] * 3
    lib.bf16_decode_step.restype, lib.bf16_decode_step.argtypes = None, [_P, _P, _I64, _P]
    attention = cpu.load()
    attend = None if attention is None else ctypes.cast(attention.paged_decode_attention_f32, _P)
    return lib, _Kernels(*(ctypes.cast(fn, _P) for fn in elementwise), attend, amx_gemm.address())


class Bf16Layers:
    """The C path over a model's bf16 decoder layers (LlamaDecoderLayer's modules, one rank)."""

    def __init__(self, layers, lib: ctypes.CDLL, table: _Kernels):
        self.layers = layers
        self._lib = lib
        self._table = table
        self.heads, self.kv_heads, self.head_dim, self.hidden, self.inter, self.eps = layer_shape(layers[0])
        self.scale = layers[0].self_attn.scale
        # The step's buffers, bf16 and fp32, kept between steps (grown to the largest step).
        self._scratch = {dtype: torch.empty(0, dtype=dtype) for dtype in (torch.bfloat16, torch.float32)}
        self._addresses: tuple = ()
        self._structs = None  # one C array of _Layer, for whole decode steps

    @property
    def decodes_in_c(self) -> bool:
        """Whether a step of decode rows attends here (the decode kernel built)."""
        return self._table.attend is not None

    @classmethod
    def of(cls, layers) -> Bf16Layers | None:
        """The path for these layers, or None where one does not qualify: every projection bf16,
        packed (oneDNN's copy, the AMX kernel's, or both) with no plain weight (so that the Python
        path, too, runs every row count on a packed GEMM: `linear`), bf16 norms, one rank, on the
        CPU."""
        if not layers or layers[0].self_attn.tp.size != 1:
            return None
        for layer in layers:
            for m in _projections(layer):
                packed = getattr(m, "packed_weight", None)
                onednn = isinstance(packed, torch.Tensor) and packed.device.type == "cpu"
                if (not (onednn or m._buffers.get("amx_weight") is not None)
                        or m.weight.dtype != torch.bfloat16 or not m.weight.is_meta
                        or getattr(m, "weight_scale", None) is not None):
                    return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous() for t in norms):
                return None
        functions = _functions()
        return None if functions is None else cls(layers, *functions)

    def _whole_step(self, rows: int) -> bool:
        """Whether a step of `rows` decode rows runs whole in C: every projection then takes the
        AMX kernel in the Python path too (`linear`: up to its MAX_ROWS rows, or any number where
        it has no oneDNN copy), which C can call."""
        return self._table.gemm is not None and all(
            m._buffers.get("amx_weight") is not None
            and (rows <= amx_gemm.MAX_ROWS or getattr(m, "packed_weight", None) is None)
            for layer in self.layers for m in _projections(layer))

    def _layer_structs(self, kv_cache: torch.Tensor) -> ctypes.Array:
        """Each layer's pointers, rebuilt only when an address has changed since the last step
        (workers/huge_pages.py re-points the weights between steps)."""
        tensors = [t for layer in self.layers for t in (
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            *(m._buffers["amx_weight"] for m in _projections(layer)), *(m.bias for m in _projections(layer)))]
        addresses = (kv_cache.data_ptr(), kv_cache.stride(1) * kv_cache.element_size(),
                     *(None if t is None else t.data_ptr() for t in tensors))
        if addresses != self._addresses:
            base, layer_bytes, per = addresses[0], addresses[1], len(tensors) // len(self.layers)
            layers = (addresses[2 + i * per:2 + (i + 1) * per] for i in range(len(self.layers)))
            self._structs = (_Layer * len(self.layers))(*(
                _Layer(norm, post_norm, base + i * layer_bytes, *projections)
                for i, (norm, post_norm, *projections) in enumerate(layers)))
            self._addresses = addresses
        return self._structs

    def _buffers(self, rows: int) -> tuple[dict, dict]:
        """The step's bf16 and fp32 buffers, views of scratch kept between steps: valid until the
        next step."""
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        widths = dict(normed=self.hidden, q=q_size, k=kv_size, attention=q_size, act=self.inter,
                      qkv=q_size + 2 * kv_size, o=self.hidden, gate_up=2 * self.inter, mlp_out=self.hidden)
        widths32 = dict(query32=q_size, out32=q_size)
        return (row_views(self._space(torch.bfloat16, rows * sum(widths.values())), rows, widths),
                row_views(self._space(torch.float32, rows * sum(widths32.values())), rows, widths32))

    def _space(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """`count` elements of the `dtype` scratch, grown where it is smaller."""
        if self._scratch[dtype].numel() < count:
            self._scratch[dtype] = torch.empty(0, dtype=dtype)  # the old buffer freed before the new one
            self._scratch[dtype] = torch.empty(count, dtype=dtype)
        return self._scratch[dtype][:count]

    def run(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, meta,
            slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, gemm, decode: tuple | None) -> torch.Tensor:
        """Every layer; returns the last one's output (for the final norm with `residual`, which
        is the residual stream, updated in place). `residual` [rows, hidden], `cos`/`sin` [rows, 1,
        head_dim], contiguous bf16; `kv_cache` [blocks, layers, 2, block_size, kv_heads, head_dim]
        contiguous bf16; `slot_blocks`/`slot_offsets` int64 [rows]; `gemm(x, projection)` the
        Python path's; `decode` (block_tables, context_lens) int32 contiguous for a step of
        decode rows, attended here, else None: the backend's attention (`meta.backend`)."""
        rows = residual.shape[0]
        bufs, bufs32 = self._buffers(rows)
        q = bufs["q"].view(rows, self.heads, self.head_dim)
        k = bufs["k"].view(rows, self.kv_heads, self.head_dim)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        tables, lens = decode if decode is not None else (None, None)
        layer_bytes = kv_cache.stride(1) * kv_cache.element_size()
        step = _Step(rows, self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, self.eps,
                     torch.get_num_threads(), residual.data_ptr(),
                     *(bufs[n].data_ptr() for n in ("normed", "q", "k", "attention", "act", "qkv", "o", "gate_up",
                                                    "mlp_out")),
                     *(bufs32[n].data_ptr() for n in ("query32", "out32")),
                     cos.data_ptr(), sin.data_ptr(), slot_blocks.data_ptr(), slot_offsets.data_ptr(),
                     kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
                     None if tables is None else tables.data_ptr(), None if lens is None else lens.data_ptr(),
                     0 if tables is None else tables.shape[1], kv_cache.shape[3], self.scale)
        table, step_ref = ctypes.byref(self._table), ctypes.byref(step)
        lib, normed, attention_buf, act = self._lib, bufs["normed"], bufs["attention"], bufs["act"]
        input_norm, post_norm, attend, silu = (lib.bf16_input_norm, lib.bf16_post_attention_norm, lib.bf16_attention,
                                               lib.bf16_silu_mul)
        if tables is not None and self._whole_step(rows):
            lib.bf16_decode_step(table, self._layer_structs(kv_cache), len(self.layers), step_ref)
            return bufs["mlp_out"]
        attention_fn = meta.backend.paged_attention
        delta = None
        for i, layer in enumerate(self.layers):
            qkv_proj, o_proj, gate_up_proj, down_proj = _projections(layer)
            here = _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                          kv_cache.data_ptr() + i * layer_bytes)
            layer_ref = ctypes.byref(here)
            input_norm(table, layer_ref, step_ref, None if delta is None else delta.data_ptr())
            qkv = gemm(normed, qkv_proj)
            attend(table, layer_ref, step_ref, qkv.data_ptr())
            if tables is None:
                v = qkv[:, q_size + kv_size:].view(rows, self.kv_heads, self.head_dim)
                attention = attention_fn(q, k, v, kv_cache[:, i], meta, layer.self_attn.scale).view(rows, q_size)
            else:
                attention = attention_buf
            o = gemm(attention, o_proj)
            post_norm(table, layer_ref, step_ref, o.data_ptr())
            gate_up = gemm(normed, gate_up_proj)
            silu(table, step_ref, gate_up.data_ptr())
            delta = gemm(act, down_proj)
        return delta
