"""Prompt-lookup drafting (jllm/spec/ngram.py): the pure rule on hand-made sequences, and the incremental
proposer against it on random ones."""

from __future__ import annotations

import random

import pytest

from jllm.spec.ngram import NgramIndex, find_ngram, propose_ngram


def test_no_earlier_occurrence_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4], k=3) == []
    assert propose_ngram([], k=3) == [] and propose_ngram([7], k=3) == []


def test_continuation_of_a_repeated_phrase():
    #        0  1  2  3  4  5  6  7   8  9 10
    toks = [5, 1, 2, 3, 9, 8, 7, 0, 1, 2, 3]
    assert find_ngram(toks, k=3) == ([9, 8, 7], 3)     # suffix [1 2 3] seen at 1..3, then 9 8 7
    assert propose_ngram(toks, k=10) == [9, 8, 7, 0, 1, 2, 3]   # runs up to the end of the context


def test_longest_match_wins_over_a_more_recent_shorter_one():
    # suffix [2 3]: the 2-gram occurs at 0 (then 40); the 1-gram [3] occurs later at 4 (then 50)
    toks = [2, 3, 40, 9, 3, 50, 2, 3]
    assert find_ngram(toks, k=1) == ([40], 2)
    assert find_ngram(toks, k=1, max_ngram=1) == ([50], 1)


def test_most_recent_occurrence_wins():
    toks = [1, 2, 10, 1, 2, 20, 1, 2]
    assert propose_ngram(toks, k=1) == [20]


def test_min_ngram_rejects_short_matches():
    toks = [3, 4, 5, 3]
    assert propose_ngram(toks, k=2) == [4, 5]
    assert find_ngram(toks, k=2, min_ngram=2) == ([], 0)


def test_overlapping_occurrence_in_a_run():
    assert find_ngram([7, 7, 7, 7], k=4) == ([7], 3)   # [7 7 7] at 0..2 is followed by the last 7


def test_k_zero_and_bad_bounds():
    assert propose_ngram([1, 1, 1], k=0) == []
    with pytest.raises(ValueError):
        propose_ngram([1, 2], k=1, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError):
        NgramIndex(max_ngram=3, min_ngram=0)


@pytest.mark.parametrize("max_ngram,min_ngram", [(4, 1), (3, 2), (1, 1), (5, 3)])
def test_incremental_proposer_equals_pure_function(max_ngram, min_ngram):
    rng = random.Random(1234 + max_ngram * 10 + min_ngram)
    for _ in range(30):
        vocab = rng.choice([2, 3, 5, 20])              # small vocabularies give many matches
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        prop = NgramIndex(max_ngram, min_ngram)
        pos = 0
        while pos <= len(seq):
            k = rng.randrange(0, 7)
            want = find_ngram(seq[:pos], k, max_ngram, min_ngram)
            assert prop.propose(k) == want[0], (seq[:pos], k)
            assert prop.last_match_len == want[1]
            step = rng.randrange(1, 4)
            prop.extend(seq[pos:pos + step])
            pos += step


def test_append_and_reset():
    prop = NgramIndex()
    prop.extend([1, 2, 3, 1, 2])
    assert prop.propose(4) == [3, 1, 2] and prop.last_match_len == 2
    assert prop.propose(4) == [3, 1, 2]
    prop.append(9)
    assert prop.propose(4) == [] and prop.last_match_len == 0
    prop.reset([4, 5, 4])
    assert prop.tokens == [4, 5, 4] and prop.propose(2) == [5, 4]


def test_long_context_matches_the_pure_function():
    rng = random.Random(0)
    seq = [rng.randrange(1000) for _ in range(20000)] + [1, 2, 3, 4, 5, 1, 2, 3]
    prop = NgramIndex()
    prop.extend(seq)
    assert prop.propose(3) == propose_ngram(seq, 3) == [4, 5, 1]
    assert prop.last_match_len == 3


def test_proposer_follows_the_context_it_is_given():
    """NgramProposer indexes only what a context adds to the last one, and starts over on another context."""
    from jllm.spec.proposers import NgramProposer

    prop = NgramProposer()
    assert prop.propose([1, 2, 3, 1, 2], 4).tokens == [3, 1, 2]
    p = prop.propose([1, 2, 3, 1, 2, 3], 4)
    assert p.tokens == [1, 2, 3] and p.match == 3 and p.probs is None and p.kind == "ngram"
    assert prop.propose([7, 8, 7], 4).tokens == [8, 7]           # not an extension: a fresh index
    assert prop.index.tokens == [7, 8, 7]
