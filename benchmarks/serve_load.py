"""Bounded load test of `jllm serve` on loopback with the official openai client:
`python benchmarks/serve_load.py [-m smollm2-135m] [--requests 200] [--concurrency 8] [--max-tokens 16]`.

Starts the server as a subprocess on a free 127.0.0.1 port, sends N chat requests C at a time (each a
distinct prompt, greedy), checks every answer arrived and equals the same prompt's answer run alone (no
mix-ups), then runs one two-turn conversation with prompt_cache_key and compares time to first token.
Prints throughput and p50/p99 latency; stops the server.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise SystemExit("server did not become ready")


def ttft(client: OpenAI, model: str, messages: list[dict], key: str, max_tokens: int) -> tuple[float, str, dict]:
    t0 = time.perf_counter()
    first, parts, usage = None, [], {}
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"prompt_cache_key": key})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage.model_dump()
    return first or (time.perf_counter() - t0), "".join(parts), usage


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    port = free_port()
    cache = tempfile.mkdtemp(prefix="jllm-serve-bench-")
    proc = subprocess.Popen([sys.executable, "-m", "jllm", "serve", "-m", a.model, "--port", str(port),
                             "--cache-dir", cache], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(port, proc)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        prompts = [f"Give one fact about the number {i}." for i in range(a.requests)]

        def ask(i: int) -> tuple[int, float, str]:
            t0 = time.perf_counter()
            r = client.chat.completions.create(model=a.model, temperature=0, max_tokens=a.max_tokens,
                                               messages=[{"role": "user", "content": prompts[i]}])
            return i, time.perf_counter() - t0, r.choices[0].message.content

        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.concurrency) as ex:
            results = list(ex.map(ask, range(a.requests)))
        wall = time.perf_counter() - t0
        lat = sorted(r[1] for r in results)
        check = [0, a.requests // 2, a.requests - 1]               # re-ask alone: same answer
        mixups = sum(ask(i)[2] != results[i][2] for i in check)
        p50 = statistics.median(lat)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(f"{a.requests} requests, {a.concurrency} at a time, {a.max_tokens} max tokens, model {a.model}: "
              f"all answered {len(results) == a.requests}, mismatches on re-ask {mixups}/{len(check)}")
        print(f"throughput {a.requests / wall:.2f} req/s over {wall:.1f} s; latency p50 {p50 * 1000:.0f} ms, "
              f"p99 {p99 * 1000:.0f} ms")
        doc = "Here is a passage to discuss. " + " ".join(f"Sentence {i} says something about caches." for i in
                                                            range(60))
        turn1 = [{"role": "user", "content": doc + " Summarize it."}]
        t1, reply, u1 = ttft(client, a.model, turn1, "bench-conv", a.max_tokens)
        turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter, please."}]
        t2, _, u2 = ttft(client, a.model, turn2, "bench-conv", a.max_tokens)
        cached = (u2.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        print(f"two turns: time to first token {t1 * 1000:.0f} ms then {t2 * 1000:.0f} ms; turn 2 prompt "
              f"{u2.get('prompt_tokens')} tokens of which {cached} cached")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"requests": a.requests, "concurrency": a.concurrency, "wall_s": wall,
                           "req_s": a.requests / wall, "p50_ms": p50 * 1000, "p99_ms": p99 * 1000,
                           "mixups": mixups, "ttft_ms": [t1 * 1000, t2 * 1000], "turn2_cached": cached}, f,
                          indent=1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
