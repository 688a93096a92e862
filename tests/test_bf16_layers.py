"""bf16 decoder layers with C between their GEMMs (kernels/cpu/decoder_layer_bf16.c), and whole
decode steps in one C call where the CPU has AMX: taken where every projection is packed, bit for
bit the Python path's results (decode steps attending in C, other steps through the backend), and
left alone where they do not apply."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import amx_gemm
from kernels.cpu.decoder_layer_bf16 import Bf16Layers
from pagedserve import LLM, SamplingParams
from workers.models import llama

pytestmark = pytest.mark.skipif(llama.WIDEN_BF16 or not llama._mkldnn_bf16(),
                                reason="bf16 layers are packed only where the CPU multiplies bf16")

PROMPTS = [{"prompt_token_ids": [5 + i, 9, 17 + 2 * i, 33, 41, 2 + i]} for i in range(3)]
DECODE = "whole" if amx_gemm.available() else "c"  # how a step of decode rows runs here


def _model(llm):
    return llm.engine.executor.worker.model


def _runs(llm, params: SamplingParams, prompts) -> tuple[list, list]:
    """Each prompt's tokens and logprobs, and for every step on the C path how it ran: whole in
    one C call (a step of decode rows on the AMX kernel), layer by layer attending in C (decode
    rows), or layer by layer around the backend's attention."""
    steps = []
    run = Bf16Layers.run

    def counting(self, *args):
        decode, rows = args[-1], args[0].shape[0]
        steps.append("backend" if decode is None else "whole" if self._whole_step(rows) else "c")
        return run(self, *args)

    Bf16Layers.run = counting
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        Bf16Layers.run = run
    return [[(c.token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in c.logprobs or []])
             for c in o.outputs] for o in outs], steps


def _both_paths(llm, params: SamplingParams, prompts) -> tuple[list, list, list]:
    """The C path's results, the Python path's (the bf16 layers switched off), and the C path's steps."""
    model = _model(llm)
    fused, steps = _runs(llm, params, prompts)
    kept, model._bf16_layers = model._bf16_layers, None
    try:
        python, python_steps = _runs(llm, params, prompts)
    finally:
        model._bf16_layers = kept
    assert python_steps == []
    return fused, python, steps


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])  # qwen2: a QKV bias
def test_bf16_steps_run_in_c_between_the_gemms_and_match_the_python_path_bit_for_bit(request, fixture):
    llm = LLM(request.getfixturevalue(fixture), dtype="bfloat16", kv_cache_memory=1 << 24,
              enable_prefix_caching=False)
    with torch.no_grad():  # a random model's biases start at zero: a bias the C path dropped would not show
        for layer in _model(llm).layers:
            if layer.self_attn.qkv_proj.bias is not None:
                layer.self_attn.qkv_proj.bias.normal_(0.0, 0.5)
    params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=12, ignore_eos=True, logprobs=3)
    fused, python, steps = _both_paths(llm, params, PROMPTS[:2])
    assert fused == python
    # The prompts' step, then the decodes: whole steps in C where the CPU has AMX.
    assert steps.count("backend") == 1 and steps.count(DECODE) >= 10


def test_a_step_of_prompts_beside_decodes_attends_in_the_backend_and_stays_exact(tiny_llama):
    """A long prompt chunked beside running decodes: steps of mixed rows, whose attention the
    backend runs between the C calls, and more than 16 rows, which oneDNN's GEMM takes padded."""
    llm = LLM(tiny_llama, dtype="bfloat16", kv_cache_memory=1 << 24, enable_prefix_caching=False,
              max_num_batched_tokens=40)
    prompts = [{"prompt_token_ids": [3 + i, 4, 5, 7 + i]} for i in range(20)]
    prompts.append({"prompt_token_ids": [(13 * i) % 200 + 3 for i in range(90)]})
    fused, python, steps = _both_paths(llm, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                           logprobs=2), prompts)
    assert fused == python
    assert steps.count("backend") >= 3 and steps.count(DECODE) >= 5


def test_the_bf16_path_is_taken_only_where_every_projection_is_packed_bf16(tiny_llama):
    llm = LLM(tiny_llama, dtype="bfloat16", kv_cache_memory=1 << 24)
    layers = list(_model(llm).layers)
    assert Bf16Layers.of(layers) is not None
    projection = layers[1].mlp.down_proj
    packed, amx = projection.packed_weight, projection._buffers.pop("amx_weight", None)
    try:
        del projection.packed_weight  # one layer's projection on another path
        assert Bf16Layers.of(layers) is None
    finally:
        projection.packed_weight = packed
        if amx is not None:
            projection._buffers["amx_weight"] = amx
    fp32 = LLM(tiny_llama, kv_cache_memory=1 << 24)
    assert Bf16Layers.of(list(_model(fp32).layers)) is None


def test_decode_steps_run_layer_by_layer_where_a_projection_lacks_its_amx_weight(tiny_llama):
    """Without every projection on the AMX kernel, a step of decode rows still attends in C,
    layer by layer around the Python path's GEMMs, and stays exact."""
    if not amx_gemm.available():
        pytest.skip("no AMX: every decode step runs layer by layer")
    llm = LLM(tiny_llama, dtype="bfloat16", kv_cache_memory=1 << 24, enable_prefix_caching=False)
    projection = _model(llm).layers[0].self_attn.o_proj
    kept = projection._buffers.pop("amx_weight")
    try:
        fused, python, steps = _both_paths(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                               logprobs=2), PROMPTS)
    finally:
        projection._buffers["amx_weight"] = kept
    assert fused == python
    assert "whole" not in steps and steps.count("c") == 5


def test_speculative_verify_steps_run_on_the_c_path_and_stay_exact(tiny_llama):
    """A verify step's rows (a sequence's token and its drafts) are decode rows to the kernel, each
    with its own context length: they run as decode steps here, and rejected drafts' K/V are
    overwritten as on the Python path."""
    llm = LLM(tiny_llama, dtype="bfloat16", kv_cache_memory=1 << 24, enable_prefix_caching=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    # Drafts come where a generated token repeats one before it: this random model's bf16 greedy
    # run does within 96 tokens.
    repeating = [{"prompt_token_ids": [7, 8, 9, 10] * 6}]
    fused, python, steps = _both_paths(llm, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True,
                                                           logprobs=1), repeating)
    assert fused == python and steps.count(DECODE) > 0
    assert llm.stats().get("spec_draft_tokens_total", 0) > 0


def test_where_two_copies_would_not_fit_the_amx_kernel_alone_takes_every_step(tiny_llama, monkeypatch):
    """Where a bf16 model's weights packed twice would take over a quarter of the memory
    available, only the AMX kernel's copy is kept: it takes steps of any row count (here a
    prompt chunk of 200 rows, beyond MAX_ROWS), every decode step runs whole in C, and the C path
    is still the Python path's bits."""
    if not amx_gemm.available():
        pytest.skip("no AMX: oneDNN's copy is the only one")
    monkeypatch.setattr(llama, "available_memory", lambda: 1 << 20)
    llm = LLM(tiny_llama, dtype="bfloat16", kv_cache_memory=1 << 24, enable_prefix_caching=False)
    model = _model(llm)
    assert all(getattr(m, "packed_weight", None) is None and m.amx_weight is not None
               for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj))
    assert getattr(model, "packed_lm_head", None) is None and model.amx_lm_head is not None
    calls = []
    kernel = amx_gemm.linear
    monkeypatch.setattr(amx_gemm, "linear", lambda x, *a: calls.append(x.shape[0]) or kernel(x, *a))
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(200)]} for i in range(2)]
    fused, python, steps = _both_paths(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                           logprobs=2), prompts)
    assert fused == python
    assert max(calls) > amx_gemm.MAX_ROWS  # the prompts' rows went through the AMX kernel
    assert steps.count("whole") == 5 and steps.count("backend") >= 1
