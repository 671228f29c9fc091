"""y = x W^T over a matrix kept on the GPU in its GGUF block type (q4_k.py, q6_k.py, blocks32.py: Q4_0, Q5_0,
Q8_0): one entry point, the type's kernel chosen by the weight's class. Every output row comes from its own
row of x alone."""

from __future__ import annotations

import torch

from jllm.cuda import blocks32, q4_k, q6_k

_KERNELS = {q4_k.Q4KWeight: q4_k.launch, q6_k.Q6KWeight: q6_k.launch, blocks32.Blocks32Weight: blocks32.launch}


def matvec(x: torch.Tensor, w, block_n: int = 16) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) -> y = x W^T [M, N] float32."""
    launch = _KERNELS.get(type(w))
    if launch is None:
        raise TypeError(f"no GPU kernel for {type(w).__name__}")
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], is {list(x.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    launch(x, w, y, block_n)
    return y
