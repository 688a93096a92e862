"""The bytes chat logprobs report per token (OpenAI's `bytes`): put together, a reply's tokens'
bytes are its text, also where a character spans several tokens (whose decoded pieces are each
U+FFFD); for byte-level vocabularies (SmolLM2's) and SentencePiece ones with byte fallback."""

from __future__ import annotations

from coordinator.token_bytes import TokenBytes, token_bytes_of


def test_byte_level_tokens_rebuild_characters_split_over_several(bundled_tokenizer):
    to_bytes = TokenBytes(bundled_tokenizer)
    assert to_bytes.kind == "byte_level"
    text = "Emoji 😀🎉 and naïve café, 日本語.\n\tTabs"
    ids = bundled_tokenizer.encode(text, add_special_tokens=False)
    pieces = [bundled_tokenizer.decode([i]) for i in ids]
    assert "\ufffd" in pieces  # some character does span tokens here
    assert bytes(b for i in ids for b in to_bytes(i)).decode() == text
    assert bytes(to_bytes(bundled_tokenizer.convert_tokens_to_ids("<|im_end|>"))) == b"<|im_end|>"  # special
    assert token_bytes_of(bundled_tokenizer) is token_bytes_of(bundled_tokenizer)  # one cache per tokenizer


def test_sentencepiece_byte_fallback_pieces_are_their_byte():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁hi": 1, "<0xF0>": 2, "<0x9F>": 3, "<0x98>": 4, "<0x80>": 5, "▁": 6}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    to_bytes = TokenBytes(tokenizer)
    assert to_bytes.kind == "sentencepiece"
    assert to_bytes(1) == list(b" hi") and to_bytes(2) == [0xF0]
    assert bytes(b for i in (1, 6, 2, 3, 4, 5) for b in to_bytes(i)).decode() == " hi 😀"
