"""SamplingParams: how one request's tokens are chosen and when its generation stops."""

from __future__ import annotations

import enum
import json as _json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MAX_BEST_OF = 64
MAX_LOGPROBS = 20


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrained decoding (vLLM's names): exactly one of `json` (a JSON schema, as a dict or its
    text), `regex`, `choice` (the output is one of these strings), `grammar` (Lark, or GBNF) or
    `json_object=True` (any JSON object); `disable_any_whitespace` keeps JSON compact. Checked
    for shape here; the grammar itself is compiled, and refused if invalid or unsupported, when
    the request is admitted (by the input processor)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON only: no whitespace between tokens beyond the one separator form (vLLM's name).
    disable_any_whitespace: bool = False
    # The request field the client set it by, for error messages ("" is structured_outputs.<kind>):
    # an HTTP client that sent response_format is told about response_format.
    field_name: str = field(default="", repr=False, compare=False)
    # A server's reasoning parser (start tag id, end tag id, whether its replies start inside a
    # think block when the prompt holds no tag): a reply that starts inside one thinks freely and
    # the grammar applies after the end tag (reasoning_parsers.reply_starts_inside decides).
    reasoning: tuple[int, int, bool] | None = field(default=None, compare=False)
    # The engine's compiled grammar, kept by the input processor for the engine loop to start
    # matchers from (never pickled or copied: it belongs to one engine's tokenizer).
    _compiled: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        kinds = [name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_KINDS)}; "
                             f"got {', '.join(kinds) or 'none'}")
        kind = kinds[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = _json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object); "
                                 f"got {type(value).__name__}")
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object must be a bool; got {value!r}")
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings; "
                                 f"got {value!r:.80}")
        elif not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string; got {value!r:.80}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool; "
                             f"got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, text, disable_any_whitespace): what a compiled grammar is cached by."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json" and not isinstance(value, str):
            value = _json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = _json.dumps(value)
        elif kind == "json_object":
            value = ""
        return kind, value, self.disable_any_whitespace

    def __getstate__(self) -> dict:
        return {name: getattr(self, name) for name in (*_STRUCTURED_KINDS, "disable_any_whitespace", "field_name")}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._compiled = None


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class RequestOutputKind(enum.IntEnum):
    """When a request's outputs are made (vLLM's names and values). A RequestOutput here holds
    both the whole text so far and what the step added, so CUMULATIVE and DELTA alike make one
    at every step that samples. FINAL_ONLY makes one, once the request has finished: for a caller
    that waits for the whole result (LLM.generate, a non-streaming HTTP or gRPC request), no output
    is built, queued and sent per token."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    """vLLM-compatible sampling parameters. Invalid values raise ValueError naming the field.

    `temperature=0` is greedy decoding. `top_k` <= 0 (or -1) and `top_p=1` disable those filters.
    `max_tokens=None` generates until a stop condition or the model's context limit.

    `n` samples share the prompt's KV blocks (one prefill, then copy-on-write forks); with
    `best_of` > n, best_of are generated and the n with the highest cumulative logprob returned.
    `logprobs=k` returns, per generated token, its logprob and the top k (the raw model
    distribution, before penalties and temperature); `prompt_logprobs=k` the same per prompt token.
    Penalties follow vLLM: presence/frequency over the generated tokens, repetition (divide
    positive logits, multiply negative ones) over prompt and generated tokens.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    beam_width: int = 4
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: only the prompt's last k tokens are used (left truncation); -1: as many as fit
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop or [], "a string or a list of strings")
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids or [], "a list of token ids")
        if self.best_of is None:
            self.best_of = self.n
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias must be a map of token id to bias; got {type(self.logit_bias).__name__}")
            self.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids, "a list of token ids")
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - {*_STRUCTURED_KINDS, "disable_any_whitespace"}
            if unknown:
                raise ValueError(f"structured_outputs has no field {sorted(unknown)[0]!r}; its fields are "
                                 f"{', '.join(_STRUCTURED_KINDS)}, disable_any_whitespace")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
        _check_int("best_of", self.best_of, low=1)
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.best_of > MAX_BEST_OF:
            name = "n" if self.best_of == self.n else "best_of"  # the one the request set
            raise ValueError(f"{name} must be <= {MAX_BEST_OF}; got {self.best_of}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy); got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1]; got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (as many as fit) or an integer >= 1; got {t!r}")
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings; got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        if self.use_beam_search:
            self._validate_beam_search()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "use_beam_search"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool; got {getattr(self, name)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]; got {getattr(self, name)}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2]; got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, low=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {MAX_LOGPROBS}; got {value}")
        for token, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias token id", token, low=0)
            _check_number("logit_bias value", bias)
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100]; got {bias} for token {token}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (leave it unset to allow every token)")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, low=0)
        if not isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = _output_kind(self.output_kind)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams (or a dict of its fields); "
                             f"got {type(self.structured_outputs).__name__}")

    def _validate_beam_search(self) -> None:
        _check_int("beam_width", self.beam_width, low=1)
        if self.beam_width > MAX_BEST_OF:
            raise ValueError(f"beam_width must be <= {MAX_BEST_OF}; got {self.beam_width}")
        if self.n > self.beam_width:
            raise ValueError(f"n ({self.n}) must be <= beam_width ({self.beam_width}) with use_beam_search")
        _check_number("length_penalty", self.length_penalty)
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never'; got {self.early_stopping!r}")
        if self.max_tokens is None:
            raise ValueError("max_tokens must be set with use_beam_search")
        # What beam search here does not combine with yet: refused, never silently ignored.
        for name, off in (("best_of", self.n), ("stop", []), ("logprobs", None), ("min_tokens", 0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("logit_bias", None), ("allowed_token_ids", None), ("structured_outputs", None)):
            if getattr(self, name) != off:
                raise ValueError(f"{name} is not supported with use_beam_search; leave it at {off!r}")

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids in the parameters must exist in the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids or []),
                          ("logit_bias", list(self.logit_bias or {}))):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} must lie in [0, {vocab_size}); got {bad[0]}")

    @property
    def needs_logprobs(self) -> bool:
        """Whether the sampled tokens' logprobs must be computed (asked for, or to rank best_of)."""
        return self.logprobs is not None or self.best_of > self.n

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _as_list(name: str, value, what: str) -> list:
    """`value` (a list, tuple or other sequence) as a list; ValueError naming `name` otherwise."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be {what}; got {type(value).__name__} {value!r}")
    return list(value)


def _output_kind(value) -> RequestOutputKind:
    """A RequestOutputKind from one of its values (0, 1, 2), else ValueError naming the field."""
    if not isinstance(value, bool):
        try:
            return RequestOutputKind(value)
        except (ValueError, TypeError):
            pass
    kinds = ", ".join(f"{k.name} ({k.value})" for k in RequestOutputKind)
    raise ValueError(f"output_kind must be a RequestOutputKind: {kinds}; got {value!r}")


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")


def _check_number(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number; got {value!r}")


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`, for `LLM.beam_search`: the best `beam_width` beams of up to
    `max_tokens` tokens each (transformers' `generate(num_beams=k)` semantics, coordinator/beam_search.py)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def sampling_params(self) -> SamplingParams:
        """The engine's form, which checks every value (ValueError naming the field)."""
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0.0 with beam search (beams are ranked by the model's own "
                             f"logprobs); got {self.temperature!r}")
        _check_int("beam_width", self.beam_width, low=1)
        return SamplingParams(n=self.beam_width, use_beam_search=True,
                              beam_width=self.beam_width, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              length_penalty=self.length_penalty,
                              include_stop_str_in_output=self.include_stop_str_in_output, temperature=0.0)
