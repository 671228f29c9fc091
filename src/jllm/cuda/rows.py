"""Several rows of x in one matvec program (q4_k.py, q6_k.py, blocks32.py): a verify pass's k + 1 rows share
each program, so its weights are read and unpacked once for all of them rather than once a row, and the
pass costs about a decode step rather than k + 1 of them.

What keeps a row bitwise its own: each row has its own sum (acc0 .. acc7, since Triton carries no list of
tensors through a loop), and its step is the same function of the unpacked weights and its x as a program
of one row computes, in the same order; rows past M load the last row again (in bounds) and are not stored. So a row's
output is the one-row program's whatever rows share its program (tests/test_cuda_matvec.py, and on the GPU
tests/test_cuda.py's verify passes against single steps).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

ROWS_MAX = int(os.environ.get("JLLM_MATVEC_ROWS", "8"))     # rows a program, 1..8 (1: a program a row, as
                                                              # before session 26; kept to measure against)
if not 1 <= ROWS_MAX <= 8:
    raise ValueError(f"JLLM_MATVEC_ROWS must be 1..8, is {ROWS_MAX}")


def rows_a_program(m: int) -> int:
    """The ROWS constexpr of a call over m rows (one compiled kernel per value)."""
    return max(1, min(m, ROWS_MAX))


@triton.jit
def _store_row(acc, r: tl.constexpr, y_ptrs, live, m0, M, Y_STRIDE, HAS_BIAS: tl.constexpr, b_ptrs,
               REDUCE: tl.constexpr):
    if REDUCE:                                              # the K-quants' [BN, S, w] sums: words, then steps
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
    else:
        y = acc
    if HAS_BIAS:
        y += tl.load(b_ptrs, mask=live, other=0.0)
    tl.store(y_ptrs + (m0 + r) * Y_STRIDE, y, mask=live & ((live.to(tl.int32) * 0 + m0 + r) < M))


@triton.jit
def store_rows(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, y_ptrs, live, m0, M, Y_STRIDE,
               ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, b_ptrs, REDUCE: tl.constexpr):
    """Each of the program's rows m0 + r (r < ROWS, m0 + r < M): its sum (reduced, with REDUCE), plus the bias,
    stored at y_ptrs + (m0 + r) * Y_STRIDE."""
    _store_row(acc0, 0, y_ptrs, live, m0, M, Y_STRIDE, HAS_BIAS, b_ptrs, REDUCE)
    if ROWS > 1:
        _store_row(acc1, 1, y_ptrs, live, m0, M, Y_STRIDE, HAS_BIAS, b_ptrs, REDUCE)
    if ROWS > 2:
        _store_row(acc2, 2, y_ptrs, live, m0, M, Y_STRIDE, HAS_BIAS, b_ptrs, REDUCE)
    if ROWS > 3:
        _store_row(acc3, 3, y_ptrs, live, m0, M, Y_STRIDE, HAS_BIAS, b_ptrs, REDUCE)
    if ROWS > 4:
        _store_row(acc4, 4, y_ptrs, live, m0, M, Y_STRIDE, HAS_BIAS, b_ptrs, REDUCE)
    if ROWS > 5:
        _store_row(acc5, 5, y_ptrs, live, m0, M, Y_STRIDE, HAS_BIAS, b_ptrs, REDUCE)
    if ROWS > 6:
        _store_row(acc6, 6, y_ptrs, live, m0, M, Y_STRIDE, HAS_BIAS, b_ptrs, REDUCE)
    if ROWS > 7:
        _store_row(acc7, 7, y_ptrs, live, m0, M, Y_STRIDE, HAS_BIAS, b_ptrs, REDUCE)
