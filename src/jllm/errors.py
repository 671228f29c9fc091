"""The one exception type users see: a message that says what was wrong and what to do."""


class JllmError(Exception):
    """A user-facing error. The CLI prints `jllm: <message>` on one line and exits non-zero."""
