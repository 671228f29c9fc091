"""y = x W^T over a matrix kept on the GPU in its GGUF block type (q4_k.py, q6_k.py, blocks32.py: Q4_0, Q5_0,
Q8_0): one entry point, the type's kernel chosen by the weight's class. Every output row comes from its own
row of x alone.

A long row (ffn_down's 8,960 weights) may be split into shares of its super-blocks, each program summing one
share of one block of outputs, so that a matrix of few outputs still gives the chip enough programs and bytes
in flight; the shares' partial sums are then added in one fixed order (`_add_parts`), so a row's sum is the
same whatever rows share its call."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jllm.cuda import blocks32, dp4a, imma, mma, q4_k, q6_k

_KERNELS = {q4_k.Q4KWeight: q4_k.launch, q6_k.Q6KWeight: q6_k.launch, blocks32.Blocks32Weight: blocks32.launch}
_SPLITS = (q4_k.Q4KWeight, q6_k.Q6KWeight)           # the kernels that take a share of a row


def setting(w) -> tuple[int, int, int, int]:
    """(outputs a program, super-blocks a step, shares of a row, steps of loads in flight) for a matrix: a
    function of its type and shape alone, never of the row count, so that every call over it sums each row in
    the same order. From benchmarks/cuda_matvec.py on the H200 (one row, times from CUDA graphs, each setting's
    products checked first; session 22): 8 outputs x 2 super-blocks a program for the short rows and the
    output; 16 x 1 for gate|up (17,920 outputs); long rows (ffn_down) in shares of 7 super-blocks, for enough
    programs and bytes in flight, at 16 x 2 (Q4_K) and 8 x 2 (Q6_K)."""
    n, k = w.shape
    if isinstance(w, _SPLITS):
        if n >= 65536:
            return 8, 2, 1, 1
        if k < 4096:
            return (16, 1, 1, 1) if n >= 16384 else (8, 2, 1, 1)
        return (16 if isinstance(w, q4_k.Q4KWeight) else 8), 2, max(1, k // 256 // 7), 1
    return (32 if n >= 16384 else 16), 1, 1, 1


@triton.jit
def _add_parts(p_ptr, b_ptr, y_ptr, N, MN, Y_STRIDE, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < N
    y = tl.load(p_ptr + m * N + cols, mask=live, other=0.0)
    for p in tl.static_range(1, SPLIT):                   # share 0, 1, 2, ... in this order, for every row
        y += tl.load(p_ptr + p * MN + m * N + cols, mask=live, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=live, other=0.0)
    tl.store(y_ptr + m * Y_STRIDE + cols, y, mask=live)


def matvec(x: torch.Tensor, w, block_n: int | None = None, out: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, sb: int | None = None, split: int | None = None,
           stages: int | None = None, prep=None) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) -> y = x W^T (+ bias) [M, N] float32, written into `out` when given (a
    column range of a wider output: its rows may be further apart). block_n, sb, split, stages: the kernel's
    setting, by default setting(w) (benchmarks try others). prep: x as jllm.cuda.ready made it, for the
    tensor cores' and the dp4a kernels (made here if needed and not given). A dp4a pass of several rows runs
    on the int8 tensor cores (jllm.cuda.imma: the dp4a kernel's numbers bit for bit)."""
    launch = _KERNELS.get(type(w))
    if launch is None:
        raise TypeError(f"no GPU kernel for {type(w).__name__}")
    n, k = w.shape
    default = setting(w)
    tensor_cores = mma.handles(x, w)          # the tensor cores' kernels (JLLM_MATVEC_MMA=1), their own setting
    ints = dp4a.handles(x, w)                 # the dp4a kernels (JLLM_MATVEC_DP4A=1), theirs
    own = None                                # x made ready for them, if given
    if tensor_cores:
        bn, sp = mma.setting(w)
        launch, default = mma.launch, (bn, 1, sp, 1)
        block_n = max(16, block_n or default[0])                         # 16: tl.dot's least
        own = prep.mma if prep is not None else None
    elif ints:
        launch, default = dp4a.launch, (*dp4a.setting(w), 1)
        own = prep.dp4a if prep is not None else None
    block_n, sb, split, stages = block_n or default[0], sb or default[1], split or default[2], stages or default[3]
    if ints and imma.takes(x.shape[0], block_n, sb):
        launch = imma.launch                  # dp4a's numbers on the int8 tensor cores: a verify pass's rows
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], is {list(x.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device) if out is None else out
    if y.shape != (x.shape[0], n) or y.stride(1) != 1 or y.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{x.shape[0]}, {n}] with unit column stride")
    if not isinstance(w, _SPLITS):
        launch(x, w, y, block_n, bias, sb)
        return y
    more = dict(prep=own) if tensor_cores or ints else {}
    if split == 1:
        launch(x, w, y, block_n, bias, sb, 1, stages, **more)
        return y
    parts = torch.empty(split, x.shape[0], n, dtype=torch.float32, device=x.device)
    launch(x, w, parts, block_n, None, sb, split, stages, **more)
    _add_parts[(x.shape[0], triton.cdiv(n, 1024))](parts, y if bias is None else bias, y, n, x.shape[0] * n,
                                                    y.stride(0), SPLIT=split, BLOCK=1024, HAS_BIAS=bias is not None)
    return y
