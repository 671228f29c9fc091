"""SentencePiece-style BPE (`tokenizer.ggml.model == "llama"`, used by gemma): scored merges with byte fallback.

llama.cpp's SPM tokenizer replaces spaces by "▁" (prepending one when `add_space_prefix`), starts from single
characters and keeps merging the adjacent pair whose concatenation is the vocabulary token with the highest
score, the leftmost pair first on a tie. A symbol left that is not a token becomes its UTF-8 bytes, as `<0xXX>`
tokens.

Written by hand rather than run in `tokenizers`: its BPE model takes merges ranked as a list, and deriving them
(every split of every token into two tokens) costs ~1.3 s in Python plus ~2 s to load for gemma's 262,144
tokens, and ranks cannot express llama.cpp's leftmost-on-tie rule between different pairs of equal score.

Speed comes from words: a merge can only cross the boundary before a "▁" (a non-"▁" character followed by
"▁") through a token that contains such a boundary. Gemma's vocabulary has one (">▁</"). So the text is cut at
every boundary no such token covers, each word is merged on its own (the result is the same: merges in one
word never touch another, and the tie rule keeps their order within a word), and words are memoized.
"""

from __future__ import annotations

import heapq
import re

from jllm.tokenizer.vocab import BYTE, CONTROL, UNKNOWN

SPACE = "▁"  # U+2581, SentencePiece's visible space
_BOUNDARY = re.compile(r"(?<=[^▁])(?=▁)")
_MEMO_LIMIT = 200_000


class SpmEncoder:
    def __init__(self, tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool,
                 unk_id: int | None):
        self.ids = dict(zip(tokens, range(len(tokens))))
        # what merging may produce: control and unknown tokens only come from special-token matching
        self.scores = dict(zip(tokens, scores))
        for i, kind in enumerate(types):
            if kind in (CONTROL, UNKNOWN, BYTE):
                del self.scores[tokens[i]]
        self.byte_ids = [self.ids.get(f"<0x{b:02X}>", unk_id) for b in range(256)]
        self.add_space_prefix = add_space_prefix
        spanning = [t for t in self.scores if t.find(SPACE, 1) > 0 and re.search(r"[^▁]▁", t)]
        overlapping = "|".join(map(re.escape, sorted(spanning, key=len, reverse=True)))
        self._spanning = re.compile(f"(?=({overlapping}))") if spanning else None
        self._memo: dict[str, list[int]] = {}

    def encode(self, fragment: str) -> list[int]:
        """Ids of one fragment of text that holds no special token."""
        text = fragment.replace(" ", SPACE)
        if self.add_space_prefix:
            text = SPACE + text
        out: list[int] = []
        for word in self._words(text):
            ids = self._memo.get(word)
            if ids is None:
                if len(self._memo) >= _MEMO_LIMIT:
                    self._memo.clear()
                ids = self._memo[word] = self._merge(word)
            out += ids
        return out

    def _words(self, text: str) -> list[str]:
        cuts = [m.start() for m in _BOUNDARY.finditer(text)]
        if self._spanning is not None and cuts:
            covered = set()
            for m in self._spanning.finditer(text):
                covered.update(range(m.start() + 1, m.start() + len(m.group(1))))
            cuts = [c for c in cuts if c not in covered]
        bounds = [0, *cuts, len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:])]

    def _merge(self, word: str) -> list[int]:
        """llama.cpp's scored merge over one word: best score first, leftmost on a tie."""
        syms = list(word)  # syms[i]: the text of the symbol starting at character i ("" once merged away)
        nxt = list(range(1, len(syms) + 1))
        nxt[-1] = -1
        prv = list(range(-1, len(syms) - 1))
        heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, length)

        def offer(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                joined = syms[left] + syms[right]
                score = self.scores.get(joined)
                if score is not None:
                    heapq.heappush(heap, (-score, left, right, len(joined)))

        for i in range(len(syms) - 1):
            offer(i, i + 1)
        while heap:
            _, left, right, length = heapq.heappop(heap)
            if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != length:
                continue  # one side has changed since this pair was offered
            syms[left] += syms[right]
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[left] >= 0:
                prv[nxt[left]] = left
            offer(prv[left], left)
            offer(left, nxt[left])

        out: list[int] = []
        for sym in syms:
            if sym:
                token = self.ids.get(sym)
                out += [token] if token is not None else [self.byte_ids[b] for b in sym.encode()]
        return out
