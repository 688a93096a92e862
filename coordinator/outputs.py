"""What a request returns (vLLM's names): one RequestOutput with a CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the model's most likely token at that position
    decoded_token: str


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None  # with logprobs or best_of > n
    # Per generated token: {token id: Logprob} for the sampled token and the top `logprobs`.
    logprobs: list[dict[int, Logprob]] | None = None
    # What this sample added since the previous output of the request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # With prompt_logprobs: None for the first prompt token, then {token id: Logprob} per token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # outputs[0]'s delta (for streaming a request with one sample).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # Set when the engine ended the request with an error (a poison request): a server answers
    # it with INTERNAL.
    error: str | None = None


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam of `LLM.beam_search` (vLLM's fields): `tokens` holds the prompt's and the beam's,
    `text` the beam's alone."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's beams, best first."""

    sequences: list[BeamSearchSequence]
