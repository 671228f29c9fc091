"""The terminal's lines: an answer streams to stdout while a warning (a cache that cannot be written, a store
that cannot be reached) may come on stderr in the middle of it. Where both go to the same place (a terminal,
or `2>&1`), the warning starts a line of its own instead of being glued to the answer's last word."""

from __future__ import annotations

import os
import sys

_mid_line = False           # the answer's text on stdout does not end with a newline yet


def answer(text: str) -> None:
    """Stream a piece of an answer to stdout (flushed: it is read as it comes)."""
    global _mid_line
    sys.stdout.write(text)
    sys.stdout.flush()
    if text:
        _mid_line = not text.endswith("\n")


def end_answer() -> None:
    global _mid_line
    sys.stdout.write("\n")
    sys.stdout.flush()
    _mid_line = False


def _same_place() -> bool:
    try:
        a, b = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def warn(message: str) -> None:
    """`jllm: warning: message` on stderr, on a line of its own."""
    global _mid_line
    if _mid_line and _same_place():
        sys.stderr.write("\n")
        _mid_line = False
    print(f"jllm: warning: {message}", file=sys.stderr, flush=True)
