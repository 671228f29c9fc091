"""y = x W^T over a matrix kept on the GPU in its GGUF block type (q4_k.py, q6_k.py, blocks32.py: Q4_0, Q5_0,
Q8_0): one entry point, the type's kernel chosen by the weight's class. Every output row comes from its own
row of x alone."""

from __future__ import annotations

import torch

from jllm.cuda import blocks32, q4_k, q6_k

_KERNELS = {q4_k.Q4KWeight: q4_k.launch, q6_k.Q6KWeight: q6_k.launch, blocks32.Blocks32Weight: blocks32.launch}


def setting(w) -> tuple[int, int]:
    """(outputs a program, super-blocks a step) for a matrix: a function of its type and shape alone, never of
    the row count, so that every call over it sums each row in the same order. For Q4_K and Q6_K: 16 or 32
    outputs a program, so that a thread holds two or more rows of weights for each x it loads (jllm.cuda.codes'
    instruction count a weight falls with it); 8 x 4 for long rows (ffn_down), for enough programs and bytes
    in flight. benchmarks/cuda_matvec.py times the others on the GPU."""
    n, k = w.shape
    if isinstance(w, (q4_k.Q4KWeight, q6_k.Q6KWeight)):
        if n >= 65536:
            return 32, 1
        return (8, 4) if k >= 4096 else (16, 2)
    return (32 if n >= 16384 else 16), 1


def matvec(x: torch.Tensor, w, block_n: int | None = None, out: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, sb: int | None = None) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) -> y = x W^T (+ bias) [M, N] float32, written into `out` when given (a
    column range of a wider output: its rows may be further apart). block_n, sb: the kernel's setting, by
    default setting(w) (benchmarks try others)."""
    launch = _KERNELS.get(type(w))
    if launch is None:
        raise TypeError(f"no GPU kernel for {type(w).__name__}")
    n, k = w.shape
    default_n, default_sb = setting(w)
    block_n, sb = block_n or default_n, sb or default_sb
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], is {list(x.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device) if out is None else out
    if y.shape != (x.shape[0], n) or y.stride(1) != 1 or y.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{x.shape[0]}, {n}] with unit column stride")
    launch(x, w, y, block_n, bias, sb)
    return y
