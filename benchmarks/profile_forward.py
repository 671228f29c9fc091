"""Where a forward pass spends its time: linears, attention and everything else, for 1, 5 and 9 new tokens
after a 300-token context (the decode step and speculative verify passes).

    python benchmarks/profile_forward.py [MODEL] [--precision P] [--output-rows N]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from jllm.model import qlinear
from jllm.model.loader import load_model
from jllm.catalog import resolve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b")
    ap.add_argument("--precision", default=None)
    ap.add_argument("--output-rows", type=int, default=None, help="FR-Spec subset, as a draft model runs")
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    model = load_model(resolve(a.model), "cpu", a.precision, output_rows=a.output_rows)
    model.stack = None            # the Python layer loop: the same kernels as the native stack, each call timed
    spent = collections.defaultdict(float)

    def timed(fn, key):
        def wrapper(*args):
            t = time.perf_counter()
            out = fn(*args)
            spent[key] += time.perf_counter() - t
            return out
        return wrapper

    qlinear.QLinear.__call__ = timed(qlinear.QLinear.__call__, "linear")
    if model.kernels is not None:
        kernels = model.kernels

        class Timed:
            def __getattr__(self, name):
                return getattr(kernels, name)

            attention = staticmethod(timed(kernels.attention, "attention"))

        model.kernels = Timed()
    cache = model.new_cache(2048)
    ids = torch.randint(0, 1000, (300,))
    model.forward(ids, cache)
    print(f"{a.model} ({a.precision or 'default precision'}), context 300, {torch.get_num_threads()} threads")
    print(f"{'tokens':>6} {'total ms':>9} {'linears':>8} {'attention':>10} {'other':>7}")
    for T in (1, 5, 9):
        base, total = cache.length, 0.0
        spent.clear()
        for _ in range(a.repeat):
            cache.truncate(base)
            t = time.perf_counter()
            model.forward(ids[:T], cache)
            total += time.perf_counter() - t
        cache.truncate(base)
        ms = {k: v / a.repeat * 1000 for k, v in spent.items()}
        total_ms = total / a.repeat * 1000
        other = total_ms - ms.get("linear", 0) - ms.get("attention", 0)
        print(f"{T:>6} {total_ms:>9.1f} {ms.get('linear', 0):>8.1f} {ms.get('attention', 0):>10.1f} {other:>7.1f}")


if __name__ == "__main__":
    main()
