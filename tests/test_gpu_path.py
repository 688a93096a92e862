"""The parts of the GPU path a CPU can check: KV sizing arithmetic and its refusal, the CUDA-graph
batch sizes, the memory profile's dummy steps (run here on the CPU), and backend selection.
The rest runs on a GPU only: benchmarks/gpu/check.sh."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedserve.config import EngineConfig, resolve_model
from workers.cuda_graphs import graph_batch_sizes, padded_size
from workers.gpu_memory import GiB, MemoryProfile, kv_blocks_for
from workers.step_plan import SeqSampling
from workers.worker import Worker, _plain_greedy


def test_kv_blocks_are_what_utilization_leaves_after_weights_activations_and_graphs():
    profile = MemoryProfile(total=80 * GiB, weights=16 * GiB, peak_activations=2 * GiB, graphs=GiB)
    assert kv_blocks_for(profile, 0.9, block_bytes=2 << 20) == (int(80 * GiB * 0.9) - 19 * GiB) // (2 << 20)
    with pytest.raises(ValueError) as err:
        kv_blocks_for(profile, 0.2, block_bytes=2 << 20)
    message = str(err.value)
    for words in ("gpu_memory_utilization (0.2)", "16.00 of 80.00 GiB", "weights (16.00 GiB)",
                  "peak activations (2.00 GiB)", "CUDA graphs (1.00 GiB)", "leave -3.00 GiB"):
        assert words in message


def test_graph_batch_sizes_cover_max_num_seqs():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 8]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and sizes == sorted(sizes)
    assert padded_size(sizes, 3) == 4 and padded_size(sizes, 17) == 32 and padded_size(sizes, 257) is None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_memory_profiles_dummy_steps_run_and_write_only_the_scratch_cache(tiny_llama, backend):
    config = EngineConfig(model=tiny_llama, attention_backend=backend, max_num_batched_tokens=40)
    worker = Worker(config, resolve_model(tiny_llama), max_model_len=128)
    scratch = worker.cache_spec.allocate(5, "cpu")
    worker.dummy_step(scratch, num_seqs=1, query_len=40, logits_rows=8)  # the largest prefill step
    assert scratch[:3].abs().sum() > 0  # its 40 tokens' K/V went to blocks 0-2
    worker.dummy_step(scratch, num_seqs=4, query_len=1, logits_rows=0)  # a decode batch


def test_every_model_tensor_lives_where_the_model_is_built(tiny_llama):
    """The first GPU run found the RoPE tables left on the CPU (a device-side index error at the
    first step). Built under the meta device, anything computed on the CPU and kept shows up."""
    import torch

    from workers.model_config import load_hf_config
    from workers.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(load_hf_config(resolve_model(tiny_llama)), max_positions=64)
    placed = {name: t.device.type for name, t in [*model.named_parameters(), *model.named_buffers()]}
    assert {"rope_cos", "rope_sin"} <= placed.keys()
    assert set(placed.values()) == {"meta"}, {n: d for n, d in placed.items() if d != "meta"}


def test_argmax_on_the_device_only_for_plain_greedy_rows():
    greedy = SeqSampling(0, 0.0, 1.0, 0, 0.0, None)
    assert _plain_greedy(greedy)
    assert not _plain_greedy(SeqSampling(0, 0.7, 1.0, 0, 0.0, None))
    assert not _plain_greedy(SeqSampling(0, 0.0, 1.0, 0, 0.0, None, banned_token_ids=(2,)))  # min_tokens
    assert not _plain_greedy(SeqSampling(0, 0.0, 1.0, 0, 0.0, None, num_logprobs=0))
    assert not _plain_greedy(SeqSampling(0, 0.0, 1.0, 0, 0.0, None, repetition_penalty=1.2))


def test_unusable_attention_backends_are_refused_clearly(tiny_llama, monkeypatch):
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cpu, triton; got 'cuda'"):
        EngineConfig(model=tiny_llama, attention_backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = EngineConfig(model=tiny_llama, attention_backend="triton")
    with pytest.raises(ValueError, match="attention_backend 'triton' needs device cuda"):
        Worker(config, resolve_model(tiny_llama), max_model_len=128)


def test_the_cpu_path_runs_without_triton_or_cupy(tiny_llama):
    """As on a CPU install without them (torch itself probes for triton, so the test hides both
    packages rather than checking sys.modules): generation and a swap store still work."""
    import os
    import subprocess
    import sys

    code = ("import sys\nsys.modules['triton'] = None\nsys.modules['cupy'] = None  # import fails\n"
            "from pagedserve import LLM, SamplingParams\n"
            f"with LLM({tiny_llama!r}, kv_cache_memory=1 << 22, swap_space=0.001) as llm:\n"
            "    out = llm.generate('Hello', SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)\n"
            "assert len(out[0].outputs[0].token_ids) == 3\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_gpu_checks_script_runs_end_to_end_in_smoke_mode(tmp_path):
    """benchmarks/gpu/check.py is run only where a GPU is lent, rarely: its smoke mode (the same
    code, tiny shapes, Triton interpreted) keeps it from rotting between such runs."""
    import json
    import runpy

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("smoke mode runs Triton in its CPU interpreter")
    check = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "check.py"))
    assert check["main"](["--smoke", "--out", str(tmp_path)]) == 0
    details = json.loads((tmp_path / "details.json").read_text())
    assert details["errors"] == {}
    assert len(details["kernels"]) == 63 and all(r["ok"] for r in details["kernels"])
    assert details["swap"]["exact"]
    assert details["exact"]["tiny"]["identical"] == details["exact"]["tiny"]["requests"] == 16
    (tiny,) = details["end_to_end"]
    for mode in ("graphs", "graphs-dot", "eager"):  # on a CPU all run eagerly: the check's own plumbing
        assert tiny[mode]["identical_greedy_outputs"] == tiny["requests"]
        assert tiny[mode]["same_first_token"] == tiny["requests"]
