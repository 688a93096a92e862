"""The sampler against plain reference filters, and per-request seeds."""

from __future__ import annotations

import pytest
import torch

from coordinator.sampling_params import SamplingParams
from workers.sampler import Sampler, argmax_rows, process_logits
from workers.step_plan import SeqSampling


def _params(seq_id=0, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, banned=()):
    return SeqSampling(seq_id, temperature, top_p, top_k, min_p, seed, banned)


def _support(logits_row, params, draws=400):
    """The set of tokens the sampler ever picks for one row."""
    sampler = Sampler(seed=0)
    rows = logits_row.repeat(draws, 1)
    return set(sampler(rows, [params] * draws)[0].tolist())


def test_greedy_picks_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 4.9]])
    assert Sampler()(logits.clone(), [_params(temperature=0.0)] * 2)[0].tolist() == [1, 0]


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does():
    """`argmax_rows` (torch's `max`, the faster CPU kernel) against `argmax` where they could part:
    ties, -inf rows and masks, NaN, a vocabulary-sized row."""
    torch.manual_seed(0)
    tied = torch.randint(-2, 3, (64, 49152)).float()  # every row has many tied maxima
    masked = torch.randn(8, 1000)
    masked[:, ::3] = float("-inf")
    masked[5] = float("-inf")
    odd = torch.randn(3, 17)
    odd[1, 4] = float("nan")
    for x in (tied, masked, odd, torch.randn(64, 49152).bfloat16()):
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert Sampler()(torch.tensor([[1.0, 7.0, 7.0, 2.0]]), [_params(temperature=0.0)])[0].tolist() == [1]


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
    draws = Sampler(seed=1)(probs.log().repeat(n, 1), [_params()] * n)[0]
    freq = torch.bincount(draws, minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    assert Sampler()(logits.clone(), [_params(temperature=0.0, banned=(0,))])[0].item() != 0


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, 50)
    alone = [Sampler(seed=0)(logits.clone(), [_params(seed=7)])[0].item() for _ in range(1)]
    s = Sampler(seed=5)
    batch = torch.cat([torch.randn(3, 50), logits])
    mixed = s(batch, [_params(1), _params(2, seed=3), _params(3), _params(0, seed=7)])[0]
    assert mixed[3].item() == alone[0]


def _at(position: int, seed: int = 11) -> SeqSampling:
    p = _params(seed=seed)
    p.position = position
    return p


def test_seeded_draws_are_a_function_of_seed_and_position_only():
    logits = torch.zeros(1, 1000)
    s = Sampler()
    stream = [s(logits.clone(), [_at(pos)])[0].item() for pos in range(20, 25)]
    assert len(set(stream)) > 1  # each position draws anew
    # Another sampler (a worker rebuilt after a fault), positions out of order: the same tokens.
    again = Sampler(seed=99)
    assert [again(logits.clone(), [_at(pos)])[0].item() for pos in reversed(range(20, 25))] == stream[::-1]
    assert [s(logits.clone(), [_at(pos, seed=12)])[0].item() for pos in range(20, 25)] != stream


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
    ("truncate_prompt_tokens", 0, "truncate_prompt_tokens must be -1 (as many as fit) or an integer >= 1"),
    ("truncate_prompt_tokens", -2, "truncate_prompt_tokens must be -1 (as many as fit) or an integer >= 1"),
    # containers of the wrong kind: the field named, not a TypeError from inside
    ("stop", 5, "stop must be a string or a list of strings; got int"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of token ids; got int"),
    ("stop_token_ids", "12", "stop_token_ids must be a list of token ids; got str"),
    ("logit_bias", [1], "logit_bias must be a map of token id to bias; got list"),
    ("allowed_token_ids", 3, "allowed_token_ids must be a list of token ids; got int"),
    ("output_kind", 3, "output_kind must be a RequestOutputKind: CUMULATIVE (0), DELTA (1), FINAL_ONLY (2); got 3"),
    ("output_kind", "final", "output_kind must be a RequestOutputKind"),
])
def test_invalid_sampling_params_name_the_field_and_range(field, value, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert words in str(err.value)


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens .* must be <= max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)


def _reference_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's penalties written out token by token."""
    out = logits.clone()
    for t in range(out.shape[0]):
        if t in prompt or t in output:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        count = output.count(t)
        out[t] -= frequency * count + presence * (count > 0)
    return out


def test_penalties_equal_a_plain_reference():
    torch.manual_seed(0)
    logits = torch.randn(2, 40) * 3
    prompt, output = (3, 4, 5, 5), (5, 7, 7, 7, 9)
    p = SeqSampling(0, 0.0, 1.0, -1, 0.0, None, presence_penalty=0.5, frequency_penalty=0.3,
                    repetition_penalty=1.7, prompt_token_ids=prompt, output_token_ids=output)
    processed = logits.clone()
    process_logits(processed, [p, _params()])
    expected = _reference_penalties(logits[0], prompt, output, 0.5, 0.3, 1.7)
    assert torch.allclose(processed[0], expected, atol=1e-6)
    assert torch.equal(processed[1], logits[1])  # a row without penalties is untouched
    assert not torch.equal(processed[0], logits[0])


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    p = SeqSampling(0, 0.0, 1.0, -1, 0.0, None, repetition_penalty=2.0, prompt_token_ids=(0,))
    assert Sampler()(logits.clone(), [p])[0].item() == 1  # 5 / 2 < 4


def test_logit_bias_and_allowed_token_ids():
    logits = torch.tensor([[5.0, 4.0, 0.0, 1.0]])
    biased = SeqSampling(0, 0.0, 1.0, -1, 0.0, None, logit_bias=((2, 10.0),))
    assert Sampler()(logits.clone(), [biased])[0].item() == 2
    allowed = SeqSampling(0, 1.0, 1.0, -1, 0.0, None, allowed_token_ids=(1, 3))
    assert _support(logits[0], allowed) == {1, 3}


def test_logprobs_are_the_raw_log_softmax_with_rank_and_top_k():
    torch.manual_seed(1)
    logits = torch.randn(3, 30)
    params = [SeqSampling(0, 0.0, 1.0, -1, 0.0, None, num_logprobs=5,
                          logit_bias=((int(logits[0].argmax()), -100.0),)),
              _params(1),
              SeqSampling(2, 0.0, 1.0, -1, 0.0, None, num_logprobs=0)]
    tokens, logprobs = Sampler()(logits.clone(), params)
    reference = torch.log_softmax(logits, dim=-1)
    assert logprobs[1] is None
    first = logprobs[0]
    assert first.token_id == tokens[0].item()
    assert abs(first.logprob - reference[0, first.token_id].item()) < 1e-6  # before the bias
    assert first.rank == int((reference[0] > reference[0, first.token_id]).sum()) + 1
    assert first.rank == 2  # the bias moved the greedy choice off the raw argmax
    assert first.top_ids == reference[0].topk(5).indices.tolist()
    assert torch.allclose(torch.tensor(first.top_logprobs), reference[0].topk(5).values)
    assert logprobs[2].top_ids == [] and logprobs[2].rank == 1
