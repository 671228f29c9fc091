"""Streaming detokenization: token ids in, one at a time; text out, never a broken UTF-8 character.

A token can end in the middle of a character: byte-level BPE splits an emoji over two or three tokens, and a
SentencePiece model spells a rare character as `<0xF0><0x9F><0x9A><0x80>`. The bytes of a character that has not
ended yet are held back until it does; bytes that can never form a character come out as U+FFFD, as in decode().
"""

from __future__ import annotations

import codecs

from jllm.tokenizer.tokenizer import Tokenizer


class StreamDecoder:
    """push(id) -> the text that is now complete; flush() -> whatever was held back, at the end.

    The concatenated output equals `tokenizer.decode(ids, skip_special)` (with `text_start=True`), or that text
    keeping its leading space (`text_start=False`, the default): generated tokens continue a prompt, so a
    SentencePiece "▁word" at their start is a real space, not the one encode() prepends to a text. Except after
    flush(cut=True), which drops an unfinished last character where decode() ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False, text_start: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._first = text_start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self.skip_special and self.tokenizer.is_special(token_id):
            return ""
        data = self.tokenizer.token_bytes(token_id)
        if self._first:
            self._first = False
            if self.tokenizer.strips_leading_space(token_id):
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self, cut: bool = False) -> str:
        """The end of the stream: held-back bytes of an unfinished character become U+FFFD, as in decode().
        cut: a limit ended the stream (a token budget), not the text: the unfinished character's bytes were
        to come in the next tokens, so they are dropped rather than shown as U+FFFD in an answer kept for good."""
        if cut:
            self._utf8.reset()
            return ""
        return self._utf8.decode(b"", final=True)
