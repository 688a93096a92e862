"""Incremental detokenizing: the text each new token adds, never a broken multi-byte character.

Decoding one token alone is wrong for byte-level BPE (a character may span tokens, and
leading spaces depend on the previous token), so we decode a short window ending at the new
token and emit only what it adds beyond the window's known prefix (as vLLM and TGI do).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "skip_special_tokens", "prefix_offset", "read_offset", "text")

    def __init__(self, tokenizer, prompt_len: int, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The window starts a few tokens back so the first output token decodes in context.
        self.prefix_offset = max(prompt_len - 5, 0)
        self.read_offset = prompt_len
        self.text = ""

    def step(self, token_ids: list[int]) -> str:
        """Append what the newest token adds to `self.text`; return that delta."""
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(token_ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(token_ids)
        self.text += delta
        return delta
