"""Helper for tests/test_kv_store.py: a process that forks KV-store writers on command, so that each writer
the test kills is a fresh process that did not pay for `import torch`.

Commands on stdin, one per line, each answered by one line on stdout:
    spawn DIR CAP SEED COUNT   fork a writer that saves COUNT entries (0: until killed) -> its pid
    wait PID                   -> its exit status (negative: killed by that signal)

The tests import `state_for` and `FINGERPRINT` to check what the writers wrote.
"""

from __future__ import annotations

import os
import random
import sys

import torch

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


def main() -> None:
    torch.set_num_threads(1)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "spawn":
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    write(args[0], int(args[1]), int(args[2]), int(args[3]))
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
