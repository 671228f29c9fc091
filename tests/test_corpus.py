"""The bench corpus (jllm/spec/corpus.py + corpus.json): size, balance, sources, well-formed chats."""

from __future__ import annotations

from collections import Counter

from jllm.spec.corpus import CATEGORIES, load_corpus


def test_at_least_forty_items_with_unique_ids():
    items = load_corpus()
    assert len(items) >= 40
    assert len({it["id"] for it in items}) == len(items)


def test_every_category_present_and_none_over_a_quarter():
    counts = Counter(it["category"] for it in load_corpus())
    assert set(counts) == set(CATEGORIES)
    assert max(counts.values()) <= len(load_corpus()) / 4, counts


def test_every_item_names_its_source():
    for it in load_corpus():
        src = it["source"]
        assert src == "written for jllm" or src.startswith("based on a public-domain text: "), it["id"]


def test_messages_alternate_and_end_with_the_user():
    for it in load_corpus():
        msgs = it["messages"]
        roles = [m["role"] for m in msgs]
        if roles[0] == "system":
            roles = roles[1:]
        assert roles and roles[-1] == "user", it["id"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], it["id"]
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in msgs), it["id"]
        assert set().union(*(m.keys() for m in msgs)) == {"role", "content"}, it["id"]


def test_two_turn_items_hold_an_earlier_answer():
    for it in load_corpus():
        if it["category"] == "two-turn":
            assert [m["role"] for m in it["messages"]] == ["user", "assistant", "user"], it["id"]


def test_passages_come_with_rewriting_and_summarizing_prompts():
    for it in load_corpus():
        if it["category"] in ("rewriting", "summarizing"):
            assert len(it["messages"][-1]["content"].split()) >= 150, it["id"]
