"""The KV store and conversation histories under faults (issue 25), measured; prints one table per fault.

    python3 benchmarks/kv_faults.py [--kills 100] [--rounds 10] [-m MODEL.gguf]

crash loop   --kills SIGKILLs of chat writers (tests/kv_writer_child.py: read the history, save a KV state,
             save the history, as one `jllm chat -p` turn does) at random moments; after each, every KV entry
             must load and the history must read; after the last, one clean turn must leave no temp file.
size cap     15 saves of three growing conversations (5-7.6 MB each) at a 20 MB cap; disk use of the
             directory sampled every 10 ms and at each rename (when the old entry and the new file coexist).
concurrent   2 `jllm chat -p` processes x --rounds turns on one conversation (a tiny synthetic model unless
             -m): exit codes, user turns kept, warnings.
full disk    as root, a 1 MiB tmpfs filled to the last byte holds the cache dir: `jllm chat --json` must print
             its reply and exit 0 (skipped where tmpfs cannot be mounted).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
sys.path[:0] = [str(REPO / "src"), str(TESTS)]

import torch  # noqa: E402

from jllm.cache.conversations import load_messages  # noqa: E402
from jllm.cache.store import KVState, KVStore  # noqa: E402
from jllm.errors import JllmError  # noqa: E402
from kv_writer_child import FINGERPRINT, dir_bytes, state_for  # noqa: E402


class Writers:
    """tests/kv_writer_child.py as a fork server: chat(dir, conv, seed, rounds) -> pid, wait(pid) -> status."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(TESTS / "kv_writer_child.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, cwd=TESTS)

    def ask(self, *words) -> int:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def table(title: str, rows: list[tuple[str, object]]) -> None:
    print(f"\n{title}")
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def temps(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".tmp-")]


def crash_loop(kills: int) -> None:
    w, rng = Writers(), random.Random(25)
    in_kv = in_history = corrupt = warned = unreadable = 0
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for i in range(kills):
            pid = w.ask("chat", d, "c", i, 0)
            time.sleep(rng.uniform(0.02, 0.4))
            os.kill(pid, signal.SIGKILL)
            w.ask("wait", pid)
            left = temps(d)
            in_kv += any(p.name.endswith(".tmp") for p in left)
            in_history += any(p.name.startswith(".tmp-") for p in left)
            try:
                load_messages(d, "c")
            except JllmError:
                unreadable += 1
            warns: list[str] = []
            store = KVStore(d, target_fingerprint=FINGERPRINT, draft_fingerprint=FINGERPRINT + "-draft",
                            warn=warns.append)
            for row in store.entries():
                got = store.load(row["name"], row["tokens"])
                if got is None or got.tokens != state_for(got.tokens[0]).tokens:
                    corrupt += 1
            warned += len(warns)
        status = w.ask("wait", w.ask("chat", d, "c", 10_000, 1))      # one clean turn afterwards
        stray = len(temps(d))
        turns = len(load_messages(d, "c")) // 2
    w.close()
    table(f"crash loop: {kills} SIGKILLs of chat writers", [
        ("kills landing with a KV temp file on disk", in_kv), ("kills landing with a history temp file", in_history),
        ("corrupt KV loads", corrupt), ("store warnings", warned), ("unreadable histories", unreadable), ("turns kept", turns),
        ("clean turn afterwards: exit status", status), ("stray temp files afterwards", stray)])


def size_cap() -> None:
    cap = 20 << 20
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        store = KVStore(d, max_bytes=cap, target_fingerprint="T")
        at_rename, sampled, done, real_replace = [], [], threading.Event(), os.replace

        def replace(src, dst):
            at_rename.append(dir_bytes(d))
            real_replace(src, dst)

        def sample():
            while not done.is_set():
                sampled.append(dir_bytes(d))
                time.sleep(0.01)
        os.replace = replace
        sampler = threading.Thread(target=sample)
        sampler.start()
        g = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        try:
            for i in range(15):
                n = 1300 + 70 * i
                k, v = (torch.randn(4, 2, n, 64, generator=g) for _ in range(2))
                store.save(f"conv{i % 3}", KVState(list(range(n)), k, v))
        finally:
            done.set()
            sampler.join()
            os.replace = real_replace
        seconds = time.perf_counter() - t0
    table("size cap: 15 saves at --cache-size 20M", [
        ("samples every 10 ms", len(sampled)), ("peak sampled", f"{max(sampled) / 2**20:.1f} MiB "
                                                                f"({100 * max(sampled) / cap:.0f} % of the cap)"),
        ("peak at a rename", f"{max(at_rename) / 2**20:.1f} MiB ({100 * max(at_rename) / cap:.0f} % of the cap)"),
        ("time for 15 saves", f"{seconds:.2f} s")])


def jllm(model: str, kv: Path, conv: str, prompt: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jllm", "chat", "-m", model, "--conversation", conv, "--cache-dir",
                           str(kv), "-p", prompt, "-n", "4", "-t", "1", "--json"], env=env, capture_output=True,
                          text=True, timeout=300)


def concurrent(model: str, rounds: int, env: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        kv = Path(tmp) / "kv"
        results: dict[str, list[subprocess.CompletedProcess]] = {"a": [], "b": []}

        def run(who: str) -> None:
            for r in range(rounds):
                results[who].append(jllm(model, kv, "c", f"{who} {r}", env))
        threads = [threading.Thread(target=run, args=(who,)) for who in results]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        procs = results["a"] + results["b"]
        kept = [m["content"] for m in load_messages(kv, "c") if m["role"] == "user"]
        in_order = all([t for t in kept if t.startswith(w)] == [f"{w} {r}" for r in range(rounds)] for w in results)
        errs = "".join(p.stderr for p in procs)
        table(f"concurrent: 2 jllm chat processes x {rounds} rounds on one conversation", [
            ("exit 0", f"{sum(p.returncode == 0 for p in procs)}/{len(procs)}"),
            ("replies printed", f"{sum(bool(p.stdout.strip()) for p in procs)}/{len(procs)}"),
            ("user turns kept", f"{len(kept)}/{2 * rounds}"), ("each process's turns in its order", in_order),
            ("turns merged after the other's (warnings)", errs.count("continued by another process")),
            ("tracebacks", errs.count("Traceback"))])


def full_disk(model: str, env: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mnt = Path(tmp) / "full"
        mnt.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                               capture_output=True).returncode != 0:
            table("full disk", [("skipped", "tmpfs cannot be mounted here (needs root)")])
            return
        try:
            kv = mnt / "kv"
            first = jllm(model, kv, "c", "Turn one", env)
            with open(mnt / "filler", "wb", buffering=0) as f:     # every last byte
                try:
                    while f.write(b"\0" * 512):
                        pass
                except OSError:
                    pass
            p = jllm(model, kv, "c", "Turn six?", env)
            warnings = [ln for ln in p.stderr.splitlines() if ln.startswith("jllm: warning:")]
            reply = json.loads(p.stdout)["text"] if p.stdout.strip() else None
            table("full disk: 0 bytes free on the cache dir's filesystem (tmpfs)", [
                ("first turn (space left): exit", first.returncode), ("full: exit", p.returncode),
                ("full: reply printed", reply is not None), ("full: warning lines", len(warnings)),
                ("full: tracebacks", p.stderr.count("Traceback"))] +
                [(f"  warning {i + 1}", w[:110]) for i, w in enumerate(warnings)])
        finally:
            subprocess.run(["umount", str(mnt)], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("-m", "--model", default=None, help="GGUF for the CLI runs (default: a tiny synthetic qwen2)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from synthetic import write_tiny_model
            model = str(Path(tmp) / "tiny.gguf")
            write_tiny_model(model, "qwen2", intermediate_size=256)
        env = {k: v for k, v in os.environ.items() if not k.startswith("JLLM_")}
        env.update(JLLM_CONVERTED_DIR=str(Path(tmp) / "converted"), PYTHONPATH=str(REPO / "src"))
        crash_loop(a.kills)
        size_cap()
        full_disk(model, env)
        concurrent(model, a.rounds, env)


if __name__ == "__main__":
    main()
