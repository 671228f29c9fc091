"""The block-quantized matmul kernel alone, weights streamed from memory: gate_up and down of all 28 layers
of the 1.5B (~900 MB, far beyond the caches) for M = 1, 3, 5, 9 activation rows, interleaved, medians
relative to M = 1. Shows how much of a verify pass's extra compute hides under the memory traffic.

    python benchmarks/kernel_stream.py [MODEL]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from jllm.model.loader import load_model
from jllm.store import resolve


def main() -> None:
    model = load_model(resolve(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"), "cpu", None)
    if model.kernels is None:
        raise SystemExit("native kernels unavailable on this machine")
    mats = [m for L in model.w.layers for m in (L.gate_up, L.down)]
    xs = {}

    def run(M: int) -> float:
        t = time.perf_counter()
        for m in mats:
            x = xs.setdefault((M, m.in_features), torch.randn(M, m.in_features))
            m(x)
        return time.perf_counter() - t

    times = {M: [] for M in (1, 3, 5, 9)}
    for _ in range(15):
        for M in times:
            times[M].append(run(M))
    base = statistics.median(times[1])
    print(f"M = 1: {base * 1000:.1f} ms; " + ", ".join(f"M = {M}: {statistics.median(v) / base:.2f}x"
                                                     for M, v in times.items()))


if __name__ == "__main__":
    main()
