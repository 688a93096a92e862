"""Shared fixtures: tiny random Llama-family models written to temp folders (no model hub)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run on the CPU in Triton's interpreter; it is chosen when triton is first
# imported, so before any test module imports it. (On a GPU machine they run compiled.)
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# fp32 layers at the default few-row crossover, not one measured under the suite's load and kept
# for this machine's later servers (workers/kernel_choice.py; its own tests unset this).
os.environ.setdefault("PAGEDSERVE_F32_KERNEL_ROWS", "4")

TINY_VOCAB = 49152  # the bundled tokenizer's; tiny models reuse it so text prompts work


def _bundled_tokenizer():
    from pagedserve.config import resolve_model
    from workers.gguf_cache import load_tokenizer

    src = resolve_model("smollm2-135m-instruct")
    return load_tokenizer(src)


@pytest.fixture(scope="session")
def bundled_tokenizer():
    return _bundled_tokenizer()


def _write_tiny_model(path, model_type: str, tokenizer, **overrides) -> str:
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    torch.manual_seed(1234)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  # Large weights give peaked logits: greedy decoding then has no near-ties.
                  initializer_range=0.3, tie_word_embeddings=False)
    common.update(overrides)
    if model_type == "qwen2":
        config = Qwen2Config(rope_theta=10000.0, **common)
        model = Qwen2ForCausalLM(config)
    elif model_type == "mistral":
        config = MistralConfig(rope_theta=10000.0, sliding_window=None, **common)
        model = MistralForCausalLM(config)
    else:
        config = LlamaConfig(rope_theta=10000.0, **common)
        model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, bundled_tokenizer) -> str:
    return _write_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", bundled_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, bundled_tokenizer) -> str:
    return _write_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", bundled_tokenizer)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory, bundled_tokenizer) -> str:
    return _write_tiny_model(tmp_path_factory.mktemp("tiny_mistral"), "mistral", bundled_tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_one_kv_head(tmp_path_factory, bundled_tokenizer) -> str:
    """One KV head (replicated under tensor parallelism) and an odd vocabulary (padded shards)."""
    return _write_tiny_model(tmp_path_factory.mktemp("tiny_llama_1kv"), "llama", bundled_tokenizer,
                             num_key_value_heads=1, vocab_size=TINY_VOCAB + 3)


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """One local Ray session for the whole test run (starting one costs seconds)."""
    import ray

    # The workers' core claims (cpu_threads_bind auto) in a registry of this run's own, which the
    # raylet's worker processes inherit: a server running beside the tests holds none of them.
    os.environ["PAGEDSERVE_CORE_REGISTRY"] = str(tmp_path_factory.mktemp("cores") / "cores.json")
    # 4 logical CPUs on 2 cores: room for SmolLM2 at tensor_parallel_size=3 (9 heads, 3 KV heads).
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
