"""The few-row fp32 crossover measured per machine (workers/kernel_choice.py): the rule that reads
the timings, a real measurement on layers large enough to stream from memory, the answer kept on
disk and read back, small models and the override, and an engine: a worker takes a kept answer
before its first step, and otherwise measures once, when its weights' move is done."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pagedserve import LLM, SamplingParams
from workers import kernel_choice
from workers.models import llama

pytestmark = pytest.mark.skipif(not llama.PACK_F32, reason="no packed fp32 GEMM here (MKL, oneDNN or pagedserve's)")
DEFAULT = llama.F32_KERNEL_ROWS


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv(kernel_choice.OVERRIDE_ENV, raising=False)  # the suite's conftest sets it


@pytest.fixture
def measurements(monkeypatch) -> list[int]:
    """How many layers each measurement ran over, one entry per measurement."""
    calls: list[int] = []
    original = kernel_choice.measure
    monkeypatch.setattr(kernel_choice, "measure", lambda layers: calls.append(len(layers)) or original(layers))
    return calls


def _packed_layers(count: int, out_features: int, in_features: int) -> nn.Module:
    torch.manual_seed(count)
    model = nn.Sequential(*[nn.Linear(in_features, out_features, bias=False) for _ in range(count)])
    for layer in model:
        layer.weight.requires_grad_(False)
        layer.packed_weight = llama._pack(layer.weight)
    return model


def _entries(tmp_path) -> dict:
    return json.loads((tmp_path / "kernel_choice.json").read_text())


def _rows_of(model: nn.Module) -> set[int]:
    return {m.f32_kernel_rows for m in model if isinstance(m, nn.Linear)} | {model.f32_kernel_rows}


def test_the_rule_takes_the_rows_the_kernel_wins_by_the_margin_up_to_its_first_miss():
    assert kernel_choice.choose_rows({5: (1.0, 1.2), 6: (1.0, 1.1), 8: (1.0, 1.02)}, DEFAULT) == 6
    assert kernel_choice.choose_rows({5: (1.0, 1.2), 6: (1.3, 1.0), 8: (1.0, 2.0)}, DEFAULT) == 5  # no gaps
    assert kernel_choice.choose_rows({5: (1.2, 1.0)}, 11) == 4  # the rows below the first lost are the kernel's
    assert kernel_choice.choose_rows({1: (1.2, 1.0), 2: (1.0, 2.0)}, DEFAULT) == 0  # the GEMM at every count
    assert kernel_choice.choose_rows({1: (1.0, 1.2), 2: (1.2, 1.0)}, DEFAULT) == 1
    assert kernel_choice.choose_rows({}, DEFAULT) == DEFAULT
    # Winning by less than the margin is not winning: a tie keeps oneDNN.
    assert kernel_choice.choose_rows({1: (1.0, 1.0 / (1 - kernel_choice.MARGIN) - 1e-3)}, DEFAULT) == 0


def test_the_gemm_rule_keeps_the_default_unless_another_wins_by_the_margin():
    assert kernel_choice.choose_gemm({"mkl": 1.0, "onednn": 0.8}, "mkl") == "onednn"
    assert kernel_choice.choose_gemm({"mkl": 0.8, "onednn": 1.0}, "mkl") == "mkl"
    assert kernel_choice.choose_gemm({"mkl": 1.0, "onednn": 1.0 - kernel_choice.MARGIN / 2}, "mkl") == "mkl"
    assert kernel_choice.choose_gemm({"mkl": 1.0, "onednn": 0.8}, "onednn") == "onednn"
    assert kernel_choice.choose_gemm({}, "mkl") == "mkl"  # nothing measured: the default


@pytest.mark.skipif(len(llama.F32_GEMMS) < 2, reason="one fp32 GEMM here: nothing to choose")
def test_both_gemms_are_measured_and_the_layers_keep_their_packing():
    model = _packed_layers(4, 1024, 1024)
    before = [m.packed_weight for m in model]
    timings = kernel_choice.measure_gemms(list(model))
    assert set(timings) == set(llama.F32_GEMMS) and all(t > 0 for t in timings.values())
    assert [m.packed_weight for m in model] == before


def _gemms_of(model: nn.Module) -> set[str]:
    """The GEMMs every fp32 packed weight of a served model, its LM head's included, is packed for."""
    packed = [m.packed_weight for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    return {llama.f32_gemm_of(p) for p in packed + [model.packed_lm_head]}


@pytest.mark.skipif(len(llama.F32_GEMMS) < 2, reason="one fp32 GEMM here: nothing to choose")
def test_repacking_for_the_other_gemm_keeps_every_product(tiny_llama):
    prompts = [{"prompt_token_ids": [(7 * i + j) % 400 + 3 for i in range(30)]} for j in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    runs = {}
    for gemm in llama.F32_GEMMS:
        with LLM(tiny_llama, kv_cache_memory=1 << 24, dtype="float32") as llm:
            model = llm.engine.executor.worker.model
            assert llama.repack_f32(model, gemm) == (0 if gemm == llama.DEFAULT_F32_GEMM else 1 + 4 * len(model.layers))
            assert llama.repack_f32(model, gemm) == 0  # already packed for it
            assert _gemms_of(model) == {gemm}
            runs[gemm] = llm.generate(prompts, params, use_tqdm=False)
    first, *others = runs.values()
    for other in others:
        for a, b in zip(first, other):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                for token, entry in la.items():
                    assert abs(entry.logprob - lb[token].logprob) < 1e-4
    with pytest.raises(ValueError, match="f32_gemm: one of"):
        llama.repack_f32(model, "blas")


@pytest.mark.skipif(len(llama.F32_GEMMS) < 2, reason="one fp32 GEMM here: nothing to choose")
def test_an_engine_runs_the_gemm_measured_faster_and_a_later_start_packs_for_it(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_choice, "MIN_MODEL_BYTES", 0)
    other = next(g for g in llama.F32_GEMMS if g != llama.DEFAULT_F32_GEMM)
    monkeypatch.setattr(kernel_choice, "choose_gemm", lambda timings, default: other)  # as if it won
    packed_for: list[str] = []  # the GEMM of every fp32 weight packed, in order
    original_pack = llama._pack

    def recording_pack(weight, f32_gemm=None):
        packed = original_pack(weight, f32_gemm)
        packed_for.append(llama.f32_gemm_of(packed))
        return packed

    monkeypatch.setattr(llama, "_pack", recording_pack)
    for start in range(2):  # the first start measures, the second reads the kept answer
        packed_for.clear()
        with LLM(tiny_llama, kv_cache_memory=1 << 24, dtype="float32") as llm:
            model = llm.engine.executor.worker.model
            assert _gemms_of(model) == {other}
            (entry,) = _entries(tmp_path).values()
            assert entry["gemm"] == other and model.f32_kernel_rows == entry["rows"]
            out = llm.generate([{"prompt_token_ids": list(range(3, 40))}],
                               SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 4
        if start == 1:
            # Read before packing: each weight (the LM head, each layer's four projections) packed
            # once, for the kept GEMM, not for the default first.
            assert packed_for == [other] * (1 + 4 * len(model.layers))
        monkeypatch.setattr(kernel_choice, "measure_gemms", lambda layers: pytest.fail("measured again"))


def test_large_layers_are_measured_once_and_the_answer_is_read_back(tmp_path, measurements):
    model = _packed_layers(10, 1024, 1024)  # 40 MiB of fp32 weights: over the floor
    assert kernel_choice.kept_f32_kernel_rows(model) is None  # nothing kept yet: to be measured
    rows = kernel_choice.tune_f32_kernel_rows(model)
    assert rows in (0, DEFAULT, *kernel_choice.CANDIDATE_ROWS) and _rows_of(model) == {rows}
    assert measurements == [10]
    (key, kept), = _entries(tmp_path).items()
    assert kept["rows"] == rows and kept["gemm"] in llama.F32_GEMMS
    assert {llama.f32_gemm_of(m.packed_weight) for m in model} == {kept["gemm"]}
    # A later start of the same machine and shapes reads it back rather than measuring: an answer
    # the measurement could not give shows it came from the file.
    (tmp_path / "kernel_choice.json").write_text(json.dumps({key: {"rows": 7, "gemm": llama.F32_GEMMS[-1]}}))
    again = _packed_layers(10, 1024, 1024)
    assert kernel_choice.kept_f32_kernel_rows(again) == 7 and _rows_of(again) == {7}
    assert {llama.f32_gemm_of(m.packed_weight) for m in again} == {llama.F32_GEMMS[-1]}  # re-packed for it
    assert kernel_choice.tune_f32_kernel_rows(again) == 7 and measurements == [10]
    # Other shapes are other layers: measured, and kept beside the first entry.
    other = kernel_choice.tune_f32_kernel_rows(_packed_layers(9, 2048, 512))
    entries = _entries(tmp_path)
    assert len(entries) == 2 and entries[key]["rows"] == 7 and len(measurements) == 2
    assert other in [e["rows"] for e in entries.values()]


def test_answers_are_kept_per_cpu_not_per_model_name(monkeypatch):
    # "AMD EPYC" named a Zen 3 and a Zen 4 alike, whose fastest GEMMs differ: the key takes the
    # CPU's flags, as its kernels' builds do.
    layers = kernel_choice._layers(_packed_layers(2, 256, 256))
    here = kernel_choice._key(layers)
    monkeypatch.setattr(kernel_choice.kernels.cpu, "cpu_signature", lambda: b"model name: AMD EPYC\nflags: avx2")
    assert kernel_choice._key(layers) != here


@pytest.mark.parametrize("content", [
    "[8]", "{not json", '{"KEY": 8}', '{"KEY": {"rows": 1000, "gemm": "onednn"}}',
    '{"KEY": {"rows": true, "gemm": "onednn"}}', '{"KEY": {"rows": -1, "gemm": "onednn"}}',
    '{"KEY": {"rows": 8, "gemm": "blas"}}', '{"KEY": {"rows": 8}}'])
def test_a_kept_file_it_cannot_use_is_measured_over(tmp_path, measurements, content):
    model = _packed_layers(10, 1024, 1024)
    key = kernel_choice._key(kernel_choice._layers(model))
    (tmp_path / "kernel_choice.json").write_text(content.replace("KEY", key))
    rows = kernel_choice.tune_f32_kernel_rows(model)
    assert measurements == [10] and _entries(tmp_path)[key]["rows"] == rows
    assert rows in (0, DEFAULT, *kernel_choice.CANDIDATE_ROWS)


def test_the_measurement_stops_at_the_first_row_count_the_kernel_does_not_win():
    timings = kernel_choice.measure(list(_packed_layers(10, 1024, 1024)))
    if not timings:
        pytest.skip("the C weight kernel did not build here")
    rows = sorted(timings)
    assert rows == list(kernel_choice.CANDIDATE_ROWS[:len(rows)])
    assert all(kernel > 0 and onednn > 0 for kernel, onednn in timings.values())
    # Every row count before the last was a win; the last ended the search, unless it was the last candidate.
    assert kernel_choice.choose_rows({r: timings[r] for r in rows[:-1]}, DEFAULT) == (rows[-2] if len(rows) > 1
                                                                                      else DEFAULT)
    if kernel_choice.choose_rows(timings, DEFAULT) == rows[-1]:
        assert len(rows) == len(kernel_choice.CANDIDATE_ROWS)


def test_the_two_kernels_alternate_within_each_round_of_a_measurement(monkeypatch):
    # A burst of other work on the cores must slow both sides of a comparison, not only the side
    # whose repeats it fell on: each round times the C kernel, then oneDNN.
    calls: list[str] = []
    original_kernel, original_onednn = kernel_choice.f32_linear, llama.packed_linear
    monkeypatch.setattr(kernel_choice, "f32_linear", lambda x, w: calls.append("c") or original_kernel(x, w))
    monkeypatch.setattr(llama, "packed_linear", lambda x, p, b=None: calls.append("onednn") or original_onednn(x, p, b))
    monkeypatch.setattr(kernel_choice, "CANDIDATE_ROWS", (5,))
    layers = list(_packed_layers(2, 256, 256))
    timings = kernel_choice.measure(layers)
    if not timings:
        pytest.skip("the C weight kernel did not build here")
    rounds = calls[1:]  # the first call checks that the kernel applies
    per_side = len(layers)
    assert rounds == (["c"] * per_side + ["onednn"] * per_side) * kernel_choice.REPEATS


def test_small_models_and_the_override_take_no_measurement(tmp_path, measurements, monkeypatch):
    small = _packed_layers(2, 256, 256)
    assert kernel_choice.tune_f32_kernel_rows(small) == DEFAULT and _rows_of(small) == {DEFAULT}
    # Layers without a packed copy (bf16, int8, a GPU's) are not the fp32 layers it chooses for.
    big = _packed_layers(10, 1024, 1024)
    for layer in big:
        del layer.packed_weight
    assert kernel_choice.tune_f32_kernel_rows(big) == DEFAULT
    monkeypatch.setenv(kernel_choice.OVERRIDE_ENV, "11")
    forced = _packed_layers(10, 1024, 1024)
    assert kernel_choice.tune_f32_kernel_rows(forced) == 11 and _rows_of(forced) == {11}
    assert measurements == [] and not (tmp_path / "kernel_choice.json").exists()
    monkeypatch.setenv(kernel_choice.OVERRIDE_ENV, "0")  # the packed GEMM at every row count
    assert kernel_choice.tune_f32_kernel_rows(forced) == 0 and _rows_of(forced) == {0}
    monkeypatch.setenv(kernel_choice.OVERRIDE_ENV, "99")
    with pytest.raises(ValueError, match=f"{kernel_choice.OVERRIDE_ENV}: a row count from 0 to"):
        kernel_choice.kept_f32_kernel_rows(forced)


def test_an_unwritable_cache_still_chooses(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(blocker / "cache"))  # under a file: mkdir fails
    model = _packed_layers(10, 1024, 1024)
    rows = kernel_choice.tune_f32_kernel_rows(model)
    assert rows in (0, DEFAULT, *kernel_choice.CANDIDATE_ROWS) and _rows_of(model) == {rows}


def test_a_layer_takes_the_kernel_up_to_its_own_rows(monkeypatch):
    calls: list[str] = []
    original_kernel, original_onednn = llama.f32_linear, llama.packed_linear
    monkeypatch.setattr(llama, "f32_linear", lambda x, w: calls.append("c") or original_kernel(x, w))
    monkeypatch.setattr(llama, "packed_linear", lambda x, p, b=None: calls.append("onednn") or original_onednn(x, p, b))
    layer = _packed_layers(1, 80, 96)[0]
    x = torch.randn(6, 96)
    llama.project(x, layer)
    assert calls == ["onednn"]  # 6 rows > the default
    layer.f32_kernel_rows = 8
    calls.clear()
    torch.testing.assert_close(llama.project(x, layer), x @ layer.weight.t(), rtol=1e-5, atol=1e-5)
    assert calls == ["c"]
    layer.f32_kernel_rows = 0  # the packed GEMM at every row count, one row included
    calls.clear()
    torch.testing.assert_close(llama.project(x[:1], layer), x[:1] @ layer.weight.t(), rtol=1e-5, atol=1e-5)
    assert calls == ["onednn"]


def test_an_engine_measures_once_when_its_weights_are_in_place(tiny_llama, tmp_path, monkeypatch, measurements):
    monkeypatch.setattr(kernel_choice, "MIN_MODEL_BYTES", 0)  # the tiny model counts as large here
    prompts = [{"prompt_token_ids": [(5 * i + j) % 400 + 3 for i in range(20)]} for j in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with LLM(tiny_llama, kv_cache_memory=1 << 24, dtype="float32") as llm:
        # The offline LLM returns once it has measured.
        (rows,) = (e["rows"] for e in _entries(tmp_path).values())
        model = llm.engine.executor.worker.model
        assert measurements and model.f32_kernel_rows == rows
        assert all(len(o.outputs[0].token_ids) == 5 for o in llm.generate(prompts, params, use_tqdm=False))
        assert len(measurements) == 1  # the steps did not measure again
        # A server does not wait for its weights' move: while it runs, steps keep the default and
        # measure nothing; the first step after it measures, before computing.
        worker = llm.engine.executor.worker

        class Moving:
            running_now = True

            def running(self):
                return self.running_now

        move = Moving()
        monkeypatch.setattr(worker, "_weights_move", move)
        monkeypatch.setattr(worker, "_kernels_chosen", False)
        (tmp_path / "kernel_choice.json").unlink()
        llm.generate(prompts[:1], params, use_tqdm=False)
        assert len(measurements) == 1 and not (tmp_path / "kernel_choice.json").exists()
        move.running_now = False
        llm.generate(prompts[:1], params, use_tqdm=False)
        assert len(measurements) == 2 and _entries(tmp_path)
        assert llm.stats()["kv_blocks_used"] == 0
    # A later start of the machine takes the kept answer before its first step.
    with LLM(tiny_llama, kv_cache_memory=1 << 24, dtype="float32") as llm:
        assert llm.engine.executor.worker.model.f32_kernel_rows == _entries(tmp_path).popitem()[1]["rows"]
    assert len(measurements) == 2


def test_the_gemm_benchmark_times_every_kernel_on_the_models_projections(tmp_path, capsys):
    """benchmarks/f32_gemm.py: each packed GEMM and torch's `mm` at every row count asked for (and
    pagedserve's built without its next block's prefetch too), the C kernel only up to its rows,
    written to its JSON."""
    from benchmarks import f32_gemm

    out = tmp_path / "gemm.json"
    f32_gemm.main(["--rows", "2", "40", "--repeats", "1", "--layers", "1", "--result-json", str(out)])
    result = json.loads(out.read_text())
    few, many = result["results"]
    names = {"MKL packed": "mkl", "oneDNN packed": "onednn", "pagedserve packed": "pagedserve"}
    packed = {f"{name}_s" for name, gemm in names.items() if gemm in llama.F32_GEMMS}
    if "pagedserve" in llama.F32_GEMMS:
        packed.add("pagedserve, no next_s")
    assert set(few) == {"rows", "torch.mm_s", "C kernel_s", *packed} and few["rows"] == 2
    assert set(many) == {"rows", "torch.mm_s", *packed} and many["rows"] == 40  # beyond the C kernel's rows
    assert all(v > 0 for r in (few, many) for k, v in r.items() if k != "rows")
    assert result["layers"] == 1 and "torch.mm" in capsys.readouterr().out
