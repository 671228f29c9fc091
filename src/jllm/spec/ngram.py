"""Prompt-lookup (n-gram) drafting: propose the tokens that followed the latest earlier occurrence of the
context's suffix.

Rule (`find_ngram`): for n from max_ngram down to min_ngram, take the last n tokens; if they occurred earlier
in the context, take the most recent such occurrence and propose up to k tokens that followed it. The first n
that matches wins, so a longer match is preferred; its length is the proposal's confidence (a 4-gram match
repeats text far more reliably than a 1-gram one).

`propose_ngram` is the pure reference, O(len * max_ngram). `NgramIndex` gives the same answers from an
index kept up to date as tokens are appended, so a proposal costs O(max_ngram^2) whatever the context length.
The proposer sees only accepted tokens (drafts are not appended), so it never needs rolling back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def _check(max_ngram: int, min_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min {min_ngram}, max {max_ngram}")


def find_ngram(tokens: Sequence[int], k: int, max_ngram: int = 4,
               min_ngram: int = 1) -> tuple[list[int], int]:
    """tokens: the context -> (up to k proposed tokens, length of the matched n-gram); ([], 0) if none."""
    _check(max_ngram, min_ngram)
    toks, L = list(tokens), len(tokens)
    if k <= 0:
        return [], 0
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = toks[L - n:]
        for start in range(L - n - 1, -1, -1):          # most recent earlier occurrence first
            if toks[start:start + n] == suffix:
                return toks[start + n:start + n + k], n
    return [], 0


def propose_ngram(tokens: Sequence[int], k: int, max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
    """tokens: the context -> up to k tokens that followed the longest, most recent earlier suffix match."""
    return find_ngram(tokens, k, max_ngram, min_ngram)[0]


class NgramIndex:
    """Incremental prompt lookup over a growing context (prompt, history, accepted output).

    Index: n-gram tuple -> end (exclusive) of its latest occurrence that is not the context's own suffix,
    i.e. every n-gram ending at or before len - 1. An n-gram is indexed one token late, when the token after
    it arrives: so a lookup of the current suffix finds only earlier occurrences, each with a continuation.
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        _check(max_ngram, min_ngram)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self.last_match_len = 0     # confidence of the latest proposal: matched n-gram length, 0 = none

    def reset(self, tokens: Iterable[int] = ()) -> None:
        """Start over on a new context."""
        self.tokens, self._index = [], {}
        self.extend(tokens)

    def extend(self, new: Iterable[int]) -> None:
        toks, index, lo, hi = self.tokens, self._index, self.min_ngram, self.max_ngram
        for tok in new:
            end = len(toks)                             # n-grams ending here become "earlier" now
            for n in range(lo, min(hi, end) + 1):
                index[tuple(toks[end - n:end])] = end
            toks.append(int(tok))

    def append(self, tok: int) -> None:
        self.extend((tok,))

    def propose(self, k: int) -> list[int]:
        """Up to k tokens, equal to propose_ngram(self.tokens, k, max_ngram, min_ngram)."""
        toks, L = self.tokens, len(self.tokens)
        draft, self.last_match_len = [], 0
        if k > 0:
            for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
                end = self._index.get(tuple(toks[L - n:]))
                if end is not None:
                    draft, self.last_match_len = toks[end:end + k], n
                    break
        return draft
