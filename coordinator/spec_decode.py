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

Rejected drafts leave K/V behind in slots beyond the sequence's computed tokens; the next step
overwrites them, and the prefix cache only ever registers blocks full of computed (accepted)
tokens. Sequences that sample under a structured output, with penalties, within `min_tokens`,
or by beam search decode one token at a time.
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
    """Whether `seq`'s next tokens may be drafted: sampling whose per-position processing needs
    no state the drafts would change (penalties, a grammar, min_tokens bans, beams)."""
    p = seq.params
    return (seq.grammar is None and not p.has_penalties and not p.use_beam_search
            and seq.num_output_tokens >= p.min_tokens and not seq.fork_ids)
