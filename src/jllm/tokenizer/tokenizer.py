"""The tokenizer of a GGUF model, built from its metadata alone; its ids match llama.cpp's.

Encoding: special tokens are cut out of the text first, as whole strings (specials.py); the text between them
goes through the model's own algorithm, byte-level BPE (bpe.py, run by the `tokenizers` library) or
SentencePiece BPE (spm.py). With parse_special=False only user-defined tokens are cut out: llama.cpp matches
those (qwen's `<tool_call>`, gemma's runs of newlines) even then, and control tokens become plain text.

Decoding is done here, from each token's bytes, so that a stream can hold back a split UTF-8 character
(stream.py). llama.cpp's BPE "clean spaces" pass (" ." -> ".") is not applied: decoded text is exactly the
concatenation of the token pieces, as llama.cpp streams it.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

from jllm.errors import JllmError
from jllm.tokenizer.bpe import BpeEncoder, piece_bytes
from jllm.tokenizer.specials import SpecialSplitter
from jllm.tokenizer.spm import SPACE, SpmEncoder
from jllm.tokenizer.unicode import well_formed
from jllm.tokenizer.vocab import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, Vocab

SUPPORTED_MODELS = ("gpt2", "llama")


class Tokenizer:
    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        if vocab.model == "gpt2":
            self._model = BpeEncoder(vocab.tokens, vocab.merges, vocab.pre)
        elif vocab.model == "llama":
            self._model = SpmEncoder(vocab.tokens, vocab.scores, vocab.types, vocab.add_space_prefix, vocab.unk_id)
        else:
            raise JllmError(f"the GGUF's tokenizer model '{vocab.model}' is not supported "
                            f"(supported: {', '.join(SUPPORTED_MODELS)}); this model cannot be run by jllm")
        tokens, types = vocab.tokens, vocab.types
        self._special = frozenset(i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN))
        user_defined = {tokens[i]: i for i, t in enumerate(types) if t == USER_DEFINED}
        self._split_all = SpecialSplitter({**user_defined, **{tokens[i]: i for i in self._special}})
        self._split_plain = SpecialSplitter(user_defined)
        self._bytes: dict[int, bytes] = {}
        self._fingerprint: str | None = None

    @classmethod
    def from_metadata(cls, metadata: dict) -> "Tokenizer":
        """Build from `jllm.gguf.reader.read_gguf(path).metadata`."""
        if "tokenizer.ggml.tokens" not in metadata:
            raise JllmError("the GGUF has no tokenizer (no tokenizer.ggml.tokens); use a GGUF with its vocabulary")
        return cls(Vocab.from_metadata(metadata))

    # -- ids --------------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.vocab.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def eot_ids(self) -> frozenset[int]:
        """Every id that ends a generation: eos, eot, eom, <|im_end|>, <end_of_turn>, ... (see vocab.py)."""
        return self.vocab.end_ids

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    def is_special(self, token_id: int) -> bool:
        """Control and unknown tokens: markup, not text (skipped by decode(skip_special=True))."""
        return token_id in self._special

    def token_text(self, token_id: int) -> str:
        """The token as written in the vocabulary ("Ġhello", "▁hello", "<0x0A>", "<|im_end|>")."""
        return self.vocab.tokens[token_id]

    # -- encode -----------------------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. add_bos=None uses the GGUF's tokenizer.ggml.add_bos_token; parse_special=False
        reads control-token texts such as "<|im_start|>" as plain text (for untrusted input)."""
        text = well_formed(text)
        ids: list[int] = []
        if add_bos if add_bos is not None else self.vocab.add_bos:
            if self.bos_id is None:
                raise JllmError("a BOS token was asked for, but the GGUF defines no tokenizer.ggml.bos_token_id")
            ids.append(self.bos_id)
        for piece in (self._split_all if parse_special else self._split_plain).split(text):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids += self._model.encode(piece)
        return ids

    # -- decode -----------------------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for: a byte token is one byte, a text piece may be part of a character."""
        piece = self._bytes.get(token_id)
        if piece is None:
            piece = self._bytes[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> bytes:
        text, kind = self.vocab.tokens[token_id], self.vocab.types[token_id]
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):  # written as they are
            return text.encode()
        if kind == BYTE:  # "<0xXX>"
            return bytes([int(text[3:5], 16)])
        if kind != NORMAL:  # unused and undefined tokens stand for nothing (llama.cpp prints nothing)
            return b""
        if self.vocab.model == "gpt2":
            return piece_bytes(text)
        return text.replace(SPACE, " ").encode()

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`. A leading prefix space (SentencePiece add_space_prefix) is dropped, so that
        decode(encode(text)) == text. Bytes that are not valid UTF-8 become U+FFFD."""
        ids = [i for i in ids if not (skip_special and i in self._special)]
        data = b"".join(self.token_bytes(i) for i in ids)
        if self.strips_leading_space(ids[0] if ids else None):
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def strips_leading_space(self, first_id: int | None) -> bool:
        """Whether decoding text that starts with `first_id` drops its first byte, the space that encoding
        prepended (add_space_prefix), as llama.cpp does for a first token that is not BOS."""
        return (self.vocab.add_space_prefix and first_id is not None and first_id != self.bos_id
                and self.token_bytes(first_id).startswith(b" "))

    # -- identity ---------------------------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 over tokens, token types, merges, scores and special ids: equal fingerprints, equal tokenizers."""
        if self._fingerprint is None:
            v = self.vocab
            specials = (v.bos_id, v.eos_id, sorted(v.end_ids), v.add_bos, v.add_space_prefix)
            parts = [v.model, v.pre or "", "\0".join(v.tokens), ",".join(map(str, v.types)), "\0".join(v.merges),
                     ",".join(map(repr, v.scores)), repr(specials)]
            h = hashlib.sha256()
            for part in parts:
                h.update(part.encode() + b"\x01")
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return (f"Tokenizer({self.vocab.model}/{self.vocab.pre}, {self.vocab_size} tokens, "
                f"bos={self.bos_id}, eos={self.eos_id}, end={sorted(self.eot_ids)})")
