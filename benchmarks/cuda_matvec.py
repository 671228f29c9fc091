"""The GPU matvecs over GGUF blocks (jllm.cuda: Q4_K, Q6_K, Q4_0, Q5_0, Q8_0) against a bf16 matmul of the same
matrix, at the Qwen2.5-1.5B target's shapes and the row counts of decode and verify: time per call, and the
bytes a call reads over it (GB/s; the H200 streams ~4.8 TB/s). Random blocks: speed does not depend on the
values. Each setting's product is first checked against the CPU's own dequantization (jllm.gguf.quants): a
setting that sums wrong is printed WRONG and never chosen as a shape's best.

    python benchmarks/cuda_matvec.py                    # on the GPU
    TRITON_INTERPRET=1 python benchmarks/cuda_matvec.py --tiny    # the CPU: that it runs, no figures worth reading
    JLLM_MATVEC_MMA=1 python benchmarks/cuda_matvec.py --rows 1 4 16 --block-n 32 64 128 --sb 1 --split 1 3 6 \
        --short-split --all                                       # the tensor cores' kernels (jllm.cuda.mma)
    JLLM_MATVEC_DP4A=1 python benchmarks/cuda_matvec.py --rows 1 4 8 16 --all     # int8 x and dp4a (jllm.cuda.dp4a)
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from jllm.cuda import dp4a
from jllm.cuda.linear import device_weight
from jllm.cuda.matvec import matvec
from jllm.gguf.quants import dequantize

# (type, N, K): the 1.5B Q4_K_M's matrices, then the 0.5B draft's (Q5_0, Q8_0) and a head's (Q4_0)
SHAPES = {"attn_qkv": (T.Q4_K, 2048, 1536), "attn_qk": (T.Q4_K, 1792, 1536), "attn_v (Q6_K)": (T.Q6_K, 256, 1536),
          "attn_output": (T.Q4_K, 1536, 1536), "ffn_gate_up": (T.Q4_K, 17920, 1536),
          "ffn_down (Q4_K)": (T.Q4_K, 1536, 8960), "ffn_down (Q6_K)": (T.Q6_K, 1536, 8960),
          "output (Q6_K)": (T.Q6_K, 151936, 1536), "0.5B ffn_up (Q5_0)": (T.Q5_0, 4864, 896),
          "0.5B output (Q8_0)": (T.Q8_0, 151936, 896), "head output (Q4_0)": (T.Q4_0, 24576, 1536)}
SCALES = {T.Q4_K: slice(0, 4), T.Q6_K: slice(208, 210)}          # where a block's f16 factors sit (else 0:2)


def timed(fn, reps: int) -> float:
    """Seconds a call: on a GPU from a CUDA graph of 20 calls (no Python launch cost in the figure, as in a
    decode step's graph), else by the host clock."""
    fn()
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(max(1, reps // 20)):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / (max(1, reps // 20) * 20)


def wrong(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> str | None:
    """Why a product is wrong (a relative error past float32 accumulation, or past int8 x's for the dp4a
    kernels: tol; or a row of zeros), else None."""
    scale = want.abs().max().item() or 1.0
    err = (got - want).abs().max().item() / scale
    if not err < tol:                                    # also catches NaN
        return f"max error {err:.2e} of the largest output"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8])
    ap.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--sb", type=int, nargs="+", default=[1, 2, 4], help="super-blocks a step (Q4_K, Q6_K)")
    ap.add_argument("--split", type=int, nargs="+", default=[1], help="shares of a row (Q4_K, Q6_K)")
    ap.add_argument("--stages", type=int, nargs="+", default=[1], help="steps of loads in flight (Q4_K, Q6_K)")
    ap.add_argument("--short-split", action="store_true", help="--split for short rows too (the tensor cores' "
                    "kernels, JLLM_MATVEC_MMA=1, give small matrices few programs)")
    ap.add_argument("--best", help="write each shape's best setting at one row here (JSON, for cuda_tuned.py)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tiny", action="store_true", help="one small shape, 2 reps (the interpreter)")
    ap.add_argument("--all", action="store_true", help="every variant's line, not only each shape's best")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = {f"tiny {t.name}": (t, 32, 512) for t in (T.Q4_K, T.Q6_K, T.Q4_0, T.Q5_0, T.Q8_0)} if a.tiny else SHAPES
    reps = 2 if a.tiny else a.reps
    g = torch.Generator().manual_seed(0)
    best = {}
    print(f"{'matrix':<22} {'N x K':>13} {'rows':>4} {'block_n':>7} {'sb':>3} {'split':>5} {'stages':>6} {'us':>8} {'GB/s':>7} "
          f"{'bf16 us':>8}")
    for name, (kind, n, k) in shapes.items():
        per, size = GGML_QUANT_SIZES[kind]
        cut = SCALES.get(kind, slice(0, 2))
        raw = torch.randint(0, 256, (n * k // per, size), generator=g, dtype=torch.uint8)
        raw[:, cut] = (torch.rand(n * k // per, (cut.stop - cut.start) // 2, generator=g) * 0.01).to(
            torch.float16).view(torch.uint8)
        w = device_weight(raw.reshape(-1), kind, (n, k), torch.device(dev))
        dense = torch.randn(n, k, generator=g).to(dev, torch.bfloat16)
        ref_w = dequantize(raw.reshape(-1).numpy(), kind, (n, k)).to(dev)
        for m in a.rows:
            x = torch.randn(m, k, generator=g).to(dev)
            xb = x.to(torch.bfloat16)
            t_dense = timed(lambda: xb @ dense.T, reps)
            want = (x.double() @ ref_w.double().T).float()
            sbs = a.sb if kind in (T.Q4_K, T.Q6_K) else [1]
            lines = []
            splits = a.split if kind in (T.Q4_K, T.Q6_K) and (k >= 4096 or a.short_split) else [1]   # long rows
            stages = a.stages if kind in (T.Q4_K, T.Q6_K) else [1]
            ints = dp4a.handles(x, w)                          # the dp4a kernels: x's 8 bits in the products
            for bn, sb, sp, st in itertools.product(a.block_n, sbs, splits, stages):
                if ints and bn * sb < 32:                       # dp4a: a thread an output's super-block at least
                    continue
                err = wrong(matvec(x, w, block_n=bn, sb=sb, split=sp, stages=st), want, 3e-2 if ints else 1e-4)
                if err is not None:
                    print(f"{name:<22} {n:>6} x {k:<5} {m:>4} {bn:>7} {sb:>3} {sp:>5} {st:>6} WRONG ({err})")
                    continue
                t = timed(lambda: matvec(x, w, block_n=bn, sb=sb, split=sp, stages=st), reps)
                lines.append((t, f"{name:<22} {n:>6} x {k:<5} {m:>4} {bn:>7} {sb:>3} {sp:>5} {st:>6} "
                                 f"{t * 1e6:>8.1f} {w.nbytes() / t / 1e9:>7.0f} {t_dense * 1e6:>8.1f}", (bn, sb, sp, st)))
            if not lines:
                continue
            for _, line, _ in (sorted(lines) if a.all else [min(lines)]):
                print(line)
            if m == 1:
                best[f"{kind.name} {n}x{k}"] = min(lines)[2]
    if a.best:
        with open(a.best, "w") as f:
            json.dump(best, f, indent=1)


if __name__ == "__main__":
    main()
