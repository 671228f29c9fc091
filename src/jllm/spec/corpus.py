"""The speculative-decoding benchmark corpus (`jllm bench --spec`, issue 3 item 8): chat prompts in corpus.json.

Seven categories, six prompts each: coding, explanation, rewriting (edit a given text), summarizing (a given
passage), translation, math, two-turn (a follow-up after an earlier assistant answer). The passages to
rewrite, summarize or translate are in the prompts, since copying from the context is where n-gram drafting
pays. Every item names its source: "written for jllm", or the public-domain text it quotes.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS_PATH = Path(__file__).with_name("corpus.json")
CATEGORIES = ("coding", "explanation", "rewriting", "summarizing", "translation", "math", "two-turn")


def load_corpus(path: str | Path = CORPUS_PATH) -> list[dict]:
    """-> items {id, category, messages: [{role, content}], source}, in file order."""
    items = json.loads(Path(path).read_text(encoding="utf-8"))["items"]
    return [{k: it[k] for k in ("id", "category", "messages", "source")} for it in items]
