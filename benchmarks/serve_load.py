"""Bounded load test of `jllm serve` on loopback, over its OpenAI-compatible HTTP API (httpx: it runs where the
openai package is absent, as on the lent GPU; tests/test_server.py drives the server with the openai client):
`python benchmarks/serve_load.py [-m smollm2-135m] [--requests 200] [--concurrency 8] [--max-tokens 16]
[--server-args "-md HEAD.gguf --device cuda"]`.

Starts the server as a subprocess on a free 127.0.0.1 port, sends N chat requests C at a time (each a
distinct prompt, greedy), checks every answer arrived and equals the same prompt's answer run alone (no
mix-ups), then runs one two-turn conversation with prompt_cache_key and compares time to first token.
Prints throughput and p50/p99 latency; stops the server.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
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


def complete(client: httpx.Client, model: str, messages: list[dict], max_tokens: int) -> str:
    r = client.post("/chat/completions", json={"model": model, "messages": messages, "max_tokens": max_tokens,
                                               "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def ttft(client: httpx.Client, model: str, messages: list[dict], key: str, max_tokens: int
         ) -> tuple[float, str, dict]:
    t0 = time.perf_counter()
    first, parts, usage = None, [], {}
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "prompt_cache_key": key}
    with client.stream("POST", "/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in sse_lines(r.iter_bytes()):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"the stream failed: {chunk['error']}")
            text = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if text:
                first = first or time.perf_counter() - t0
                parts.append(text)
            usage = chunk.get("usage") or usage
    return first or (time.perf_counter() - t0), "".join(parts), usage


def sse_lines(chunks):
    """An event stream's lines, split on newlines only (str.splitlines would also split inside a JSON string
    holding U+2028 and the like, which the server leaves unescaped)."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        yield from (line.rstrip(b"\r").decode() for line in lines)
    if buf:
        yield buf.decode()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--server-args", default="", help="more arguments for jllm serve, as one string")
    a = ap.parse_args()
    port = free_port()
    cache = tempfile.mkdtemp(prefix="jllm-serve-bench-")
    proc = subprocess.Popen([sys.executable, "-m", "jllm", "serve", "-m", a.model, "--port", str(port),
                             "--cache-dir", cache, *shlex.split(a.server_args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(port, proc)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=600)
        prompts = [f"Give one fact about the number {i}." for i in range(a.requests)]

        def ask(i: int) -> tuple[int, float, str]:
            t0 = time.perf_counter()
            text = complete(client, a.model, [{"role": "user", "content": prompts[i]}], a.max_tokens)
            return i, time.perf_counter() - t0, text

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
