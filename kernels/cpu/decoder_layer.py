"""The decoder layers of a step of fp32 rows (a few, or any number where the fp32 projections carry
weights packed for a GEMM C can call: MKL's or kernels/cpu/packed_gemm.c's), with fp32 or int8
projections, in two C calls each (kernels/cpu/decoder_layer.c): one before the attention (residual
add, norm, QKV, rotary, cache writes), one after it (output projection, residual add, norm, MLP).
The attention itself stays the backend's, so a step of any kind (decodes, a speculative step's
drafts, prompt chunks) can take this path.

    layers = FusedLayers.of(list(model.layers))  # None where the layers do not qualify
    step = layers.step(residual, cos, sin, kv_cache, slot_blocks, slot_offsets, kernel_rows)
    for i in range(n):
        q, k, v = step.before_attention(i)      # views of the step's buffers
        step.after_attention(i, attention(q, k, v))
    delta = step.mlp_out                         # the last layer's output, for the final norm
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels import cpu
from kernels.cpu import mkl_packed, packed_gemm

_SOURCE = Path(__file__).with_name("decoder_layer.c")
_P = ctypes.c_void_p


class _Kernels(ctypes.Structure):
    _fields_ = [("gemv", _P), ("add_rms_norm", _P), ("rope", _P), ("silu_mul", _P), ("gemv_int8", _P),
                ("packed_gemm", _P)]


# _Layer's tensors, in its field order, around the cache's pointer (which comes after the first 7),
# then the projections' packed weights.
_WEIGHTS = ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down")
_SCALES = ("qkv_scale", "o_scale", "gate_up_scale", "down_scale")
_PACKED = ("qkv_packed", "o_packed", "gate_up_packed", "down_packed")


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in (*_WEIGHTS, "cache", *_SCALES, *_PACKED)]


class _Step(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int64) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim", "inter")]
                + [("eps", ctypes.c_float), ("num_threads", ctypes.c_int)]
                + [(name, _P) for name in ("residual", "normed", "qkv", "q", "k", "o", "gate_up", "act", "mlp_out",
                                           "cos_t", "sin_t", "slot_blocks", "slot_offsets")]
                + [(name, ctypes.c_int64) for name in ("s_block", "s_kv", "s_tok", "kernel_rows")])


def _functions() -> tuple[ctypes.CDLL, _Kernels, int | None] | None:
    """The fused library, the table of the kernels it calls, and the decode attention's entry point
    (None where that kernel did not build: no step then runs whole); None where any of the rest did
    not build."""
    lib = cpu._library(_SOURCE, "decoder_pre_attention_f32", (_P,) * 4)
    gemv, gemv_int8 = cpu._load_gemv("f32_gemv_f32"), cpu._load_gemv("int8_gemv_f32")
    elementwise = [cpu._elementwise(name, argtypes, torch.empty(1)) for name, argtypes in _ELEMENTWISE]
    if lib is None or gemv is None or gemv_int8 is None or None in elementwise:
        return None
    lib.decoder_post_attention_f32.restype = None
    lib.decoder_post_attention_f32.argtypes = [_P] * 4
    lib.decoder_decode_step_f32.restype = None
    lib.decoder_decode_step_f32.argtypes = [_P, _P, _I64, _P, _P, _P, _P, _P, _I64, _I64, ctypes.c_float]
    table = _Kernels(ctypes.cast(gemv.f32_gemv_f32, _P), *(ctypes.cast(fn, _P) for fn in elementwise),
                     ctypes.cast(gemv_int8.int8_gemv_f32, _P), None)  # packed_gemm: set per step
    attention = cpu.load()
    return lib, table, None if attention is None else ctypes.cast(attention.paged_decode_attention_f32, _P).value


# The element-wise kernels in _Kernels' order, with the argtypes their Python wrappers give them.
_I64 = ctypes.c_int64
_ELEMENTWISE = (
    ("add_rms_norm", (_P, _P, _I64, _I64, _P, _P, _I64, _I64, ctypes.c_float, ctypes.c_int)),
    ("rope", (_P, _P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, ctypes.c_int)),
    ("silu_mul", (_P, _P, _I64, _I64, _I64, _I64, ctypes.c_int)),
)


class FusedLayers:
    """The C path over a model's decoder layers (LlamaDecoderLayer's modules: fp32 or int8
    projections, one rank)."""

    def __init__(self, layers, lib: ctypes.CDLL, table: _Kernels, decode_attention: int | None):
        self.layers = layers
        self._lib = lib
        self._table = table
        self._decode_attention = decode_attention
        self.heads, self.kv_heads, self.head_dim, self.hidden, self.inter, self.eps = layer_shape(layers[0])
        # _Layer's weights of every layer (Parameters: their storage may be re-pointed), and the
        # projections whose `weight_scale` buffers are read at each step (a move replaces a buffer).
        self._tensors = [t for layer in layers for t in _layer_tensors(layer)[:len(_WEIGHTS)]]
        self._projections = [m for layer in layers for m in _projections(layer)]
        self._addresses: tuple = ()
        self._structs = None  # one C array of _Layer, one per layer
        # int8 projections take the C kernel up to cpu.GEMV_MAX_ROWS rows, fp32 ones up to the
        # model's crossover, or any number where they all have a packed copy C can call for the
        # rows beyond (LlamaForCausalLM._fusable).
        self.all_int8 = all(getattr(m, "weight_scale", None) is not None for m in self._projections)
        # The fp32 projections, whose crossover the model checks at each step (a weight keeps its
        # kind; a buffer's absence is slow to ask nn.Module about, ~1 us a projection).
        self.fp32_projections = [m for m in self._projections if getattr(m, "weight_scale", None) is None]
        self._scratch = torch.empty(0, dtype=torch.float32)  # see `scratch`

    def scratch(self, count: int) -> torch.Tensor:
        """`count` fp32 of a step's buffers, from one kept between steps (grown to the largest step
        seen): valid until the next step. Allocated per step, a 2,048-row step's 70 MB (SmolLM2) was
        a fresh mapping (beyond glibc's 32 MiB mmap threshold), and a decode step's 2 MB could be
        trimmed back to the kernel between steps; every page then faulted again on first write, at
        up to ~17 us a page on a VM whose host takes back freed guest memory."""
        if self._scratch.numel() < count:
            self._scratch = torch.empty(0, dtype=torch.float32)  # the old buffer freed before the new one
            self._scratch = torch.empty(count, dtype=torch.float32)
        return self._scratch[:count]

    @property
    def all_packed(self) -> bool:
        """Whether every projection has a weight packed for one GEMM the C path can call (read
        live: a weight may be repacked or unpacked after the layers were judged)."""
        return _packed_gemm_entry([_callable_packed(m) for m in self._projections]) is not None

    @classmethod
    def of(cls, layers) -> FusedLayers | None:
        """The fused path for these layers, or None where one of them does not qualify: weights
        other than fp32 or int8 with fp32 scales on the CPU (bf16, packed-only), tensor
        parallelism, a bias other than QKV's. Judged once: a model's weights keep their kind."""
        if not layers or layers[0].self_attn.tp.size != 1:
            return None
        kinds = set()
        for layer in layers:
            attn, linears = layer.self_attn, _projections(layer)
            if any(m.bias is not None for m in linears[1:]):
                return None
            for m in linears:
                scale = getattr(m, "weight_scale", None)
                kinds.add(m.weight.dtype if scale is None else (m.weight.dtype, scale.dtype))
            if any(t.device.type != "cpu" or t.is_meta or not t.is_contiguous()
                   for t in _layer_tensors(layer) if t is not None):
                return None
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.qkv_proj.bias]
            if any(t is not None and t.dtype != torch.float32 for t in norms):
                return None
        if not kinds <= {torch.float32, (torch.int8, torch.float32)}:
            return None
        functions = _functions()
        return None if functions is None else cls(layers, *functions)

    def _layer_structs(self, kv_cache: torch.Tensor) -> ctypes.Array:
        """Each layer's pointers. Their addresses are read at every step, since a weight's storage
        may have moved since the last (workers/huge_pages.py re-points them between steps); the
        structs are rebuilt only when one has."""
        scales = (m._buffers.get("weight_scale") for m in self._projections)
        packings = [_callable_packed(m) for m in self._projections]
        addresses = (kv_cache.data_ptr(), kv_cache.stride(1) * kv_cache.element_size(),
                     *(None if t is None else t.data_ptr() for t in self._tensors),
                     *(None if t is None else t.data_ptr() for t in scales),
                     *(None if t is None else t.data_ptr() for t in packings))
        if addresses != self._addresses:
            base, layer_bytes = addresses[:2]
            n, k = len(_WEIGHTS), len(_SCALES)
            weights = addresses[2:2 + len(self._tensors)]
            scales = addresses[2 + len(self._tensors):2 + len(self._tensors) + len(self._projections)]
            packed = addresses[2 + len(self._tensors) + len(self._projections):]
            self._structs = (_Layer * len(self.layers))(*(
                _Layer(*weights[i * n:(i + 1) * n], base + i * layer_bytes, *scales[i * k:(i + 1) * k],
                       *packed[i * k:(i + 1) * k])
                for i in range(len(self.layers))))
            self._table.packed_gemm = _packed_gemm_entry(packings)
            self._addresses = addresses
        return self._structs

    def step(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
             slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, kernel_rows: int) -> FusedStep:
        """`kernel_rows`: up to how many rows the fp32 projections take the C kernel (the model's
        crossover), beyond it their packed weight."""
        return FusedStep(self, residual, cos, sin, kv_cache, slot_blocks, slot_offsets, kernel_rows)


# The packed weights C can multiply by, each with its GEMM's cblas_sgemm_compute-typed entry point.
_C_CALLABLE = {mkl_packed.PackedWeight: mkl_packed.compute_address,
               packed_gemm.PackedWeight: packed_gemm.compute_address}


def _callable_packed(projection) -> mkl_packed.PackedWeight | packed_gemm.PackedWeight | None:
    """The projection's fp32 weight packed for a GEMM C can call, if `pack_weights` gave it one."""
    packed = getattr(projection, "packed_weight", None)
    return packed if type(packed) in _C_CALLABLE else None


def _packed_gemm_entry(packed: list) -> int | None:
    """The entry point of the one GEMM every weight of `packed` is packed for; None where one is
    not packed for C, or they are packed for different GEMMs."""
    kinds = {type(p) for p in packed}
    if len(kinds) != 1:
        return None
    entry = _C_CALLABLE.get(kinds.pop())
    return None if entry is None else entry()


def layer_shape(layer) -> tuple[int, int, int, int, int, float]:
    """A LlamaDecoderLayer's heads, KV heads, head size, hidden and intermediate sizes, and norm
    epsilon: the shapes a C step over it is told."""
    attn = layer.self_attn
    return (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.o_proj.weight.shape[0],
            layer.mlp.intermediate_size, layer.input_layernorm.eps)


def row_views(space: torch.Tensor, rows: int, widths: dict[str, int]) -> dict[str, torch.Tensor]:
    """`space` cut into one [rows, width] view per name, one after another (a step's buffers)."""
    views, start = {}, 0
    for name, width in widths.items():
        views[name] = space[start:start + rows * width].view(rows, width)
        start += rows * width
    return views


def _projections(layer) -> tuple:
    """A layer's projections, in _SCALES' order."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _layer_tensors(layer) -> tuple:
    """A layer's _WEIGHTS then _SCALES (None: no bias, or a projection that is not int8)."""
    attn, mlp = layer.self_attn, layer.mlp
    return (layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
            layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
            *(getattr(m, "weight_scale", None) for m in _projections(layer)))


class FusedStep:
    """One step's buffers and the calls of its layers. `residual`: the embeddings [rows, hidden],
    contiguous, which become the residual stream in place; `cos`/`sin`: [rows, 1, head_dim]
    contiguous; `kv_cache`: [blocks, layers, 2, block_size, kv_heads, head_dim] contiguous fp32;
    `slot_blocks`/`slot_offsets`: int64 [rows], each row's cache slot; `kernel_rows`: as
    FusedLayers.step's. Its buffers are the FusedLayers' scratch: one step at a time."""

    def __init__(self, fused: FusedLayers, residual, cos, sin, kv_cache, slot_blocks, slot_offsets, kernel_rows):
        rows, f = residual.shape[0], fused
        q_size, kv_size = f.heads * f.head_dim, f.kv_heads * f.head_dim
        widths = dict(normed=f.hidden, qkv=q_size + 2 * kv_size, q=q_size, k=kv_size, o=f.hidden,
                      gate_up=2 * f.inter, act=f.inter, mlp_out=f.hidden, attention=q_size)
        space = fused.scratch(rows * sum(widths.values()))
        views = row_views(space, rows, widths)
        self._keep = (residual, cos, sin, slot_blocks, slot_offsets, space)  # alive while C reads them
        qkv = views["qkv"]
        self.q = views["q"].view(rows, f.heads, f.head_dim)
        self.k = views["k"].view(rows, f.kv_heads, f.head_dim)
        self.v = qkv[:, q_size + kv_size:].view(rows, f.kv_heads, f.head_dim)
        self.mlp_out = views["mlp_out"]
        _, _, s_kv, s_tok, _, _ = kv_cache.stride()
        self._step = _Step(rows, f.hidden, f.heads, f.kv_heads, f.head_dim, f.inter, f.eps, torch.get_num_threads(),
                           residual.data_ptr(), *(views[n].data_ptr() for n in ("normed", "qkv", "q", "k", "o",
                                                                               "gate_up", "act", "mlp_out")),
                           cos.data_ptr(), sin.data_ptr(), slot_blocks.data_ptr(), slot_offsets.data_ptr(),
                           kv_cache.stride(0), s_kv, s_tok, kernel_rows)
        self._layers = fused._layer_structs(kv_cache)
        self._fused = fused
        self._attention = views["attention"]
        self._pre = fused._lib.decoder_pre_attention_f32
        self._post = fused._lib.decoder_post_attention_f32
        self._table = ctypes.byref(fused._table)
        self._step_ref = ctypes.byref(self._step)
        self._mlp_out_ptr = self.mlp_out.data_ptr()

    def before_attention(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i up to its attention: (q, k, v) for the backend, k and v already in the cache."""
        self._pre(self._table, ctypes.byref(self._layers[i]), self._step_ref, self._mlp_out_ptr if i else None)
        return self.q, self.k, self.v

    def after_attention(self, i: int, attention: torch.Tensor) -> None:
        """Layer i from its attention's result ([rows, heads, head_dim]) on: its output is `mlp_out`."""
        attention = attention.contiguous()
        self._post(self._table, ctypes.byref(self._layers[i]), self._step_ref, attention.data_ptr())

    def all_layers_decoding(self, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                            scale: float) -> bool:
        """Every layer in one C call, for a step whose every row is one sequence's next token: the
        attention on the C decode kernel, as the CPU backend runs such a step (`block_tables`
        [rows, max_blocks] and `context_lens` [rows], int32 contiguous, one per row). False, with
        nothing done, where that kernel did not build."""
        f = self._fused
        if f._decode_attention is None:
            return False
        f._lib.decoder_decode_step_f32(self._table, self._layers, len(f.layers), self._step_ref, f._decode_attention,
                                       self._attention.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
                                       block_tables.shape[1], block_size, scale)
        return True
