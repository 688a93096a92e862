"""Speculative decoding with n-gram (prompt lookup) proposals, vLLM's `method: "ngram"`.

Settings: `pagedserve.config.SpeculativeConfig` (vLLM's `speculative_config` dict, checked).
A decoding sequence whose last `n` tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
occurred earlier in its own prompt or output proposes the up to `num_speculative_tokens` tokens
that followed that occurrence (the latest one): no draft model. The step computes the sequence's
last token and its drafts together, one causal chunk; the worker samples every one of those
positions as it would have without speculation (the same processing, and for a seeded request
the same noise: it is a function of (seed, position)). Draft i is accepted while it equals the
token sampled at its position; the first sample that differs is kept as the correction, and if
all are accepted the last position's sample is a bonus token. So a sequence gains 1 to k+1
tokens per step, and every token is a sample of the target distribution given the accepted
prefix: greedy and seeded outputs are identical with and without speculation, and unseeded ones
follow the same distribution. (With a one-hot draft, accepting iff the target's sample equals
it accepts with probability p(draft), and a rejection leaves a sample of p conditioned on not
being the draft: exactly what rejection sampling gives.)

Each position after a draft samples as if the drafts before it were already output: the
penalties count them, `min_tokens` bans stop tokens by their count, and a structured output's
mask is its grammar's state after them (llguidance computes those masks in one call). Drafts
the grammar refuses are cut off before the step, since they could never be accepted.

Rejected drafts leave K/V behind in slots beyond the sequence's computed tokens; the next step
overwrites them, and the prefix cache only ever registers blocks full of computed (accepted)
tokens. Beams, and a request's first token while it forks its n samples, decode one token at a
time.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix n-gram
    of `tokens` (n_max down to n_min); [] when none occurs."""
    length = len(tokens)
    if k <= 0 or length <= n_min:
        return []
    arr = np.asarray(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows starting at 0 .. length - n - 1: every occurrence but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return []


def speculates(seq) -> bool:
    """Whether `seq`'s next tokens may be drafted: not a beam (beam search ranks every candidate
    of one position), nor a sequence about to fork its parallel samples off its next token."""
    return not seq.params.use_beam_search and not seq.fork_ids
