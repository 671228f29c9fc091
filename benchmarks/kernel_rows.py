"""The kernel's compute for each activation row, apart from memory: a 256 x 1,536 matrix of each tile kind
(compact 4-bit, 6-bit, 8-bit; ~220-300 KB, in L2) multiplied by M = 1 .. 16 rows on one thread, interleaved
rounds, medians. Prints ns per block of 16 x 32 weights, and per block and row.

A decode step streams ~29 ns of memory per compact block and thread on a 20 GB/s machine, so where M rows
take longer than that here, a verify pass over M rows is bound by compute, not by the weights' stream.

    python benchmarks/kernel_rows.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_qlinear import C, E, S, packed, random_parts  # noqa: E402  (the tests' random tile builder)

from jllm import kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=60, help="calls timed together in a round")
    args = ap.parse_args()
    if kernels.qgemm() is None:
        raise SystemExit(f"native kernels unavailable: {kernels.why_unavailable()}")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows, cols = 256, 1536
    blocks = rows // 16 * cols // 32
    cases = []
    for name, kind in (("compact 4-bit", C), ("6-bit", S), ("8-bit", E)):
        lin = packed(random_parts(g, [(rows, kind)], cols), cols)
        for m in (1, 2, 3, 5, 9, 16):
            cases.append((name, m, lin, torch.randn(m, cols, generator=g)))
    times: dict = {(name, m): [] for name, m, _, _ in cases}
    for _, _, lin, x in cases:
        lin(x)
    for _ in range(args.rounds):
        for name, m, lin, x in cases:
            t = time.perf_counter()
            for _ in range(args.calls):
                lin(x)
            times[(name, m)].append((time.perf_counter() - t) / args.calls)
    print(f"ISA {getattr(kernels.qgemm(), 'isa', 'avx512')}, one thread, {rows} x {cols}, medians of {args.rounds} rounds")
    print(f"{'tiles':>14} {'M':>3} {'ns/block':>9} {'ns/block/row':>13}")
    for (name, m), v in times.items():
        ns = statistics.median(v) * 1e9 / blocks
        print(f"{name:>14} {m:3d} {ns:9.2f} {ns / m:13.2f}")


if __name__ == "__main__":
    main()
