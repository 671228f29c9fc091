"""Helper for tests/test_kv_store.py: a process that forks KV-store writers on command, so that each writer
the test kills is a fresh process that did not pay for `import torch`.

Commands on stdin, one per line, each answered by one line on stdout:
    spawn DIR CAP SEED COUNT   fork a writer that saves COUNT entries (0: until killed) -> its pid
    chat DIR CONV SEED ROUNDS  fork a chat writer that takes ROUNDS turns of conversation CONV (0: until
                               killed), each as one `jllm chat -p` process does: read the history, "generate"
                               (sleep), save a KV state, save the history -> its pid
    wait PID                   -> its exit status (negative: killed by that signal)

The tests import `state_for`, `FINGERPRINT` and `user_turn` to check what the writers wrote.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import torch

from jllm.cache.conversations import History
from jllm.cache.store import KVState, KVStore

FINGERPRINT = "writer-test-model"


def state_for(seed: int) -> KVState:
    """A deterministic state whose first token is its seed, so a reader can tell what it must contain."""
    n = 40 + seed % 160
    g = torch.Generator().manual_seed(seed)
    k, v, dk, dv = (torch.randn(4, 2, n, 64, generator=g) for _ in range(4))
    tokens = [seed] + torch.randint(0, 50_000, (n - 1,), generator=g).tolist()
    return KVState(tokens, k, v, dk, dv)


def write(directory: str, cap: int, seed: int, count: int) -> None:
    store = KVStore(directory, max_bytes=cap, max_entries=6, target_fingerprint=FINGERPRINT,
                    draft_fingerprint=FINGERPRINT + "-draft")
    rng = random.Random(seed)
    i = 0
    while count == 0 or i < count:
        store.save(f"w{seed}-{i % 5}", state_for(rng.randrange(1 << 30)))
        i += 1


def user_turn(seed: int, r: int) -> str:
    return f"writer {seed} turn {r}"


def chat(directory: str, conv: str, seed: int, rounds: int) -> None:
    """Turns of one conversation; the reply is padded to 0-40 KB so that history saves take a while."""
    def warn(message: str) -> None:                        # any other warning fails the writer
        if "continued by another process" not in message:
            raise RuntimeError(message)

    store = KVStore(directory, max_bytes=64 << 20, target_fingerprint=FINGERPRINT,
                    draft_fingerprint=FINGERPRINT + "-draft", warn=warn)
    rng = random.Random(seed)
    r = 0
    while rounds == 0 or r < rounds:
        history = History(directory, conv, warn=warn)      # a new process reads the history
        history.messages.append({"role": "user", "content": user_turn(seed, r)})
        time.sleep(rng.uniform(0, 0.02))                   # generating the reply
        reply = f"reply {seed}.{r} " + "x" * rng.randrange(40_000)
        history.messages.append({"role": "assistant", "content": reply})
        store.save(conv, state_for(rng.randrange(1 << 30)))
        history.save()
        r += 1


def dir_bytes(d: Path) -> int:
    """Bytes of the regular files in d now (files vanishing while it counts are skipped)."""
    total = 0
    for e in os.scandir(d):
        try:
            if e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
    return total


def main() -> None:
    torch.set_num_threads(1)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd in ("spawn", "chat"):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    if cmd == "spawn":
                        write(args[0], int(args[1]), int(args[2]), int(args[3]))
                    else:
                        chat(args[0], args[1], int(args[2]), int(args[3]))
                except BaseException as e:                 # noqa: BLE001 - reported through the exit status
                    print(f"writer failed: {e!r}", file=sys.stderr, flush=True)
                    code = 1
                os._exit(code)
            print(pid, flush=True)
        elif cmd == "wait":
            _, status = os.waitpid(int(args[0]), 0)
            print(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status), flush=True)


if __name__ == "__main__":
    main()
