"""The decoder layers as two C calls each for fp32 steps (few rows, or any number where the
projections are packed for a GEMM C can call: MKL's or kernels/cpu/packed_gemm.c's), or one call
for a whole step of decode rows
(kernels/cpu/decoder_layer.c): taken where they apply, bit for bit the Python path's results, and
left alone where they do not."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.decoder_layer import FusedLayers, FusedStep, _projections
from pagedserve import LLM, SamplingParams
from workers.models import llama

PROMPTS = [{"prompt_token_ids": [5 + i, 9, 17 + 2 * i, 33, 41, 2 + i]} for i in range(3)]
# The packed GEMMs C can call here (MKL's where torch exports it, kernels/cpu/packed_gemm.c's).
C_GEMMS = [g for g in ("mkl", "pagedserve") if g in llama.F32_GEMMS]
c_gemms = pytest.mark.parametrize(
    "gemm", C_GEMMS or [pytest.param(None, marks=pytest.mark.skip(reason="no packed GEMM C can call"))])


def _model(llm):
    return llm.engine.executor.worker.model


class _Counts:
    """Layers run on the fused path in a generate: one by one around the backend's attention
    (`layered`), or whole steps of decode rows in one C call (`whole_steps`, each all layers)."""

    def __init__(self, num_layers: int):
        self.num_layers, self.layered, self.whole_steps = num_layers, 0, 0

    @property
    def layers(self) -> int:
        return self.layered + self.whole_steps * self.num_layers


def _runs(llm, params: SamplingParams, prompts=PROMPTS) -> tuple[list, _Counts]:
    """Each prompt's tokens and logprobs, and what took the fused path."""
    counts = _Counts(len(_model(llm).layers))
    before, whole = FusedStep.before_attention, FusedStep.all_layers_decoding

    def counting_layer(self, i):
        counts.layered += 1
        return before(self, i)

    def counting_step(self, *args):
        done = whole(self, *args)
        counts.whole_steps += done
        return done

    FusedStep.before_attention, FusedStep.all_layers_decoding = counting_layer, counting_step
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        FusedStep.before_attention, FusedStep.all_layers_decoding = before, whole
    return [[(c.token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in c.logprobs or []])
             for c in o.outputs] for o in outs], counts


def _both_paths(llm, params: SamplingParams, prompts=PROMPTS) -> tuple[list, list, _Counts]:
    """The fused path's results, the Python path's (fused layers switched off), and what was fused."""
    model = _model(llm)
    fused, counts = _runs(llm, params, prompts)
    kept, model._fused_layers = model._fused_layers, None
    try:
        python, python_counts = _runs(llm, params, prompts)
    finally:
        model._fused_layers = kept
    assert python_counts.layers == 0
    return fused, python, counts


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])  # qwen2: a QKV bias
def test_few_row_steps_take_the_fused_path_and_match_the_python_path_bit_for_bit(request, fixture):
    llm = LLM(request.getfixturevalue(fixture), kv_cache_memory=1 << 24, enable_prefix_caching=False)
    with torch.no_grad():  # a random model's biases start at zero: a bias the fused path dropped would not show
        for layer in _model(llm).layers:
            if layer.self_attn.qkv_proj.bias is not None:
                layer.self_attn.qkv_proj.bias.normal_(0.0, 0.5)
    params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=12, ignore_eos=True, logprobs=3)
    fused, python, counts = _both_paths(llm, params, PROMPTS[:2])  # 4 decode rows a step
    assert fused == python
    assert counts.whole_steps >= 10  # the decode steps
    # The 6-token prompts' 12 rows are beyond the crossover (4): fused too where the default GEMM
    # is one C can call (QKV bias included), else on the Python path.
    assert counts.layered == (counts.num_layers if llama.DEFAULT_F32_GEMM in C_GEMMS else 0)


def test_a_short_prompt_runs_layer_by_layer_and_its_decodes_whole_both_exact(tiny_llama):
    """A prompt of 3 tokens is a step the fused layers take but not the decode kernel (its rows
    attend to each other): layer by layer around the backend's attention. Its decodes then run
    as whole steps in one C call."""
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False)
    fused, python, counts = _both_paths(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                            logprobs=2), [{"prompt_token_ids": [11, 12, 13]}])
    assert fused == python
    assert counts.layered == counts.num_layers and counts.whole_steps == 7


def test_a_speculative_step_with_drafts_runs_fused_and_stays_exact(tiny_llama):
    """Verification steps (a sequence's token plus its drafts: several query rows of one sequence,
    attention through the prefill kernel) take the fused layers too."""
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    repeating = [{"prompt_token_ids": [7, 8, 9, 10] * 6}]
    fused, python, counts = _both_paths(llm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                            logprobs=1), repeating)
    assert fused == python and counts.whole_steps > 0  # a draft chunk's rows are decode rows to the kernel
    assert llm.stats().get("spec_draft_tokens_total", 0) > 0


@c_gemms
def test_steps_above_the_kernels_rows_take_the_packed_gemm_in_c_and_match_bit_for_bit(tiny_llama, gemm):
    """With every projection packed for a GEMM C can call, any step runs fused: beyond the model's
    crossover the C layers call that GEMM, as `linear` does (the C weight kernel takes at most 16
    rows, and a GEMM of another order would not round the same)."""
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False)
    model = _model(llm)
    llama.repack_f32(model, gemm)
    limit = model.f32_kernel_rows
    assert FusedLayers.of(list(model.layers)).all_packed
    prompts = [{"prompt_token_ids": [3 + i, 4, 5] + [7 + i] * 30} for i in range(limit + 15)]  # > 16 decode rows
    fused, python, counts = _both_paths(llm, SamplingParams(temperature=0.7, seed=3, max_tokens=4, ignore_eos=True,
                                                            logprobs=2), prompts)
    assert fused == python
    assert counts.whole_steps == 3 and counts.layered >= counts.num_layers  # the decodes, the prompts' chunk


@c_gemms
def test_steps_share_one_scratch_buffer_and_a_larger_steps_leftovers_change_nothing(tiny_llama, gemm):
    """Every fused step takes its buffers from the FusedLayers' scratch, grown to the largest step
    and kept (allocated per step, a large step's buffers were a fresh mapping whose every page
    faulted on first write). Smaller steps after a larger one reuse it as it is, and what the
    larger step left in it does not reach their results."""
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False)
    model = _model(llm)
    llama.repack_f32(model, gemm)
    big = [{"prompt_token_ids": [3 + i] + [7 + i] * 40} for i in range(6)]  # one prompt step of 246 rows
    _, counts = _runs(llm, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), big)
    assert counts.layered >= counts.num_layers
    f = model._fused_layers
    scratch = f._scratch
    # normed, o, mlp_out; qkv's q, q, attention; qkv's k and v, k; gate_up, act
    per_row = 3 * f.hidden + 3 * f.heads * f.head_dim + 3 * f.kv_heads * f.head_dim + 3 * f.inter
    assert scratch.numel() == 246 * per_row
    with torch.inference_mode():  # the step made it an inference tensor
        scratch.fill_(float("nan"))  # a leftover that reached any result would show
    fused, python, counts = _both_paths(llm, SamplingParams(temperature=0.7, seed=5, max_tokens=6, ignore_eos=True,
                                                            logprobs=2), PROMPTS)
    assert fused == python and counts.whole_steps >= 5
    assert model._fused_layers._scratch is scratch  # the smaller steps allocated nothing


def _set_kernel_rows(model, rows: int, layer_rows: int | None = None) -> None:
    """The model's crossover, and every fp32 projection's (`layer_rows` for the last layer's down
    projection alone, where given)."""
    model.f32_kernel_rows = rows
    for layer in model.layers:
        for m in _projections(layer):
            m.f32_kernel_rows = rows
    if layer_rows is not None:
        model.layers[-1].mlp.down_proj.f32_kernel_rows = layer_rows


@c_gemms
@pytest.mark.parametrize("rows", [8, 19])
def test_the_c_layers_follow_the_models_crossover_on_either_side(tiny_llama, rows, gemm):
    """At a crossover of 12, 8 decode rows take the C weight kernel and 19 the packed GEMM, in C
    as in Python (the default crossover, 4, would not tell a C path that ignored it apart)."""
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False)
    llama.repack_f32(_model(llm), gemm)
    _set_kernel_rows(_model(llm), 12)
    prompts = [{"prompt_token_ids": [3 + i, 4, 5, 6 + i]} for i in range(rows)]
    fused, python, counts = _both_paths(llm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                            logprobs=2), prompts)
    assert fused == python and counts.whole_steps == 3


@c_gemms
def test_a_crossover_of_zero_runs_even_one_row_on_the_packed_gemm_in_c(tiny_llama, gemm):
    """Where the packed GEMM beats the C weight kernel at one row, the crossover is 0: a one-row
    decode step then runs whole in C on that GEMM, as `linear` runs it."""
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False)
    model = _model(llm)
    llama.repack_f32(model, gemm)
    _set_kernel_rows(model, 0)
    fused, python, counts = _both_paths(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                            logprobs=2), PROMPTS[:1])
    assert fused == python and counts.whole_steps == 5


def test_a_projection_with_a_crossover_of_its_own_keeps_the_python_path(tiny_llama):
    """C is told one crossover, the model's: where a projection has another, the C path could pick
    another kernel than `linear` for it, so the step runs in Python."""
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False)
    _set_kernel_rows(_model(llm), 4, layer_rows=3)
    prompts = [{"prompt_token_ids": [3 + i, 4, 5]} for i in range(2)]
    _, counts = _runs(llm, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), prompts)
    assert counts.layers == 0
    _set_kernel_rows(_model(llm), 4)
    _, counts = _runs(llm, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), prompts)
    assert counts.layers > 0


def test_without_packed_weights_steps_above_the_kernels_rows_keep_the_python_path(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False)
    model = _model(llm)
    for layer in model.layers:
        for m in _projections(layer):
            m.__dict__.pop("packed_weight", None)
    assert not FusedLayers.of(list(model.layers)).all_packed
    limit = model.f32_kernel_rows
    prompts = [{"prompt_token_ids": [3 + i, 4, 5]} for i in range(limit + 1)]  # limit + 1 decode rows
    _, counts = _runs(llm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), prompts)
    assert counts.layers == 0


@pytest.mark.skipif(len(llama.F32_GEMMS) < 2, reason="one fp32 GEMM here")
def test_layers_packed_for_onednn_or_for_two_gemms_keep_the_python_path_beyond_the_crossover(tiny_llama):
    """C calls one packed GEMM for every projection: oneDNN's packing (which C cannot call), or one
    projection packed for another GEMM than the rest, leaves steps beyond the crossover to Python."""
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False)
    model = _model(llm)
    layers = FusedLayers.of(list(model.layers))
    down = model.layers[-1].mlp.down_proj
    prompts = [{"prompt_token_ids": [3 + i, 4, 5]} for i in range(model.f32_kernel_rows + 1)]
    for first, last in [("onednn", "onednn"), *((g, next(o for o in llama.F32_GEMMS if o != g)) for g in C_GEMMS)]:
        if first not in llama.F32_GEMMS:
            continue
        llama.repack_f32(model, first)
        down.packed_weight = llama._pack(down.weight, last)
        assert not layers.all_packed
        _, counts = _runs(llm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), prompts)
        assert counts.layers == 0
    for gemm in C_GEMMS:  # and once they agree again, the C path takes them
        llama.repack_f32(model, gemm)
        assert layers.all_packed


def test_int8_weights_take_the_fused_path_up_to_their_kernels_rows_and_match_bit_for_bit(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False, quantization="int8")
    assert _model(llm).f32_kernel_rows < 6  # the fp32 crossover would stop a 6-row step
    prompts = [{"prompt_token_ids": [3 + i, 4, 5, 6]} for i in range(6)]  # 6 decode rows a step
    fused, python, counts = _both_paths(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                            logprobs=2), prompts)
    assert fused == python and counts.layers > 0


def test_bf16_models_do_not_qualify(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24, dtype="bfloat16")
    _, counts = _runs(llm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert counts.layers == 0
    assert FusedLayers.of(list(_model(llm).layers)) is None


def test_an_fp32_layer_stack_qualifies_and_one_odd_layer_spoils_it(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24)
    layers = list(_model(llm).layers)
    fused = FusedLayers.of(layers)
    assert fused is not None and not fused.all_int8
    down = layers[-1].mlp.down_proj
    down.weight_scale = torch.ones(down.weight.shape[0], dtype=torch.float64)  # an int8 scale of another dtype
    try:
        assert FusedLayers.of(layers) is None
    finally:
        del down.weight_scale
    weight = down.weight.data
    down.weight.data = weight.t().contiguous().t()  # the same values, not contiguous
    try:
        assert FusedLayers.of(layers) is None
    finally:
        down.weight.data = weight


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_weights_moved_between_steps_are_read_where_they_now_are(tiny_llama, quantization):
    """workers/huge_pages.py moves the weights between steps: a Parameter is re-pointed
    (`param.data = copy`), a buffer (int8's `weight_scale`) replaced. The fused path must follow.
    The old storage is zeroed and kept alive, so a stale pointer would show."""
    llm = LLM(tiny_llama, kv_cache_memory=1 << 24, enable_prefix_caching=False, quantization=quantization)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    before, _ = _runs(llm, params)
    old = []
    with torch.no_grad():
        for param in _model(llm).layers.parameters():
            old.append(param.data)
            param.data = param.data.clone()
        for module in _model(llm).layers.modules():
            for name, buffer in list(module._buffers.items()):
                old.append(buffer)
                module._buffers[name] = buffer.clone()
        for storage in old:
            storage.zero_()
    after, counts = _runs(llm, params)
    assert after == before and counts.layers > 0
