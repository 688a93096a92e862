"""The bundled SmolLM2-135M-Instruct GGUF: greedy tokens equal transformers' generate."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import resolve_model
from tests.reference import assert_same_or_near_tie, hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The most important thing about learning a language is",
    "List three fruits that are red:",
    "To make a good cup of tea, you should",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2():
    return LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory=1 << 28)


@pytest.fixture(scope="module")
def hf_smollm2():
    from transformers import AutoModelForCausalLM, GgufConfig

    src = resolve_model("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file, dtype=torch.float32,
                                                quantization_config=GgufConfig(dequantize=True)).eval()


def test_smollm2_greedy_equals_transformers_on_nine_prompts(smollm2, hf_smollm2):
    tok = smollm2.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = smollm2.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    exact = 0
    for p, out in zip(prompt_ids, outs):
        expected = hf_greedy(hf_smollm2, p, NEW_TOKENS)
        exact += assert_same_or_near_tie(hf_smollm2, p, out.outputs[0].token_ids, expected)
    print(f"token-exact: {exact} of {len(PROMPTS)} prompts")
    assert exact >= len(PROMPTS) - 2, f"only {exact} of {len(PROMPTS)} prompts were token-exact"


def test_smollm2_text_prompt_decodes_to_readable_text(smollm2):
    out = smollm2.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=8),
                           use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("length", "stop")


def test_smollm2_same_tokens_under_preemption_and_prefix_hits(smollm2):
    tok = smollm2.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode("A long shared instruction about careful writing. " * 6 + p)}
               for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    roomy = [o.outputs[0].token_ids for o in smollm2.generate(prompts, params, use_tqdm=False)]
    # 14 blocks x 16 = 224 slots for 9 sequences of ~80 tokens: preemption must happen.
    small = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory=14 * 737280,
                max_num_batched_tokens=64)
    tight = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert tight == roomy
    assert stats["kv_blocks_used"] == 0


def test_smollm2_tensor_parallel_3_gives_the_tokens_of_one_rank(ray_session, smollm2):
    """Three worker actors over gloo, one KV head each (of 3) and a third of every weight matrix."""
    tok = smollm2.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in smollm2.generate(prompts, params, use_tqdm=False)]
    with LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory=1 << 28, tensor_parallel_size=3) as tp3:
        three = [o.outputs[0].token_ids for o in tp3.generate(prompts, params, use_tqdm=False)]
        assert tp3.stats()["kv_blocks_total"] == 3 * smollm2.stats()["kv_blocks_total"]
    assert three == one


@pytest.mark.parametrize("width", [2, 4])
def test_smollm2_beam_search_equals_transformers(smollm2, hf_smollm2, width):
    from tests.test_beam_search import hf_beam

    tok = smollm2.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    outs = smollm2.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(use_beam_search=True, beam_width=width, max_tokens=12), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_beam(hf_smollm2, p, width)


def test_dequantized_weights_are_cached_and_the_next_load_reads_them(tmp_path, monkeypatch):
    import transformers

    from workers import gguf_cache, model_loader

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    src = resolve_model("smollm2-135m-instruct")
    cached = gguf_cache.dense_weights_path(src)
    folder = cached.parent
    stem = folder.name.rsplit("-", 1)[0]
    stale = folder.with_name(stem + "-0123456789abcdef")  # the same GGUF file under an older key
    legacy = tmp_path / "weights" / f"{stem}-0123456789abcdef.safetensors"  # an older release's place
    other = folder.with_name("another-model-0123456789abcdef")
    for path in (stale, other):
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"x")
    legacy.parent.mkdir()
    legacy.write_bytes(b"x")
    first = dict(model_loader._gguf_tensors(src))
    assert folder.parent == tmp_path / "gguf" and cached.exists()
    assert not stale.exists() and not legacy.exists() and other.exists()  # only the stale copies go
    assert cached.stat().st_mode & 0o077 == 0  # this user's only
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary file left

    def no_dequantizing(*args, **kwargs):
        raise AssertionError("the cached load dequantized the GGUF file again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_dequantizing)
    again = dict(model_loader._gguf_tensors(src))
    # The tied LM head is stored once, under the embedding's name; every other tensor is equal.
    assert set(first) - set(again) == {"lm_head.weight"}
    assert all(torch.equal(first[name], again[name]) for name in again)


def _in_fresh_process(cache, module: str, function: str, show: str) -> list[str]:
    """What a new process with `cache` as its PAGEDSERVE_CACHE prints of `show`, an expression
    of `x = function(the bundled model's source)` (and of sys)."""
    code = (f"import sys; from pagedserve.config import resolve_model; from {module} import {function}; "
            f"x = {function}(resolve_model('smollm2-135m-instruct')); print({show})")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True,
                          env={**os.environ, "PAGEDSERVE_CACHE": str(cache)}).stdout.split()


def test_the_gguf_tokenizer_and_config_are_cached_and_read_back_equal(tmp_path, monkeypatch):
    """Converting them from the GGUF file takes seconds each in every process that loads the
    model; the cached copies must behave exactly as the converted ones."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from workers import gguf_cache

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    src = resolve_model("smollm2-135m-instruct")
    converted_tok = gguf_cache.load_tokenizer(src)
    converted_cfg = gguf_cache.load_config(src)
    folder = gguf_cache.cache_folder(src)
    assert (folder / "tokenizer" / "tokenizer.json").is_file() and (folder / "config" / "config.json").is_file()

    real_from_pretrained = {cls: cls.from_pretrained for cls in (AutoTokenizer, AutoConfig)}

    def refusing_gguf(cls):
        def from_pretrained(path, *args, **kwargs):
            assert "gguf_file" not in kwargs, f"{cls.__name__} read the GGUF file again"
            return real_from_pretrained[cls](path, *args, **kwargs)
        return from_pretrained

    for cls in real_from_pretrained:
        monkeypatch.setattr(cls, "from_pretrained", refusing_gguf(cls))
    tok, cfg = gguf_cache.load_tokenizer(src), gguf_cache.load_config(src)

    texts = PROMPTS + ["  leading spaces\n\ttabs", "ünïcödé 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        ids = converted_tok.encode(text)
        assert tok.encode(text) == ids and tok.decode(ids) == converted_tok.decode(ids)
    chat = [{"role": "user", "content": "Name a colour."}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        converted_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, len(tok)) == \
        (converted_tok.eos_token_id, converted_tok.bos_token_id, converted_tok.pad_token_id, len(converted_tok))
    assert type(tok) is type(converted_tok)
    differing = {k for k, v in converted_cfg.to_dict().items() if cfg.to_dict().get(k) != v}
    assert differing <= {"_name_or_path"}
    assert type(cfg) is type(converted_cfg) and isinstance(cfg, transformers.PretrainedConfig)

    # What the engine reads: the config's every attribute, without importing transformers.
    out = _in_fresh_process(tmp_path, "workers.model_config", "load_hf_config",
                            "type(x).__name__, x.num_hidden_layers, x.rope_parameters['rope_theta'], "
                            "'transformers' in sys.modules")
    assert out == ["ConfigSnapshot", str(converted_cfg.num_hidden_layers),
                   str(converted_cfg.rope_parameters["rope_theta"]), "False"]
    # ... and the cached tokenizer loads without importing torch (the coordinator's process
    # would spend 2 s of its start on it, beside workers loading the model).
    out = _in_fresh_process(tmp_path, "workers.gguf_cache", "load_tokenizer", "len(x), 'torch' in sys.modules")
    assert out == [str(len(converted_tok)), "False"]

    # A damaged cache costs a conversion, never the load.
    (folder / "tokenizer" / "tokenizer.json").write_text("{not json")
    for cls, real in real_from_pretrained.items():
        monkeypatch.setattr(cls, "from_pretrained", real)
    assert gguf_cache.load_tokenizer(src).encode(PROMPTS[0]) == converted_tok.encode(PROMPTS[0])
    assert AutoTokenizer.from_pretrained(str(folder / "tokenizer")).encode(PROMPTS[0]) == \
        converted_tok.encode(PROMPTS[0])  # and written again
