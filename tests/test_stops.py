"""StopMatcher (jllm/stops.py): stop strings over a stream of text pieces."""

from __future__ import annotations

import random

import pytest

from jllm.stops import StopMatcher


def feed(stops, pieces) -> tuple[list[str], StopMatcher]:
    m = StopMatcher(stops)
    return [m.push(p) for p in pieces], m


def test_without_stops_text_passes_through():
    out, m = feed([], ["Hel", "lo", " world"])
    assert out == ["Hel", "lo", " world"] and not m.stopped and m.flush() == ""


def test_text_split_across_pushes_comes_out_whole():
    out, m = feed(["STOP"], ["The qu", "ick ", "brown", " fox"])
    assert "".join(out) + m.flush() == "The quick brown fox"
    assert not m.stopped


def test_stop_inside_one_push_cuts_there_and_later_pushes_give_nothing():
    out, m = feed(["STOP"], ["hello STOP world", "more"])
    assert out == ["hello ", ""]
    assert m.stopped and m.flush() == ""


def test_stop_at_the_very_start():
    out, m = feed(["</s>"], ["</s>tail"])
    assert out == [""] and m.stopped


def test_stop_spanning_pushes():
    out, m = feed(["</s>"], ["abc<", "/", "s>def"])
    assert out == ["abc", "", ""]
    assert m.stopped and m.flush() == ""


def test_partial_prefix_is_held_back_then_released():
    m = StopMatcher(["STOP"])
    assert m.push("abST") == "ab"            # "ST" could begin "STOP"
    assert m.push("O") == ""                 # "STO" still could
    assert m.push("xy") == "STOxy"           # it did not: everything comes out, in order
    assert not m.stopped


def test_held_back_prefix_is_released_by_flush():
    m = StopMatcher(["STOP"])
    assert m.push("the end ST") == "the end "
    assert m.flush() == "ST"
    assert m.flush() == ""


def test_repeated_first_character_does_not_hide_a_stop():
    out, m = feed(["aab"], list("aaab"))
    assert "".join(out) == "a" and m.stopped


def test_multiple_stops_the_earliest_wins():
    out, m = feed(["world", "lo"], ["hello world"])
    assert out == ["hel"] and m.stopped


def test_multiple_stops_the_longest_possible_prefix_is_held():
    m = StopMatcher(["abc", "xbcd"])
    assert m.push("zzxbc") == "zz"           # "xbc" may begin "xbcd"; "bc" alone would not be enough
    assert m.push("d!") == ""
    assert m.stopped


def test_multiple_stops_partial_of_one_completes_another():
    m = StopMatcher(["<|im_end|>", "<|endoftext|>"])
    assert m.push("ok <|") == "ok "
    assert m.push("endoftext|> more") == ""
    assert m.stopped


def test_empty_stop_strings_are_ignored():
    out, m = feed(["", "END"], ["text", " END"])
    assert out == ["text", " "] and m.stopped


def test_flush_without_pending_text_is_empty():
    m = StopMatcher(["STOP"])
    assert m.push("plain") == "plain"
    assert m.flush() == ""


@pytest.mark.parametrize("seed", range(20))
def test_random_splits_match_a_plain_search(seed):
    rng = random.Random(seed)
    stops = ["</s>", "\n\nUser:", "ab"]
    text = "".join(rng.choice(["a", "b", "</", "s>", "<", "\n\n", "User:", "\n", "x", " "]) for _ in range(25))
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    out, m = feed(stops, pieces)
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    if found:
        assert "".join(out) == text[:min(found)] and m.stopped
    else:
        assert "".join(out) + m.flush() == text and not m.stopped
