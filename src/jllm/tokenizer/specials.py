"""Finding special tokens in text: the first step of encoding, before any model sees the text.

A special token (`<|im_start|>`, `<end_of_turn>`, gemma's "\\n\\n") is matched only as its whole string and
becomes its own id; the text between matches goes to the tokenizer model. Matches are leftmost, then longest.
(llama.cpp searches for the longest special token everywhere first, then the next longest; the two rules give
different answers only when two special texts overlap in the input, e.g. "ab" and "bc" in "abc".)

The pattern is one regex built from a trie of the texts, so that gemma's 6,400 specials (most of them
`<unusedN>`) cost one step per character instead of one try per special token.
"""

from __future__ import annotations

import re


def _trie_pattern(texts: list[str]) -> str:
    trie: dict = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = True  # a text ends here

    def pattern(node: dict) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch != ""]
        if not branches:
            return ""
        if len(branches) == 1 and "" not in node:
            return branches[0]
        group = "(?:" + "|".join(branches) + ")"
        return group + "?" if "" in node else group  # "?" is greedy: the longer text is tried first

    return pattern(trie)


class SpecialSplitter:
    """split(text) -> pieces, each a str of plain text or an int token id, in order."""

    def __init__(self, specials: dict[str, int]):
        self.ids = dict(specials)
        texts = [t for t in self.ids if t]
        self._regex = re.compile(_trie_pattern(texts)) if texts else None

    def split(self, text: str) -> list[str | int]:
        if self._regex is None:
            return [text] if text else []
        pieces: list[str | int] = []
        start = 0
        for m in self._regex.finditer(text):
            if m.start() > start:
                pieces.append(text[start:m.start()])
            pieces.append(self.ids[m.group()])
            start = m.end()
        if start < len(text):
            pieces.append(text[start:])
        return pieces
