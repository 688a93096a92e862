"""Structured outputs (constrained decoding) with llguidance: grammars compiled off the engine
loop and cached by their text, one matcher per sequence, and each step's allowed-token bitmasks
in one batched call.

Where the work runs: a grammar compiles when its request is admitted, in the input processor
(a server's input thread, or the caller's thread offline), so a bad schema is a ValueError there
and never reaches a step. The engine loop only copies a compiled matcher per sequence, computes
masks (~50 us per sequence at a 128k vocabulary, llguidance's figure; the batch in one call that
releases the GIL) and advances matchers by the sampled tokens (a few us each).

Where the matchers live: in the coordinator, on their sequences, because the coordinator holds
every token. A matcher has consumed exactly its sequence's output tokens, and those survive
everything below the coordinator: recompute and swap preemption keep a sequence's tokens, and a
worker group rebuilt after a fault resumes from them, so no matcher is ever rebuilt. A step that
failed ran no `update_from_output`, so it advanced no matcher; computing a mask changes none.
Samples of n > 1 fork their parent's matcher (a deep copy) when they fork its blocks.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np

from coordinator.reasoning_parsers import reply_starts_inside
from coordinator.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

# Compiled grammars kept, least recently used out first. A JSON schema's matcher holds its lexer's
# states (tens of KB to a few MB); 128 covers the handful of schemas a deployment serves, each
# requested over and over.
GRAMMAR_CACHE_SIZE = 128
_MAX_ERROR_CHARS = 300


class CompiledGrammar:
    """A grammar compiled for one engine's tokenizer: a matcher that never consumes a token, which
    each sequence's matcher is copied from."""

    __slots__ = ("compiler", "template")

    def __init__(self, compiler: GrammarCompiler, template: llguidance.LLMatcher):
        self.compiler, self.template = compiler, template


class SequenceGrammar:
    """One sequence's matcher: the tokens its grammar allows next, advanced by each sampled one.
    `waiting_for`: a reasoning block's end token, while the reply is still inside the block (no
    mask then; the grammar starts after that token)."""

    __slots__ = ("matcher", "num_words", "waiting_for")

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int, waiting_for: int | None = None):
        self.matcher, self.num_words, self.waiting_for = matcher, num_words, waiting_for

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (it has a mask row in the step)."""
        return self.waiting_for is None

    def copy(self) -> SequenceGrammar:
        """A fork's own matcher, in this one's state."""
        return SequenceGrammar(self.matcher.deep_copy(), self.num_words, self.waiting_for)

    def valid_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar allows from here (speculative drafts must
        satisfy it); the matcher does not move. Inside a reasoning block every token is allowed,
        but drafts stop before its end tag: the token after it is the grammar's first, and a
        waiting grammar's step computes no mask for it."""
        if not self.active:
            return tokens[:tokens.index(self.waiting_for)] if self.waiting_for in tokens else tokens
        return tokens[:self.matcher.validate_tokens(tokens)] if tokens else tokens

    def accept(self, token: int) -> bool:
        """Advance by the sampled token. True when the sequence ends here: its grammar is complete
        (nothing but EOS may follow), or the token broke it (it cannot: the mask allowed it; logged)."""
        if not self.active:
            if token == self.waiting_for:
                self.waiting_for = None  # the reasoning is over: the grammar starts now
            return False
        matcher = self.matcher
        if not matcher.consume_token(token):
            log.warning("a structured output's matcher refused sampled token %d; the sequence ends: %s",
                        token, _first_line(matcher.get_error()))
            return True
        return matcher.is_stopped()


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one engine (its tokenizer, vocabulary and EOS ids),
    caching by (kind, text). Thread-safe: the input thread compiles while the loop starts matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int] = frozenset(),
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self._hf_tokenizer = tokenizer
        # The model's vocabulary may be padded past the tokenizer's: masks cover every logit, and
        # the padding's ids (no bytes) are never allowed.
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.num_words = (self.vocab_size + 31) // 32
        self._eos = sorted(eos_token_ids) or None
        self._ll_tokenizer = None
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer: built on first use (~1.3 s for SmolLM2's 49k tokens)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=self._eos)
            return self._ll_tokenizer

    def compile(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `so` (cached), or ValueError naming the field when it is invalid
        or unsupported. Also kept on `so`, for the engine loop's `start`."""
        key = so.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        if compiled is None:
            compiled = CompiledGrammar(self, self._build(so))
            with self._lock:
                self._cache[key] = compiled
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        so._compiled = compiled
        return compiled

    def start(self, so: StructuredOutputsParams, prompt_token_ids: Sequence[int] = ()) -> SequenceGrammar:
        """A new request's matcher: a copy of the grammar `compile` kept on `so` (compiled now if it
        was not, by this engine), waiting out the reasoning block its reply starts inside, if any."""
        compiled = so._compiled
        if not isinstance(compiled, CompiledGrammar) or compiled.compiler is not self:
            compiled = self.compile(so)
        waiting_for = None
        if so.reasoning is not None and reply_starts_inside(prompt_token_ids, *so.reasoning):
            waiting_for = so.reasoning[1]
        return SequenceGrammar(compiled.template.deep_copy(), self.num_words, waiting_for)

    def _build(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        kind = so.kind
        field = so.field_name or f"structured_outputs.{kind}"
        try:
            if kind in ("json", "json_object"):
                schema = so.json if kind == "json" else {"type": "object"}
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, overrides={"whitespace_flexible": False} if so.disable_any_whitespace else None)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(so.regex)
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", so.choice)
            else:  # Lark, or GBNF (converted to Lark)
                grammar = llguidance.grammar_from("grammar", so.grammar)
        except Exception as e:  # a grammar's text that llguidance cannot even read
            raise ValueError(f"{field} is invalid: {_first_line(str(e))}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}.get(kind, kind)
            raise ValueError(f"{field}: invalid or unsupported {what}: {_first_line(matcher.get_error())}")
        return matcher


# One pool of mask threads for every engine of the process (llguidance's default: 80% of the CPUs).
_executor: llguidance.LLExecutor | None = None


def fill_bitmasks(grammars: list[tuple[SequenceGrammar, Sequence[int]]]) -> np.ndarray:
    """The allowed-token bitmasks of each (grammar, drafts): its next token's, then, for a
    speculating sequence, one after each of its drafts (the grammar must accept them all; the
    matcher is left as it was). [rows, words] int32 with the rows in that order, bit j of word w
    set when token 32w + j is allowed. Each matcher must appear once."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    plain, drafting, num_rows = [], [], 0  # (llguidance's draft call refuses an empty draft list)
    for grammar, drafts in grammars:
        if drafts:
            drafting.append((grammar.matcher, num_rows, list(drafts)))
        else:
            plain.append((grammar.matcher, num_rows))
        num_rows += 1 + len(drafts)
    words = grammars[0][0].num_words
    masks = np.empty((num_rows, words), dtype=np.int32)
    if plain:
        _executor.unsafe_compute_mask_ptr(plain, masks.ctypes.data, words * 4, num_rows)
    if drafting:
        _executor.unsafe_compute_mask_ptr_with_draft_token(drafting, masks.ctypes.data, words * 4, num_rows)
    return masks


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return line if len(line) <= _MAX_ERROR_CHARS else line[:_MAX_ERROR_CHARS] + "..."
