"""The tile formats against the ones they replaced, on every matrix of the target (`native`) and the draft
(`native4`, 65,536-row output), as the engine loads them: compact 4-bit tiles (Q4_K's scale layout, an f16
unit per 8 blocks and an int8 code per block: 288 + 64/g bytes a block) against 4-bit tiles with f16 (s, m)
per block (320 bytes), and 6-bit tiles for Q6_K (416 + 64/g) against 8-bit ones (576). The old-format copy
is made from the same weights (unpacked, packed again), and the two run interleaved, M = 1 and 3 rows (a
decode step and a typical verify pass), medians.

    python benchmarks/tiles_bench.py [--rounds N]
"""

from __future__ import annotations

import argparse

from jllm.model import qlinear as ql
from jllm.model.loader import load_model
from jllm.spec import DRAFT_VOCAB
from jllm.catalog import resolve
from matrix_sets import interleaved


OLD = {ql.COMPACT: ql.FOUR, ql.SIX: ql.EIGHT}


def old_format_copy(lin: ql.QLinear) -> ql.QLinear:
    """The same weights with compact tiles stored as 4-bit tiles with f16 (s, m) per block, 6-bit as 8-bit."""
    if not any(int(k) in OLD for k in lin.kinds):
        return lin
    q, s, m = ql.unpack(lin.data, lin.offsets, lin.kinds, lin.out_features, lin.in_features)
    matrix = ql.PackedMatrix(lin.in_features)
    row_kind = lin.kinds.repeat_interleave(ql.TILE)[:lin.out_features]
    r0 = 0
    while r0 < lin.out_features:                      # runs of rows of one kind, in their old kind
        r1 = r0
        while r1 < lin.out_features and row_kind[r1] == row_kind[r0]:
            r1 += 1
        kind = OLD.get(int(row_kind[r0]), int(row_kind[r0]))
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
        sets[f"{name} new"] = mats
        sets[f"{name} old"] = [old_format_copy(m) for m in mats]
    for k, ms in sets.items():
        print(f"{k:<12} {sum(m.nbytes() for m in ms) / 1e6:8.1f} MB")
    interleaved(sets, rows=(1, 3), rounds=a.rounds)

if __name__ == "__main__":
    main()
