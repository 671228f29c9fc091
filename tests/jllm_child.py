"""Helper for the CLI tests: a process that runs `jllm` commands as forked children, so that each command is
a process of its own (its own exit status, stdin, stdout, stderr, environment and working folder) that did
not pay for `import torch` and the kernels' load (~3-5 s a command on 2 cores).

Requests on stdin, one JSON object a line, each answered by one line on stdout:
    {"argv", "env", "cwd", "stdin", "stdout", "stderr", "timeout"}   start a command (stdin, stdout and
                                     stderr are file paths; past `timeout` seconds it gets SIGALRM) -> its pid
    {"wait": pid}                    -> its exit status (negative: killed by that signal) The child does what
`python -m jllm` does after start-up: sys.exit(main()), with an uncaught exception printed as a traceback.
Its std streams are made as the interpreter made this process's (same encoding and error handler), so bytes
that are not UTF-8 arrive as they would.

This process never runs a torch operation itself: its children inherit no thread pool.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import traceback

from jllm import kernels
from jllm.cli import main as jllm_main


def _stream(fd: int, like, write: bool):
    raw = io.FileIO(fd, "w" if write else "r", closefd=False)
    buffered = io.BufferedWriter(raw) if write else io.BufferedReader(raw)
    return io.TextIOWrapper(buffered, encoding=like.encoding, errors=like.errors,
                            line_buffering=like.line_buffering, write_through=like.write_through)


def _run(req: dict) -> int:
    signal.alarm(int(req["timeout"]))
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, req["stdin"], os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, req["stderr"], os.O_WRONLY | os.O_CREAT)):
        f = os.open(path, flags, 0o600)
        os.dup2(f, fd)
        os.close(f)
    stdin, stdout, stderr = sys.stdin, sys.stdout, sys.stderr
    sys.stdin, sys.stdout, sys.stderr = _stream(0, stdin, False), _stream(1, stdout, True), _stream(2, stderr, True)
    sys.argv = ["jllm", *req["argv"]]
    try:
        code = jllm_main(req["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:                                  # noqa: BLE001 - what the interpreter would print
        traceback.print_exc()
        code = 1
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except BrokenPipeError:
            pass
    return code or 0


def main() -> None:
    kernels.qgemm()                                        # loaded once here (built already by the tests)
    for line in sys.stdin:
        req = json.loads(line)
        if "wait" in req:
            _, status = os.waitpid(req["wait"], 0)
            print(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status), flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run(req)
            finally:
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
