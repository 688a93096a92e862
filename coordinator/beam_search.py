"""Beam search on shared blocks, with the semantics of transformers' `generate(num_beams=k)`.

Every step each running beam brings the top `2k` logprobs of its next token (more with several
EOS ids: transformers keeps max(2, 1 + #eos) * k candidates). The candidates (beam, token) are
ranked by cumulative logprob; the best k that do not end (EOS or the length limit) run on, and
those among the best k that do end become finished hypotheses scored cum / len**length_penalty,
of which the best k are kept. Search stops when no running beam can beat the worst kept
hypothesis (the `early_stopping` heuristics below), when every candidate ends, or at max_tokens.

`beam_step` only decides; `advance_beams` applies a decision through the scheduler: a beam chosen
by several candidates forks (sharing its blocks, copy-on-write), a beam chosen by none is freed
at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from coordinator.sequence import Sequence, SequenceGroup, SequenceStatus
from workers.step_plan import TokenLogprobs


@dataclass(slots=True)
class Hypothesis:
    score: float  # cumulative logprob / generated length ** length_penalty
    token_ids: list[int]  # generated tokens, the ending EOS included
    cumulative_logprob: float
    ended_by_eos: bool


@dataclass(slots=True)
class BeamState:
    width: int
    length_penalty: float
    early_stopping: bool | str
    scores: dict[int, float] = field(default_factory=dict)  # running beam seq_id -> cumulative logprob
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best first, at most `width`
    improvable: bool = True  # transformers' early-stop heuristic, sticky once False
    done: bool = False


@dataclass(slots=True)
class BeamStep:
    """What to do with the running beams: each (parent, token, cumulative logprob) continues."""

    continuations: list[tuple[Sequence, int, float]]
    done: bool


def candidates_per_beam(width: int, num_eos_ids: int) -> int:
    return max(2, 1 + num_eos_ids) * width


def beam_step(state: BeamState, beams: list[Sequence], logprobs: dict[int, TokenLogprobs],
              eos_ids: frozenset[int], max_tokens: int, max_model_len: int) -> BeamStep:
    """Rank the continuations of every running beam (all at the same generated length)."""
    k = state.width
    keep = candidates_per_beam(k, len(eos_ids))
    candidates = []
    for beam in beams:
        entry, cum = logprobs[beam.seq_id], state.scores.get(beam.seq_id, 0.0)
        candidates += [(cum + lp, i, beam, tid) for i, (tid, lp) in enumerate(zip(entry.top_ids, entry.top_logprobs))]
    candidates.sort(key=lambda c: (-c[0], c[2].seq_id, c[1]))
    candidates = candidates[:keep]
    gen_len = beams[0].num_output_tokens + 1  # after this step's token
    at_limit = gen_len >= max_tokens or beams[0].num_tokens + 1 >= max_model_len
    ends = [at_limit or tid in eos_ids for _, _, _, tid in candidates]

    running = [(beam, tid, score) for (score, _, beam, tid), end in zip(candidates, ends) if not end][:k]
    # Only the best k candidates may become hypotheses (the rest are backups to keep k running).
    if state.improvable and not (state.early_stopping is True and len(state.hypotheses) == k):
        for (score, _, beam, tid), end in zip(candidates[:k], ends[:k]):
            if end:
                state.hypotheses.append(Hypothesis(score / gen_len ** state.length_penalty,
                                                   beam.output_token_ids + [tid], score, tid in eos_ids))
        state.hypotheses.sort(key=lambda h: -h.score)
        del state.hypotheses[k:]
    if running and len(state.hypotheses) == k:
        best_length = gen_len
        if state.early_stopping == "never" and state.length_penalty > 0.0:
            best_length = max_tokens
        best_possible = running[0][2] / best_length ** state.length_penalty
        state.improvable = state.improvable and best_possible > state.hypotheses[-1].score
    full = state.early_stopping is True and len(state.hypotheses) == k
    state.done = not state.improvable or full or all(ends)
    return BeamStep([] if state.done else running, state.done)


def advance_beams(scheduler, group: SequenceGroup, eos_token_ids: frozenset[int], max_model_len: int) -> int:
    """Once every running beam of `group` has its candidates, take one beam-search step: beams
    chosen twice or more fork, beams chosen by none are freed at once. Returns the tokens added."""
    beams = group.seqs
    pending = group.pending_beam_logprobs
    if any(b.seq_id not in pending for b in beams):
        return 0  # a preempted beam is still catching up
    p, state = group.params, group.beam
    eos = frozenset() if p.ignore_eos else eos_token_ids
    step = beam_step(state, beams, pending, eos, p.max_tokens, max_model_len)
    pending.clear()
    chosen: dict[int, list[tuple[int, float]]] = {}
    for parent, token, score in step.continuations:
        chosen.setdefault(parent.seq_id, []).append((token, score))
    survivors, scores = [], {}
    for parent in beams:
        picks = chosen.get(parent.seq_id)
        if not picks:
            scheduler.finish(parent, SequenceStatus.FINISHED_ABORTED)  # dropped: its blocks come back now
            continue
        children = [scheduler.spawn(parent) for _ in picks[1:]]  # before the parent moves on
        for seq, (token, score) in zip([parent] + children, picks):
            seq.token_ids.append(token)
            survivors.append(seq)
            scores[seq.seq_id] = score
    state.scores = scores
    group.seqs = survivors
    if state.done:
        group.first.finish_time = time.monotonic()
    return len(survivors)
