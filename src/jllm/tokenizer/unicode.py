"""Text as the tokenizer takes it."""

from __future__ import annotations


def well_formed(text: str) -> str:
    """`text` with each lone surrogate as U+FFFD. Python gives those for bytes that are not UTF-8 (command-line
    arguments and stdin decode them so), and JSON lets a client send one ("\\ud800"); the tokenizer takes
    only well-formed Unicode."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
