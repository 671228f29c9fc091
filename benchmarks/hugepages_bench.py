"""Weights on huge pages against the same weights on ordinary 4 KiB pages: every matrix of the target and of
the draft (as the engine loads them: target `native`, draft `native4` with its 65,536-row output) run for
M = 1 and M = 5 rows, the two copies interleaved, medians. The engine loads weights onto huge pages
(jllm/model/hugepages.py); the ordinary copy is a plain `clone()`, which glibc places on 4 KiB pages.

    python benchmarks/hugepages_bench.py
"""

from __future__ import annotations

from jllm.model.hugepages import resident_huge_bytes
from jllm.model.loader import load_model
from jllm.model.qlinear import QLinear
from jllm.spec import DRAFT_VOCAB
from jllm.catalog import resolve
from matrix_sets import interleaved


def main() -> None:
    draft = load_model(resolve("qwen2.5-coder-0.5b"), "cpu", "native4", output_rows=DRAFT_VOCAB)
    target = load_model(resolve("qwen2.5-coder-1.5b"), "cpu", None)
    if target.kernels is None:
        raise SystemExit("native kernels unavailable on this machine")
    print(f"on huge pages after loading: {resident_huge_bytes() / 2**20:.0f} MB")

    def ordinary(ms):
        return [QLinear(x.data.clone(), x.offsets, x.kinds, x.out_features, x.in_features) for x in ms]

    sets = {"draft huge": draft.w.matrices(), "draft 4k": ordinary(draft.w.matrices()),
            "target huge": target.w.matrices(), "target 4k": ordinary(target.w.matrices())}
    interleaved(sets, rows=(1, 5))

if __name__ == "__main__":
    main()
