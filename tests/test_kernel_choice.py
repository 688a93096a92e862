"""The few-row fp32 crossover measured per machine (workers/kernel_choice.py): the rule that reads
the timings, a real measurement on layers large enough to stream from memory, the answer kept on
disk and read back, small models left at the default, and an engine whose worker measures once
its weights are in place, before the offline LLM returns."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pagedserve import LLM, SamplingParams
from workers import kernel_choice
from workers.models import llama

pytestmark = pytest.mark.skipif(not llama.PACK_F32, reason="torch has no oneDNN fp32 GEMM here")


@pytest.fixture(autouse=True)
def _own_cache_and_crossover(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(llama, "F32_KERNEL_ROWS", llama.DEFAULT_F32_KERNEL_ROWS)


def _packed_layers(count: int, out_features: int, in_features: int) -> nn.Module:
    torch.manual_seed(count)
    model = nn.Sequential(*[nn.Linear(in_features, out_features, bias=False) for _ in range(count)])
    for layer in model:
        layer.weight.requires_grad_(False)
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
    return model


def _entries(tmp_path) -> dict:
    return json.loads((tmp_path / "kernel_choice.json").read_text())


def test_the_rule_takes_the_rows_the_kernel_wins_by_the_margin_up_to_its_first_miss():
    default = llama.DEFAULT_F32_KERNEL_ROWS
    assert kernel_choice.choose_rows({5: (1.0, 1.2), 6: (1.0, 1.1), 8: (1.0, 1.02)}, default) == 6
    assert kernel_choice.choose_rows({5: (1.0, 1.2), 6: (1.3, 1.0), 8: (1.0, 2.0)}, default) == 5  # no gaps
    assert kernel_choice.choose_rows({5: (1.2, 1.0)}, default) == default
    assert kernel_choice.choose_rows({}, default) == default
    # Winning by less than the margin is not winning: a tie keeps oneDNN.
    assert kernel_choice.choose_rows({5: (1.0, 1.0 / (1 - kernel_choice.MARGIN) - 1e-3)}, default) == default


def test_large_layers_are_measured_once_and_the_answer_is_read_back(tmp_path):
    model = _packed_layers(10, 1024, 1024)  # 40 MiB of fp32 weights: over the floor
    rows = kernel_choice.tune_f32_kernel_rows(model)
    assert rows in (llama.DEFAULT_F32_KERNEL_ROWS, *kernel_choice.CANDIDATE_ROWS)
    assert llama.F32_KERNEL_ROWS == rows
    (key, kept), = _entries(tmp_path).items()
    assert kept == rows
    # A later start of the same machine and shapes reads it back rather than measuring: an answer
    # the measurement could not give shows it came from the file.
    (tmp_path / "kernel_choice.json").write_text(json.dumps({key: 7}))
    llama.F32_KERNEL_ROWS = llama.DEFAULT_F32_KERNEL_ROWS
    assert kernel_choice.tune_f32_kernel_rows(_packed_layers(10, 1024, 1024)) == 7
    assert llama.F32_KERNEL_ROWS == 7
    # Other shapes are other layers: measured, and kept beside the first entry.
    other = kernel_choice.tune_f32_kernel_rows(_packed_layers(9, 2048, 512))
    entries = _entries(tmp_path)
    assert len(entries) == 2 and entries[key] == 7 and other in entries.values()


def test_the_measurement_stops_at_the_first_row_count_the_kernel_does_not_win():
    timings = kernel_choice.measure(list(_packed_layers(10, 1024, 1024)))
    rows = sorted(timings)
    assert rows == list(kernel_choice.CANDIDATE_ROWS[:len(rows)]) and rows
    assert all(kernel > 0 and onednn > 0 for kernel, onednn in timings.values())
    default = llama.DEFAULT_F32_KERNEL_ROWS
    # Every row count before the last was a win; the last ended the search, unless it was the last candidate.
    assert kernel_choice.choose_rows({r: timings[r] for r in rows[:-1]}, default) == (rows[-2] if len(rows) > 1
                                                                                      else default)
    if kernel_choice.choose_rows(timings, default) == rows[-1]:
        assert len(rows) == len(kernel_choice.CANDIDATE_ROWS)


def test_small_models_keep_the_default_and_write_nothing(tmp_path):
    assert kernel_choice.tune_f32_kernel_rows(_packed_layers(2, 256, 256)) == llama.DEFAULT_F32_KERNEL_ROWS
    assert not (tmp_path / "kernel_choice.json").exists()
    # Layers without a packed copy (bf16, int8, a GPU's) are not the fp32 layers it chooses for.
    big = _packed_layers(10, 1024, 1024)
    for layer in big:
        del layer.packed_weight
    assert kernel_choice.tune_f32_kernel_rows(big) == llama.DEFAULT_F32_KERNEL_ROWS
    assert not (tmp_path / "kernel_choice.json").exists()


def test_an_unwritable_cache_still_chooses(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(blocker / "cache"))  # under a file: mkdir fails
    rows = kernel_choice.tune_f32_kernel_rows(_packed_layers(10, 1024, 1024))
    assert rows in (llama.DEFAULT_F32_KERNEL_ROWS, *kernel_choice.CANDIDATE_ROWS) and llama.F32_KERNEL_ROWS == rows


def test_an_engine_chooses_before_the_offline_llm_returns(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_choice, "MIN_MODEL_BYTES", 0)  # the tiny model counts as large here
    with LLM(tiny_llama, kv_cache_memory=1 << 24, dtype="float32") as llm:
        (rows,) = _entries(tmp_path).values()
        assert llama.F32_KERNEL_ROWS == rows
        prompts = [{"prompt_token_ids": [(5 * i + j) % 400 + 3 for i in range(20)]} for j in range(6)]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
        assert llm.stats()["kv_blocks_used"] == 0
    # Chosen once: the steps did not measure again.
    assert len(_entries(tmp_path)) == 1
