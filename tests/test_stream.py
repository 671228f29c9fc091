"""jllm.tokenizer.stream: token-by-token text equals the whole decode, and never holds a broken character."""

from __future__ import annotations

from functools import lru_cache

import pytest

from jllm.gguf.reader import read_gguf
from jllm.tokenizer.bpe import BYTE_CHARS
from jllm.tokenizer.stream import StreamDecoder
from jllm.tokenizer.tokenizer import Tokenizer
from test_tokenizer import ALIASES, bpe_metadata, spm_metadata

TEXTS = [
    "Hello, world!",
    "Unicode: café, naïve, Zürich, 東京, 北京市, Привет, مرحبا, 🚀🔥👍🏽",
    "emoji at the end 🧑‍💻",
    "  indented\n\n\tcode();  // 注释 ✓",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 🇫🇷 flags",
]


def stream(decoder: StreamDecoder, ids: list[int]) -> list[str]:
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def test_byte_level_emoji_split_over_tokens_is_held_back():
    tok = Tokenizer.from_metadata(bpe_metadata())
    rocket = "🚀".encode()  # 4 bytes, one byte symbol each in this tiny vocabulary
    ids = [tok.vocab.tokens.index(BYTE_CHARS[b]) for b in rocket]
    assert stream(StreamDecoder(tok), ids) == ["", "", "", "🚀", ""]


def test_spm_byte_fallback_is_held_back_and_spaces_render():
    tok = Tokenizer.from_metadata(spm_metadata())
    ids = tok.encode("a 🚀b", add_bos=False)
    assert [tok.token_text(i) for i in ids][:2] == ["a", "▁"]
    chunks = stream(StreamDecoder(tok), ids)
    assert chunks == ["a", " ", "", "", "", "🚀", "b", ""]


def test_space_prefix_dropped_only_at_text_start():
    tok = Tokenizer.from_metadata(spm_metadata(add_space_prefix=True))
    ids = tok.encode("ab a", add_bos=False)  # "▁ab", "▁a"
    assert "".join(stream(StreamDecoder(tok, text_start=True), ids)) == tok.decode(ids) == "ab a"
    # generated tokens continue a prompt: their first space is real
    assert "".join(stream(StreamDecoder(tok), ids)) == " ab a"


def test_skip_special_and_invalid_bytes():
    tok = Tokenizer.from_metadata(spm_metadata())
    ids = tok.encode("<start_of_turn>ab<end_of_turn>", add_bos=False)
    assert "".join(stream(StreamDecoder(tok, skip_special=True), ids)) == "ab"
    assert "".join(stream(StreamDecoder(tok), ids)) == "<start_of_turn>ab<end_of_turn>"
    # a lone lead byte can never complete: it comes out as U+FFFD at the next character or at flush
    lead = tok.vocab.tokens.index("<0xF0>")
    assert stream(StreamDecoder(tok), [lead]) == ["", "\ufffd"]
    cut = StreamDecoder(tok)                   # a token budget cut the character: its bytes are dropped
    assert [cut.push(lead), cut.flush(cut=True), cut.push(tok.encode("a", add_bos=False)[0])] == ["", "", "a"]
    assert stream(StreamDecoder(tok), [lead, tok.encode("a", add_bos=False)[0]]) == ["", "\ufffda", ""]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


@lru_cache(maxsize=None)
def _tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_metadata(read_gguf(path).metadata)


@pytest.mark.parametrize("alias", ALIASES)
def test_real_models_stream_equals_decode(alias, real_model, reference):
    tok = _tokenizer(str(real_model(alias)))
    ref = reference(alias)
    sequences = [tok.encode(text, add_bos=False) for text in TEXTS]
    partial = [i for ids in sequences for i in ids if not _is_utf8(tok.token_bytes(i))]
    assert partial, "no token in TEXTS ends inside a character: the test would prove nothing"
    sequences += [case["generated_ids"] for case in ref["greedy"]]
    for ids in sequences:
        chunks = stream(StreamDecoder(tok), ids)
        assert "".join(chunks) == tok.decode(ids)
        assert not any("\ufffd" in c for c in chunks), chunks
    for text, ids in zip(TEXTS, sequences):
        assert "".join(stream(StreamDecoder(tok, text_start=True), ids)) == text
