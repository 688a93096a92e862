"""Speculative decoding with n-gram proposals: the proposer, the config's checks, and whole engines
whose outputs with speculation equal those without (greedy and seeded sampling, with chunked
prefill, prefix caching, preemption, n > 1, penalties, min_tokens and structured outputs), while
drafts really are accepted."""

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


def test_stop_strings_before_min_tokens_are_ignored_inside_an_accepted_run(small_vocab):
    """A step that accepts drafts decodes and checks each token where it stands: a stop string
    in the part of the run before min_tokens does not end the output (outputs, text included,
    equal those without speculation)."""
    plain, _ = _generate(small_vocab, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    with LLM(small_vocab, kv_cache_memory=1 << 24) as llm:
        text = llm.get_tokenizer().decode(plain[0][0][:6])
    stops = [text[-2:], text[-1:] + "never in any output, surely"]  # a short one ending in the early text
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, min_tokens=12, stop=stops)
    texts = {}
    for spec in (None, SPEC):
        with LLM(small_vocab, kv_cache_memory=1 << 24, speculative_config=spec) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
            texts[spec is None] = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
            if spec is not None:
                assert llm.stats()["spec_accepted_tokens_total"] > 0
    assert texts[False] == texts[True]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.1, frequency_penalty=0.1),
    SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=30, ignore_eos=True, presence_penalty=0.2,
                   repetition_penalty=1.05),
    SamplingParams(temperature=0.0, max_tokens=40, min_tokens=12, stop_token_ids=[17, 18, 19]),
], ids=["greedy-penalties", "seeded-n2-penalties", "min-tokens"])
def test_penalties_and_min_tokens_count_the_drafts_before_each_position(small_vocab, params):
    """Each position after a draft samples as if the drafts before it were output: penalised by
    them, and allowed a stop token once they bring the output to min_tokens. A position sampled
    with the sequence's state before its step (no drafts counted) gives other tokens."""
    expected, _ = _generate(small_vocab, params)
    got, stats = _generate(small_vocab, params, speculative_config=SPEC)
    assert got == expected
    assert stats["spec_accepted_tokens_total"] > 0
    if params.min_tokens:  # the ban held until min_tokens, then a stop token ended some outputs
        assert all(len(o[0]) >= 12 for o in got)
        assert any(o[0][-1] in (17, 18, 19) and len(o[0]) < 40 for o in got)


def test_each_draft_position_samples_with_the_drafts_before_it_as_output():
    """The plan's sampling rows for a speculating decode: row j counts drafts[:j] as output (the
    penalties' history, the min_tokens ban, the seeded noise's position). End-to-end equality
    rarely shows this on a random model (penalties make its drafts rarely accepted)."""
    from coordinator.plan_builder import build_step_plan
    from coordinator.scheduler import SchedulerOutput
    from coordinator.sequence import Sequence

    params = SamplingParams(temperature=0.7, seed=4, frequency_penalty=0.5, min_tokens=5, stop_token_ids=[9])
    seq = Sequence(0, "r", [3, 4, 5, 6], params)
    seq.token_ids += [7, 8, 7]  # three output tokens, all computed but the last
    seq.num_computed_tokens, seq.block_table = 6, [0]
    drafts = [8, 7, 8]
    plan = build_step_plan(SchedulerOutput(scheduled=[(seq, 4)], drafts={seq: drafts}), 16, [], frozenset({2}))
    assert plan.input_ids.tolist() == [7, 8, 7, 8] and plan.positions.tolist() == [6, 7, 8, 9]
    rows = plan.sampling
    assert [r.output_token_ids for r in rows] == [(7, 8, 7), (7, 8, 7, 8), (7, 8, 7, 8, 7), (7, 8, 7, 8, 7, 8)]
    assert [r.position for r in rows] == [7, 8, 9, 10]
    assert [r.banned_token_ids for r in rows] == [(2, 9), (2, 9), (), ()]  # 3 + j outputs against 5
    assert all(r.prompt_token_ids == (3, 4, 5, 6) and r.seed == 4 for r in rows)


# Tokens 17-23 of the bundled tokenizer are the single characters ! " # $ % & ': the grammar
# alternates between two classes, so each draft position has its own mask.
ALTERNATING = r'([!"#][$%&\']){5,14}'


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_structured_outputs_speculate_with_each_positions_own_mask(small_vocab, temperature):
    """Drafts are cut where the grammar refuses them, and position j's mask is the grammar's state
    after the j drafts before it: the outputs equal those without speculation and match the
    grammar (a mask from before the drafts would allow the wrong class at every other position)."""
    import re

    from coordinator.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=temperature, seed=7, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex=ALTERNATING))
    expected, _ = _generate(small_vocab, params)
    got, stats = _generate(small_vocab, params, speculative_config=SPEC)
    assert got == expected
    assert stats["spec_accepted_tokens_total"] > 0
    for (tokens,) in got:
        assert all(17 <= t <= 23 for t in tokens if t != 2), tokens
        text = "".join(chr(ord("!") + t - 17) for t in tokens if t != 2)
        assert re.fullmatch(ALTERNATING.replace("\\'", "'"), text), text


def test_drafts_are_cut_where_the_grammar_refuses_them_and_masks_follow_the_drafts(bundled_tokenizer):
    from coordinator.sampling_params import StructuredOutputsParams
    from coordinator.structured_output import GrammarCompiler, fill_bitmasks

    compiler = GrammarCompiler(bundled_tokenizer, len(bundled_tokenizer), frozenset({2}))
    grammar = compiler.start(StructuredOutputsParams(regex=ALTERNATING))
    other = compiler.start(StructuredOutputsParams(regex=ALTERNATING))
    assert grammar.valid_prefix([17, 20, 18, 18, 21]) == [17, 20, 18]  # the 2nd 18 is in the wrong class
    assert grammar.valid_prefix([20]) == [] and grammar.valid_prefix([]) == []
    masks = fill_bitmasks([(other, ()), (grammar, [17, 20, 18])])
    allowed = [{t for t in range(17, 24) if row[t // 32] >> (t % 32) & 1} for row in masks]
    first, second = {17, 18, 19}, {20, 21, 22, 23}
    assert allowed == [first, first, second, first, second]
    assert grammar.matcher.validate_tokens([20]) == 0  # the matcher did not move
    assert not grammar.accept(17) and grammar.matcher.validate_tokens([20]) == 1


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
