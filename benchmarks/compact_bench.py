"""Compact 4-bit tiles (Q4_K's scale layout: an f16 unit per 8 blocks, an int8 code per block; 288 + 64/g bytes
a block) against the per-block f16 scales they replaced (320 bytes), on every matrix of the target (`native`)
and the draft (`native4`, 65,536-row output), as the engine loads them. The per-block copy is made from the
same weights (unpacked, packed again as 4-bit tiles), and the two are run interleaved, M = 1 and 3 rows
(a decode step and a typical verify pass), medians.

    python benchmarks/compact_bench.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from jllm.model import qlinear as ql
from jllm.model.loader import load_model
from jllm.spec import DRAFT_VOCAB
from jllm.store import resolve


def per_block_copy(lin: ql.QLinear) -> ql.QLinear:
    """The same weights with compact tiles stored as 4-bit tiles with f16 (s, m) per block."""
    kinds = lin.kinds.clone()
    if not (kinds == ql.COMPACT).any():
        return lin
    q, s, m = ql.unpack(lin.data, lin.offsets, lin.kinds, lin.out_features, lin.in_features)
    matrix = ql.PackedMatrix(lin.in_features)
    row_kind = kinds.repeat_interleave(ql.TILE)[:lin.out_features]
    r0 = 0
    while r0 < lin.out_features:                      # runs of rows of one kind, compact ones as 4-bit
        r1 = r0
        while r1 < lin.out_features and row_kind[r1] == row_kind[r0]:
            r1 += 1
        kind = ql.FOUR if int(row_kind[r0]) == ql.COMPACT else int(row_kind[r0])
        matrix.add(q[r0:r1], s[r0:r1], m[r0:r1], kind)
        r0 = r1
    data, offsets, kinds = matrix.pack()
    return ql.QLinear(data, offsets, kinds, lin.out_features, lin.in_features, lin.bias)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    draft = load_model(resolve("qwen2.5-coder-0.5b"), "cpu", "native4", output_rows=DRAFT_VOCAB)
    target = load_model(resolve("qwen2.5-coder-1.5b"), "cpu", None)
    if target.kernels is None:
        raise SystemExit("native kernels unavailable on this machine")
    sets = {}
    for name, model in (("draft", draft), ("target", target)):
        mats = model.w.matrices()
        sets[f"{name} compact"] = mats
        sets[f"{name} per-block"] = [per_block_copy(m) for m in mats]
    for k, ms in sets.items():
        print(f"{k:<18} {sum(m.nbytes() for m in ms) / 1e6:8.1f} MB")
    xs: dict = {}

    def run(ms, M):
        t = time.perf_counter()
        for m in ms:
            m(xs.setdefault((M, m.in_features), torch.randn(M, m.in_features)))
        return time.perf_counter() - t

    print(f"{'M':>2} " + " ".join(f"{k:>17}" for k in sets) + f"   (ms, medians of {a.rounds})")
    for M in (1, 3):
        times = {k: [] for k in sets}
        for _ in range(a.rounds):
            for k, ms in sets.items():
                times[k].append(run(ms, M))
        print(f"{M:>2} " + " ".join(f"{statistics.median(v) * 1000:>17.2f}" for v in times.values()), flush=True)


if __name__ == "__main__":
    main()
