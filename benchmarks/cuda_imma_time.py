"""dp4a's kernel against its int8 tensor-core twin (jllm.cuda.imma) on the 1.5B's matrix shapes, random blocks:
microseconds a pass of 1..8 rows from CUDA graphs (cuda_matvec.timed: 20 matvecs a replay), at dp4a's default setting
for the shape, and whether the two agree bit for bit.

    python benchmarks/cuda_imma_time.py [--rows 1 2 4 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from gguf import GGMLQuantizationType as T  # noqa: E402

from jllm.cuda import dp4a, imma  # noqa: E402
from cuda_matvec import timed  # noqa: E402
from jllm.cuda.linear import device_weight  # noqa: E402
from test_cuda_matvec import random_blocks  # noqa: E402

SHAPES = [("attn_qkv", T.Q4_K, 2048, 1536), ("ffn_gate_up", T.Q4_K, 17920, 1536), ("ffn_down", T.Q4_K, 1536, 8960),
          ("ffn_down (Q6_K)", T.Q6_K, 1536, 8960), ("output (Q6_K)", T.Q6_K, 151936, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    a = ap.parse_args()
    print(f"{'matrix':<18} {'rows':>4} {'dp4a us':>8} {'imma us':>8}  equal")
    for name, kind, n, k in SHAPES:
        w = device_weight(random_blocks(kind, n, k, seed=1), kind, (n, k), torch.device("cuda"))
        bn, sb, split = dp4a.setting(w)
        for m in a.rows:
            x = torch.randn(m, k, device="cuda")
            prep = dp4a.prepare(x, [w])
            shape = (split, m, n) if split > 1 else (m, n)
            y1, y2 = torch.empty(shape, device="cuda"), torch.empty(shape, device="cuda")
            t1 = timed(lambda: dp4a.launch(x, w, y1, bn, None, sb, split, prep=prep), 200) * 1e6
            if imma.fits(m, bn, sb):
                t2 = timed(lambda: imma.launch(x, w, y2, bn, None, sb, split, prep=prep), 200) * 1e6
                same = torch.equal(y1, y2)
                print(f"{name:<18} {m:>4} {t1:>8.1f} {t2:>8.1f}  {same}")
            else:
                print(f"{name:<18} {m:>4} {t1:>8.1f} {'-':>8}")


if __name__ == "__main__":
    main()
