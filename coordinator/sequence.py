"""A sequence: its tokens, how many of them have KV in the cache, and its block table; a request's
group of sequences; and what a step adds to them (the scheduler's updates for the output processor)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from coordinator.sampling_params import SamplingParams
from workers.step_plan import TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


class Sequence:
    """One generation stream.

    `num_computed_tokens` counts the tokens whose K/V are in the cache; each step the
    scheduler lets it catch up towards `num_tokens` (a prefill chunk, or the one token sampled
    last step). When it reaches `num_tokens`, the step samples the next token.
    """

    __slots__ = ("seq_id", "request_id", "prompt_token_ids", "token_ids", "params", "status",
                 "num_computed_tokens", "block_table", "block_hashes", "num_cached_prompt_tokens",
                 "arrival_time", "first_scheduled_time", "first_token_time", "finish_time",
                 "stop_reason", "num_preemptions", "fork_ids", "priority", "cpu_block_table", "last_token_time",
                 "sample_index", "grammar", "publish_kv")

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # A prefill replica's prefill-only request: its prompt blocks go to the shared store.
        self.publish_kv = False
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Chained hashes of this sequence's full blocks, in order (prefix caching).
        self.block_hashes: list[bytes] = []
        self.num_cached_prompt_tokens = 0
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None  # of its latest token (inter-token latency)
        self.finish_time: float | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Sequence ids of the samples to fork off when the first token is sampled (n/best_of > 1).
        self.fork_ids: list[int] = []
        self.priority = 0  # lower runs first under the priority scheduling policy
        self.cpu_block_table: list[int] = []  # while swapped out: its blocks in the CPU KV store
        self.sample_index = 0  # j of a request's n samples: it draws with seed + j
        # Its structured output's matcher (structured_output.SequenceGrammar), if it has one.
        self.grammar = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")


class SequenceGroup:
    """A request as the scheduler sees it: the sequences of its samples or beams.

    A request starts as one sequence (`first`, the one that computes the prompt). With
    n/best_of > 1 it forks into its samples once the prompt is computed (`first.fork_ids`
    names them in advance); under beam search beams fork and end as the search goes, and
    `beam` holds the search's state. `seqs` lists the live samples or beams, in output order.
    """

    __slots__ = ("request_id", "params", "first", "seqs", "beam", "pending_beam_logprobs")

    def __init__(self, first: Sequence, beam=None):
        self.request_id = first.request_id
        self.params = first.params
        self.first = first
        self.seqs = [first]
        self.beam = beam  # BeamState under beam search
        self.pending_beam_logprobs: dict = {}  # beam seq_id -> this step's TokenLogprobs

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return not self.first.fork_ids and all(s.status.finished for s in self.seqs)


def check_stop(seq: Sequence, token: int, eos_token_ids: frozenset[int], max_model_len: int | None
               ) -> SequenceStatus | None:
    """Whether the token just appended ends `seq`, by its id or by a length limit."""
    p = seq.params
    n_out = seq.num_output_tokens
    if n_out >= p.min_tokens:
        if not p.ignore_eos and token in eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
    if p.max_tokens is not None and n_out >= p.max_tokens:
        return SequenceStatus.FINISHED_LENGTH
    if max_model_len is not None and seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    return None


@dataclass(slots=True)
class NewToken:
    seq: Sequence
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(slots=True)
class GroupUpdate:
    """What one request gained in a step: the tokens appended to its sequences (new forks
    included), and logprobs of prompt tokens. `sampled`: some sequence of it got a token."""

    group: SequenceGroup
    new_tokens: list[NewToken] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]]] = field(default_factory=list)
    sampled: bool = False
