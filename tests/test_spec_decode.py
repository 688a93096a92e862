"""Speculative decoding with n-gram proposals: the proposer, the config's checks, and whole engines
whose outputs with speculation equal those without (greedy and seeded sampling, with chunked
prefill, prefix caching, preemption, n > 1), while drafts really are accepted."""

from __future__ import annotations

import pytest

from coordinator.spec_decode import propose_ngram
from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig, SpeculativeConfig
from tests.conftest import _write_tiny_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
VOCAB = 24  # a random model over few tokens repeats itself, so its drafts are sometimes right


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, bundled_tokenizer) -> str:
    return _write_tiny_model(tmp_path_factory.mktemp("tiny_spec"), "llama", bundled_tokenizer, vocab_size=VOCAB)


def test_the_proposer_continues_the_latest_occurrence_of_the_longest_suffix():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 1, 4) == [3, 4, 1]
    # The 3-gram (7, 8, 9) occurs once; its 2-gram suffix (8, 9) also occurs later: longest first.
    assert propose_ngram([7, 8, 9, 5, 6, 8, 9, 1, 7, 8, 9], 2, 2, 3) == [5, 6]
    assert propose_ngram([7, 8, 9, 5, 6, 8, 9, 1, 7, 8, 9], 2, 2, 2) == [1, 7]  # latest 2-gram
    assert propose_ngram([1, 2, 3, 4], 3, 1, 4) == []  # no earlier occurrence
    assert propose_ngram([5, 5], 4, 1, 4) == [5]  # what follows, up to the end
    assert propose_ngram([1, 2, 1, 2], 0, 1, 4) == []


def test_bad_speculative_configs_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="num_speculative_tokens is required"):
        SpeculativeConfig.from_dict({"method": "ngram"})
    with pytest.raises(ValueError, match="method must be one of ngram; got 'eagle'"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(4\)"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_min": 5})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1; got 0"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown key 'draft_model'"):
        EngineConfig(speculative_config={"num_speculative_tokens": 2, "draft_model": "x"})


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves, as edited or summarised text does: drafts get accepted."""
    phrase = [(13 * i + 5) % (VOCAB - 3) + 3 for i in range(12)]
    return [phrase * 3 + [(7 * j + 1) % (VOCAB - 3) + 3 for j in range(k)] for k in range(1, 7)]


def _generate(model, params, **engine):
    with LLM(model, kv_cache_memory=1 << 24, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
        stats = llm.stats()
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    return [[list(c.token_ids) for c in o.outputs] for o in outs], stats


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=11, max_tokens=30, ignore_eos=True, logprobs=2),
], ids=["greedy", "seeded-n2"])
def test_outputs_with_speculation_equal_outputs_without(small_vocab, params):
    expected, _ = _generate(small_vocab, params)
    got, stats = _generate(small_vocab, params, speculative_config=SPEC)
    assert got == expected
    assert stats["spec_draft_tokens_total"] > 0 and stats["spec_accepted_tokens_total"] > 0
    assert 0 < stats["spec_acceptance_rate"] <= 1 and stats["spec_mean_accepted_length"] > 1


def test_speculation_under_chunked_prefill_prefix_caching_and_preemption(small_vocab):
    """Small chunks, a pool too small for every sequence at once (preemption by recompute and by
    swap), and prompts sharing their first blocks: the tokens are still those without drafts."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    engine = dict(max_num_batched_tokens=24, block_size=8)
    expected, _ = _generate(small_vocab, params, **engine)
    for mode in ("recompute", "swap"):
        tight = dict(engine, kv_cache_memory=1 << 16, preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0)
        with LLM(small_vocab, speculative_config=SPEC, **tight) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
            stats = llm.stats()
        assert [[list(c.token_ids) for c in o.outputs] for o in outs] == expected
        assert stats["num_preemptions"] > 0 and stats["spec_accepted_tokens_total"] > 0
        assert stats["kv_blocks_used"] == 0


def test_max_tokens_and_stop_tokens_cut_an_accepted_run(small_vocab):
    """A step may gain several tokens: none past max_tokens, none after a stop token."""
    plain, _ = _generate(small_vocab, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    stop = plain[0][0][9]  # the 10th token of the first output (its first occurrence, checked)
    assert stop not in plain[0][0][:9]
    params = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop], ignore_eos=True)]
    got = {}
    for i, p in enumerate(params):
        expected, _ = _generate(small_vocab, p)
        got[i], stats = _generate(small_vocab, p, speculative_config=SPEC)
        assert got[i] == expected and stats["spec_accepted_tokens_total"] > 0
    assert all(len(o[0]) == 7 for o in got[0])
    assert got[1][0][0][-1] == stop and len(got[1][0][0]) == 10


def test_unseeded_samples_with_speculation_follow_the_distribution_without(small_vocab):
    """Unseeded sampling draws other noise with drafts, so compare distributions: the tokens at
    output positions 2-6 (where drafts are verified) of 240 samples each way, a chi-square test
    of homogeneity over the vocabulary (df = 23, p = 0.001: 49.7). Accepting drafts without
    verifying them would skew the speculative run towards the prompt's own tokens."""
    prompt = _prompts()[2]
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    counts = {}
    for name, extra in (("plain", {}), ("spec", {"speculative_config": SPEC})):
        with LLM(small_vocab, kv_cache_memory=1 << 24, seed=5, **extra) as llm:
            outs = llm.generate([{"prompt_token_ids": prompt}] * 240, params, use_tqdm=False)
            drafted = llm.stats()["spec_accepted_tokens_total"]
        hist = [0] * VOCAB
        for o in outs:
            for token in o.outputs[0].token_ids[1:]:
                hist[token] += 1
        counts[name] = hist
        if extra:
            assert drafted > 0
    a, b = counts["plain"], counts["spec"]
    n_a, n_b = sum(a), sum(b)
    chi2 = sum((x * n_b - y * n_a) ** 2 / (n_a * n_b * (x + y)) for x, y in zip(a, b) if x + y)
    assert chi2 < 49.7, (chi2, a, b)


def test_the_serve_flag_takes_the_config_as_json():
    import argparse

    from pagedserve.cli import add_engine_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert config_from_args(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "3"])  # not a JSON object: refused by argparse


def test_speculation_on_two_tensor_parallel_ranks(ray_session, small_vocab):
    """Ray worker actors, one per rank: every rank computes the drafts' rows, rank 0 samples them."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected, _ = _generate(small_vocab, params)
    got, stats = _generate(small_vocab, params, speculative_config=SPEC, tensor_parallel_size=2,
                           distributed_executor_backend="ray", worker_cpus=1)
    assert got == expected and stats["spec_accepted_tokens_total"] > 0
