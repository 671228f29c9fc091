"""The block-quantized matmul kernel alone: gate_up and down of all 28 layers of the 1.5B (~700 MB, far beyond
the caches) for M = 1, 3, 5, 9 activation rows, against the same multiplies with the weights in cache (layer
0's gate_up and down, 28 times over; 23 MB, in L3). Interleaved, medians of 15.

Shows how much of a verify pass's extra compute hides under the memory traffic: were memory and compute
fully overlapped, M rows from memory would take the larger of one row from memory and M rows in cache; were
they not at all, the sum.

    python benchmarks/kernel_stream.py [MODEL]
"""

from __future__ import annotations

import statistics
import sys

from jllm.model.loader import load_model
from jllm.catalog import resolve
from matrix_sets import timed_pass


def main() -> None:
    model = load_model(resolve(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"), "cpu", None)
    if model.kernels is None:
        raise SystemExit("native kernels unavailable on this machine")
    layers = model.w.layers
    streamed = [m for L in layers for m in (L.gate_up, L.down)]
    cached = [layers[0].gate_up, layers[0].down] * len(layers)
    made: dict = {}

    Ms = (1, 3, 5, 9)
    times = {(where, M): [] for where in ("memory", "cache") for M in Ms}
    for _ in range(15):
        for M in Ms:
            times["memory", M].append(timed_pass(streamed, M, made))
            times["cache", M].append(timed_pass(cached, M, made))
    ms = {key: statistics.median(v) * 1000 for key, v in times.items()}
    macs = sum(m.in_features * m.out_features for m in streamed)
    one = ms["memory", 1]
    print(f"{sum(m.nbytes() for m in streamed) / 1e6:.0f} MB of weights, {macs / 1e9:.2f} G multiply-adds a row")
    print(f"{'M':>3} {'from memory ms':>15} {'x M = 1':>8} {'in cache ms':>12} {'GMAC/s':>7} "
          f"{'overlapped ms':>14} {'serial ms':>10}")
    for M in Ms:
        mem, cache = ms["memory", M], ms["cache", M]
        print(f"{M:>3} {mem:>15.2f} {mem / one:>8.2f} {cache:>12.2f} {M * macs / cache / 1e6:>7.0f} "
              f"{max(one, cache):>14.2f} {one + cache:>10.2f}")


if __name__ == "__main__":
    main()
