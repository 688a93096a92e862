"""The sampler against plain reference filters, and per-request seeds."""

from __future__ import annotations

import pytest
import torch

from coordinator.sampling_params import SamplingParams
from workers.sampler import Sampler
from workers.step_plan import SeqSampling


def _params(seq_id=0, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, banned=()):
    return SeqSampling(seq_id, temperature, top_p, top_k, min_p, seed, banned)


def _support(logits_row, params, draws=400):
    """The set of tokens the sampler ever picks for one row."""
    sampler = Sampler(seed=0)
    rows = logits_row.repeat(draws, 1)
    return set(sampler(rows, [params] * draws).tolist())


def test_greedy_picks_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 4.9]])
    assert Sampler()(logits.clone(), [_params(temperature=0.0)] * 2).tolist() == [1, 0]


def test_top_k_keeps_only_the_k_largest():
    logits = torch.tensor([1.0, 1.1, 1.2, 0.9, 1.15])
    assert _support(logits, _params(top_k=2)) == {2, 4}


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # 0.5 + 0.3 = 0.8 >= 0.75: tokens 0 and 1 only.
    assert _support(probs.log(), _params(top_p=0.75)) == {0, 1}
    assert _support(probs.log(), _params(top_p=0.5)) == {0}


def test_min_p_drops_tokens_below_share_of_the_top():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # threshold 0.25 * 0.5 = 0.125: token 3 (0.05) is dropped, token 2 (0.15) stays.
    assert _support(probs.log(), _params(min_p=0.25)) == {0, 1, 2}


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 6000
    draws = Sampler(seed=1)(probs.log().repeat(n, 1), [_params()] * n)
    freq = torch.bincount(draws, minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    assert Sampler()(logits.clone(), [_params(temperature=0.0, banned=(0,))]).item() != 0


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, 50)
    alone = [Sampler(seed=0)(logits.clone(), [_params(seed=7)]).item() for _ in range(1)]
    s = Sampler(seed=5)
    batch = torch.cat([torch.randn(3, 50), logits])
    mixed = s(batch, [_params(1), _params(2, seed=3), _params(3), _params(0, seed=7)])
    assert mixed[3].item() == alone[0]


def test_seeded_stream_continues_across_steps_and_is_dropped_when_finished():
    logits = torch.zeros(1, 1000)
    s = Sampler()
    first = [s(logits.clone(), [_params(seed=11)]).item() for _ in range(5)]
    s2 = Sampler()
    assert [s2(logits.clone(), [_params(seed=11)]).item() for _ in range(5)] == first
    assert len(set(first)) > 1  # the generator advances between steps
    s.drop([0])
    assert s(logits.clone(), [_params(seed=11)]).item() == first[0]


@pytest.mark.parametrize("field,value,words", [
    ("temperature", -0.5, "temperature must be >= 0"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
    ("top_k", -2, "top_k must be an integer >= -1"),
    ("min_p", 2.0, "min_p must be in [0, 1]"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0"),
    ("seed", -3, "seed must be an integer >= 0"),
    ("stop", [""], "stop must be a list of non-empty strings"),
    ("stop_token_ids", [-1], "stop_token_ids must be an integer >= 0"),
    ("n", 0, "n must be an integer >= 1"),
])
def test_invalid_sampling_params_name_the_field_and_range(field, value, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert words in str(err.value)


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens .* must be <= max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)
