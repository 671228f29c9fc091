"""`jllm bench`: decode tok/s, prefill tok/s, and the cost of one batched forward over k+1 new tokens
relative to one decode step (k = 1..max_k) — the number speculative decoding lives on. Prints a table.
"""

from __future__ import annotations

import json
import resource
import statistics
import time

import torch

from jllm.errors import JllmError

# A fixed, varied text so prompt token counts are reproducible (repeated to reach the prompt length).
_FILLER = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
    "def add(a, b):\n    return a + b\n"
    "Speculative decoding drafts several tokens cheaply and verifies them in one batched pass. "
)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _prompt(eng, n: int) -> list[int]:
    ids = eng.tokenizer.encode(_FILLER * (n // 20 + 2), add_bos=False)
    return ids[:n]


def measure(eng, prompt_tokens: int = 512, decode_tokens: int = 64, max_k: int = 8, repeats: int = 5) -> dict:
    model, cache = eng.model, eng.cache
    dev = eng.device
    if prompt_tokens + decode_tokens + max_k + 2 > eng.ctx_size:
        raise JllmError(f"bench needs a context of at least {prompt_tokens + decode_tokens + max_k + 2} tokens")
    ids = _prompt(eng, prompt_tokens)

    # prefill: fresh cache, whole prompt, best of 2
    best = float("inf")
    for _ in range(2):
        eng.cached_ids = []
        cache.truncate(0)
        t0 = time.perf_counter()
        logits, _ = eng.prefill(ids)
        best = min(best, time.perf_counter() - t0)
    prefill_tok_s = len(ids) / best

    # decode: greedy single-token steps after the prompt
    tok = int(torch.argmax(logits))
    step_times = []
    for _ in range(decode_tokens):
        t0 = time.perf_counter()
        logits = eng.step(tok)
        step_times.append(time.perf_counter() - t0)
        tok = int(torch.argmax(logits))
    step_s = statistics.median(step_times)

    # batched forward of k+1 tokens at the same position, relative to one decode step
    base = cache.length
    block = torch.tensor(_prompt(eng, max_k + 1), device=dev)
    ratios = {}
    for k in range(0, max_k + 1):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.forward(block[:k + 1], cache)
            times.append(time.perf_counter() - t0)
            cache.truncate(base)
        ratios[k] = statistics.median(times)
    one = ratios[0]
    eng.cached_ids = eng.cached_ids[:base]
    return {
        "model": str(eng.gguf.path.name), "precision": eng.precision, "device": str(dev),
        "threads": torch.get_num_threads(), "load_s": eng.load_ms / 1000.0,
        "decode_tok_s": 1.0 / step_s, "decode_ms": step_s * 1000, "prefill_tok_s": prefill_tok_s,
        "prompt_tokens": len(ids), "forward_ms": {k + 1: v * 1000 for k, v in ratios.items()},
        "verify_ratio": {k: ratios[k] / one for k in range(1, max_k + 1)},
        "weights_mb": eng.model.w.nbytes() / 2**20, "peak_rss_mb": _peak_rss_mb(),
    }


def print_table(r: dict) -> None:
    print(f"model {r['model']}  precision {r['precision']}  device {r['device']}  threads {r['threads']}")
    print(f"{'load s':>10} {'decode tok/s':>13} {'prefill tok/s':>14} {'weights MB':>11} {'peak RSS MB':>12}")
    print(f"{r['load_s']:>10.2f} {r['decode_tok_s']:>13.2f} {r['prefill_tok_s']:>14.1f} "
          f"{r['weights_mb']:>11.0f} {r['peak_rss_mb']:>12.0f}")
    print(f"\n{'k':>3} {'tokens':>7} {'forward ms':>11} {'x decode step':>14}")
    for k, ratio in r["verify_ratio"].items():
        print(f"{k:>3} {k + 1:>7} {r['forward_ms'][k + 1]:>11.2f} {ratio:>14.2f}")


def run_bench(a) -> int:
    from jllm.engine import Engine
    from jllm.store import resolve

    ctx = max(a.ctx_size, a.prompt_tokens + a.decode_tokens + a.max_k + 16)
    eng = Engine(str(resolve(a.model)), device=a.device, precision=a.precision, ctx_size=ctx, threads=a.threads)
    r = measure(eng, a.prompt_tokens, a.decode_tokens, a.max_k, a.repeats)
    print_table(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0
