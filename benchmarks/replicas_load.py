"""Bounded load test of two `jllm serve` replicas on one Redis (issue 24): 8 clients x 100 two-turn conversations.

    python3 benchmarks/replicas_load.py [--conversations 100] [--clients 8] [--kv-store-size 1M] [-n 16]

Starts, all under a temp dir and on free loopback ports: a real redis-server (tests/redis_server.py) and two
`jllm serve --kv-store redis://... --kv-store-size SIZE` replicas over a tiny synthetic model
(tests/synthetic.py, as tests/test_kv_replicas.py does), each with its own local cache dir. The cap is small
(default 1 MiB, ~15 of these conversations' entries) so that the shared tier evicts all along.

--clients threads share --conversations conversations (round robin); each client runs its conversations one
after the other with the official `openai` client (greedy, `prompt_cache_key` = the conversation id): turn 1 on
one replica, turn 2 on the other (alternating which one goes first), turn 2 sent once turn 1's entry is in
Redis (at most --wait-s later: it may have been evicted already). Meanwhile a sampler reads the shared tier's
accounting (Redis key `<prefix>total`, see src/jllm/cache/shared.py) every --sample-s seconds.

Checks, per conversation: both replies arrived (none lost), and each turn's reply equals a no-cache engine's
reply for the same messages (no cross-talk); overall: no sample of `total` over the cap, and at the end
`total` equals the bytes of jllm's entries actually in Redis. Prints a table; exit status 1 when a check
fails. Every process started is stopped at the end, also on errors.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests"), str(REPO / "benchmarks")]

from openai import OpenAI  # noqa: E402

from jllm.cli import parse_size  # noqa: E402
from redis_server import jllm_entry_bytes  # noqa: E402
from replicas import start_replicas  # noqa: E402

PREFIX = "jllm:kv:"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--kv-store-size", type=parse_size, default=1 << 20, help="the shared tier's cap (default 1M)")
    p.add_argument("--repeat", type=int, default=10, help="turn 1 repeats a ~25-character phrase this often")
    p.add_argument("-n", "--max-tokens", type=int, default=16)
    p.add_argument("--wait-s", type=float, default=3.0, help="at most this long for turn 1's entry in Redis")
    p.add_argument("--sample-s", type=float, default=0.2, help="sampling period of the shared tier's total")
    a = p.parse_args()
    if shutil.which("redis-server") is None:
        print("needs redis-server (Debian: apt-get install redis-server)", file=sys.stderr)
        return 2
    cap = a.kv_store_size

    with ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="jllm-replicas-load-")))
        from jllm.engine import Engine
        from jllm.sampling import SamplingParams

        reps = start_replicas(stack, d, ["-c", "1024", "-t", "1", "--kv-store-size", str(cap)])
        model, rc, ports = reps.model, reps.rc, reps.ports
        clients = {n: OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
                   for n, port in ports.items()}

        # the sampler: the shared tier's own accounting, every --sample-s seconds while the load runs
        samples, done = [], threading.Event()

        def sample():
            while not done.is_set():
                try:
                    samples.append(int(rc.get(f"{PREFIX}total") or 0))
                except Exception as e:           # noqa: BLE001 - a failed sample is reported, not fatal
                    samples.append(-1)
                    print(f"sample failed: {e}", file=sys.stderr)
                done.wait(a.sample_s)

        lock, latencies, errors = threading.Lock(), [], []

        def turn(replica, msgs, conv):
            t0 = time.perf_counter()
            r = clients[replica].chat.completions.create(
                model="tiny", messages=msgs, max_tokens=a.max_tokens, temperature=0,
                extra_body={"prompt_cache_key": conv})
            with lock:
                latencies.append(time.perf_counter() - t0)
            text = r.choices[0].message.content
            if text is None:
                raise RuntimeError("no content")
            return text, r.usage

        def client(k):
            out = []
            for j, i in enumerate(range(k, a.conversations, a.clients)):
                conv = f"load-{i}"
                first, second = ("A", "B") if (k + j) % 2 == 0 else ("B", "A")
                turn1 = [{"role": "user", "content": f"client {k} asks question {i} " * a.repeat}]
                rec = dict(conv=conv, first=first, turn1=turn1, text1=None, turn2=None, text2=None, usage2=None,
                           waited_out=False)
                out.append(rec)
                try:
                    rec["text1"], _ = turn(first, turn1, conv)
                    deadline = time.monotonic() + a.wait_s    # turn 2 once turn 1's state is in Redis (or gone)
                    while not rc.exists(f"{PREFIX}e:{conv}") and time.monotonic() < deadline:
                        time.sleep(0.005)
                    rec["waited_out"] = not rc.exists(f"{PREFIX}e:{conv}")
                    rec["turn2"] = turn1 + [{"role": "assistant", "content": rec["text1"]},
                                            {"role": "user", "content": f"and what about replica {i}?"}]
                    rec["text2"], rec["usage2"] = turn(second, rec["turn2"], conv)
                except Exception as e:           # noqa: BLE001 - a lost reply is counted and reported
                    with lock:
                        errors.append(f"{conv}: {type(e).__name__}: {e}")
            return out

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.clients) as pool:
            results = [r for rs in pool.map(client, range(a.clients)) for r in rs]
        wall = time.perf_counter() - t0
        # the last turn 2s' saves are still on the replicas' background threads: sample until total settles
        settle = time.monotonic() + 15
        while time.monotonic() < settle and (any(b"/" in m for m in rc.zrange(f"{PREFIX}lru", 0, -1))
                                             or int(rc.get(f"{PREFIX}total") or 0) != jllm_entry_bytes(rc, PREFIX)):
            time.sleep(a.sample_s)
        done.set()
        sampler.join()
        final_total = int(rc.get(f"{PREFIX}total") or 0)
        final_bytes = jllm_entry_bytes(rc, PREFIX)
        final_entries = sum(1 for _ in rc.scan_iter(f"{PREFIX}e:*", count=1000))

        # the oracle: a no-cache engine in this process, after the load (so it does not take the replicas' CPU)
        ref = Engine(str(model), ctx_size=1024, threads=1)
        expected = lambda msgs: ref.generate(ref.chat_ids(msgs), SamplingParams(max_tokens=a.max_tokens)).text
        lost = same1 = same2 = waited_out = 0
        cached, prompt, mismatches = [], [], []
        for r in results:
            if r["text1"] is None or r["text2"] is None:
                lost += 1
                continue
            waited_out += r["waited_out"]
            ok1 = r["text1"] == expected(r["turn1"])
            ok2 = r["text2"] == expected(r["turn2"])
            same1 += ok1
            same2 += ok2
            if not (ok1 and ok2):
                mismatches.append(r["conv"])
            cached.append(r["usage2"].prompt_tokens_details.cached_tokens)
            prompt.append(r["usage2"].prompt_tokens)
        answered = len(results) - lost
        peak = max(samples) if samples else -1
        over = sum(s > cap for s in samples)

        rows = [
            ("conversations (2 turns each)", f"{len(results)} ({a.clients} clients, replicas A+B)"),
            ("lost (a turn without a reply)", f"{lost}"),
            ("turn 1 identical to no-cache", f"{same1}/{answered}"),
            ("turn 2 identical to no-cache", f"{same2}/{answered}"),
            ("turn 2 with cached_tokens > 0", f"{sum(c > 0 for c in cached)}/{answered}"),
            ("turn 2 cached_tokens mean (of prompt)",
             f"{statistics.mean(cached):.1f} of {statistics.mean(prompt):.1f}" if cached else "-"),
            ("turn 2 cached share", f"{sum(cached) / sum(prompt):.1%}" if prompt else "-"),
            ("turn 1 entry not in Redis within --wait-s", f"{waited_out}"),
            ("shared tier: max sampled total vs cap",
             f"{peak:,} B vs {cap:,} B ({len(samples)} samples, {over} over)"),
            ("shared tier at the end: total / entry bytes / entries",
             f"{final_total:,} B / {final_bytes:,} B / {final_entries}"),
            ("requests/s (both turns, incl. waits)", f"{len(latencies) / wall:.1f} ({len(latencies)} in {wall:.1f} s)"),
            ("latency p50 / p99", f"{pct(latencies, 0.5) * 1e3:.0f} ms / {pct(latencies, 0.99) * 1e3:.0f} ms"
             if latencies else "-"),
        ]
        w = max(len(k) for k, _ in rows)
        v = max(len(x) for _, x in rows)
        print(f"| {'check':<{w}} | {'result':<{v}} |")
        print(f"|{'-' * (w + 2)}|{'-' * (v + 2)}|")
        for k, x in rows:
            print(f"| {k:<{w}} | {x:<{v}} |")
        for e in errors[:10]:
            print(f"lost: {e}", file=sys.stderr)
        if mismatches:
            print(f"differs from no-cache: {', '.join(mismatches[:20])}", file=sys.stderr)
        failed = (lost or mismatches or over or peak < 0 or -1 in samples or final_total != final_bytes
                  or final_total > cap)
        if failed:
            print("FAILED", file=sys.stderr)
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
