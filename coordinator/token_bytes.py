"""The bytes a token stands for, as OpenAI's chat logprobs give them (`bytes`): a character split
over several tokens (an emoji is often 2-4 tokens of a byte-level vocabulary) decodes to U+FFFD
token by token, but its tokens' bytes put together rebuild it.

Byte-level BPE vocabularies (GPT-2's scheme: Llama 3, Qwen, SmolLM2) spell each byte as one
printable character, mapped back here; SentencePiece vocabularies with byte fallback (Llama 2,
Mistral) name a raw byte `<0xNN>` and a space `▁`. Special tokens, and tokenizers of neither
kind, give the bytes of their decoded text.
"""

from __future__ import annotations

import json
import re
import weakref

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """The character that stands for each byte in a byte-level vocabulary, inverted: printable
    Latin-1 bytes stand for themselves, the other 68 for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_decoder()


class TokenBytes:
    """token id -> its bytes (a list of ints), for one tokenizer; cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.kind = _vocabulary_kind(tokenizer)
        self._cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> list[int]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = list(self._bytes(token_id))
        return found

    def _bytes(self, token_id: int) -> bytes:
        piece = None if token_id in self.special else self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and self.kind == "byte_level":
            if all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
        elif isinstance(piece, str) and self.kind == "sentencepiece":
            match = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode()
        return self.tokenizer.decode([token_id]).encode()


def _vocabulary_kind(tokenizer) -> str:
    """byte_level, sentencepiece, or "" (unknown: decoded text's bytes)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return ""
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    if "ByteLevel" in kinds:
        return "byte_level"
    return "sentencepiece" if "ByteFallback" in kinds else ""


_PER_TOKENIZER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_bytes_of(tokenizer) -> TokenBytes:
    """The TokenBytes of `tokenizer`, one per tokenizer (its cache shared by every request)."""
    found = _PER_TOKENIZER.get(tokenizer)
    if found is None:
        found = _PER_TOKENIZER[tokenizer] = TokenBytes(tokenizer)
    return found
