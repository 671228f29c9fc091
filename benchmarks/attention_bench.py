"""The attention kernel alone (jllm/kernels/attention.cpp), per layer, with the query and kv heads of the
1.5B target (12 and 2, dimension 128) and the 0.5B draft (14 and 2, dimension 64): decode and verify
queries at contexts 500 and 1,000, and a 256-token prefill chunk at context 300. The cache stays in L2/L3
between repeats, so this times the arithmetic, not the memory traffic.

    python benchmarks/attention_bench.py
"""

from __future__ import annotations

import time

import torch

from jllm.kernels import qgemm


def main() -> None:
    k = qgemm()
    if k is None:
        raise SystemExit("native kernels unavailable on this machine")
    print(f"{'heads':<8} {'context':>7} {'queries':>7} {'ms / layer':>10}")
    for H, Hk, D, name in ((12, 2, 128, "target"), (14, 2, 64, "draft")):
        kc, vc = torch.randn(Hk, 1400, D), torch.randn(Hk, 1400, D)
        for ctx, T in ((500, 1), (500, 5), (1000, 5), (300, 256)):
            q = torch.randn(T, H, D)
            k.attention(q, kc, vc, ctx, 0, D ** -0.5)
            n, best = (20 if T < 100 else 2), float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(n):
                    k.attention(q, kc, vc, ctx, 0, D ** -0.5)
                best = min(best, (time.perf_counter() - t) / n)
            print(f"{name:<8} {ctx:>7} {T:>7} {best * 1000:>10.3f}")


if __name__ == "__main__":
    main()
