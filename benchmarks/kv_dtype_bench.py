"""Decode step time with the KV cache in f32 against f16, at several context lengths, for the default pair.
Both caches are filled with the same prompt in one process; single decode steps on each are interleaved,
15 rounds of 4 steps, medians.

    python benchmarks/kv_dtype_bench.py [--contexts 300,1000,4000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from jllm.model.loader import load_model
from jllm.spec import DRAFT_VOCAB
from jllm.catalog import resolve


def step_ms(model, ctx: int) -> dict[torch.dtype, float]:
    prompt = torch.randint(100, 20000, (ctx,), generator=torch.Generator().manual_seed(ctx))
    caches = {}
    for dtype in (torch.float32, torch.float16):
        cache = model.new_cache(ctx + 64, dtype=dtype)
        for s in range(0, ctx, 512):
            model.forward(prompt[s:s + 512], cache)
        caches[dtype] = cache
    times = {dtype: [] for dtype in caches}
    token = torch.tensor([123])
    for _ in range(15):
        for dtype, cache in caches.items():
            base = cache.length
            t = time.perf_counter()
            for _ in range(4):
                model.forward(token, cache)
            times[dtype].append((time.perf_counter() - t) / 4)
            cache.truncate(base)
    return {dtype: statistics.median(v) * 1000 for dtype, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="300,1000,4000")
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    top = max(contexts) + 64
    models = {"target 1.5B": load_model(resolve("qwen2.5-coder-1.5b"), "cpu", None, max_positions=top),
              "draft 0.5B": load_model(resolve("qwen2.5-coder-0.5b"), "cpu", "native4", max_positions=top,
                                       output_rows=DRAFT_VOCAB)}
    print(f"{'model':<12} {'context':>8} {'f32 ms':>8} {'f16 ms':>8} {'f32 / f16':>10}")
    for name, model in models.items():
        for ctx in contexts:
            ms = step_ms(model, ctx)
            f32, f16 = ms[torch.float32], ms[torch.float16]
            print(f"{name:<12} {ctx:>8} {f32:>8.2f} {f16:>8.2f} {f32 / f16:>9.3f}x")


if __name__ == "__main__":
    main()
