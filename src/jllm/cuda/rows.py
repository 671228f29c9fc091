"""Several rows of x in one matvec program (q4_k.py, q6_k.py, blocks32.py, dp4a.py): a verify pass's k + 1 rows
share each program, so its weights are read and unpacked once for all of them rather than once a row, and the
pass costs about a decode step rather than k + 1 of them.

What keeps a row bitwise its own: each row has its own sums, and its step is the same function of the unpacked
weights and its x as a program of one row computes, in the same order; rows past M load the last row again (in
bounds) and are not stored. So a row's output is the one-row program's whatever rows share its program
(tests/test_cuda_matvec.py, and on the GPU tests/test_cuda.py's verify passes against single steps).

A kernel holds its rows' sums as a tuple of eight (row_sums), carried through its loop, and writes its step once,
for one row: ROW(acc, R, ctx) -> acc, R the row's place in the program (a constexpr; x_row: its row of x), acc
its sums and ctx a tuple of what the rows share (the step's unpacked weights, pointers). each_row runs it for
each of the program's rows, store_rows stores them. A constexpr in ctx stays one only where ROW reads it by
index into a name annotated tl.constexpr (`J: tl.constexpr = ctx[7]`): an unpacking assignment makes it a
tensor.
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
def row_sums(SHAPE: tl.constexpr):
    """The eight rows' sums, zero, float32 of SHAPE (those of rows past ROWS are never added to nor stored)."""
    return (tl.zeros(SHAPE, dtype=tl.float32), tl.zeros(SHAPE, dtype=tl.float32),
            tl.zeros(SHAPE, dtype=tl.float32), tl.zeros(SHAPE, dtype=tl.float32),
            tl.zeros(SHAPE, dtype=tl.float32), tl.zeros(SHAPE, dtype=tl.float32),
            tl.zeros(SHAPE, dtype=tl.float32), tl.zeros(SHAPE, dtype=tl.float32))


@triton.jit
def x_row(m0, R: tl.constexpr, M):
    """The program's row R (rows m0 ..) -> the row of x it reads: past M the last (in bounds; not stored)."""
    if R == 0:
        return m0
    else:
        return tl.minimum(m0 + R, M - 1)


@triton.jit
def x_rows(m0, M):
    """x_row of each of the eight rows, made once (before a kernel's loop)."""
    return (m0, x_row(m0, 1, M), x_row(m0, 2, M), x_row(m0, 3, M), x_row(m0, 4, M), x_row(m0, 5, M),
            x_row(m0, 6, M), x_row(m0, 7, M))


@triton.jit
def each_row(accs, ROW: tl.constexpr, ROWS: tl.constexpr, ctx):
    """acc = ROW(acc, R, ctx) for each of the program's first ROWS rows R (a constexpr, 0 ..), in order, its
    sums acc from the tuple accs, ctx shared; the other rows' sums as they are."""
    a0, a1, a2, a3, a4, a5, a6, a7 = accs
    a0 = ROW(a0, 0, ctx)
    if ROWS > 1:
        a1 = ROW(a1, 1, ctx)
    if ROWS > 2:
        a2 = ROW(a2, 2, ctx)
    if ROWS > 3:
        a3 = ROW(a3, 3, ctx)
    if ROWS > 4:
        a4 = ROW(a4, 4, ctx)
    if ROWS > 5:
        a5 = ROW(a5, 5, ctx)
    if ROWS > 6:
        a6 = ROW(a6, 6, ctx)
    if ROWS > 7:
        a7 = ROW(a7, 7, ctx)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _store_row(acc, R: tl.constexpr, ctx):
    """Row R of the program's (a step of each_row): its sum acc (reduced, with REDUCE), plus the bias, stored at
    y_ptrs + (m0 + R) * Y_STRIDE if m0 + R < M."""
    y_ptrs, live, m0, M, Y_STRIDE, b_ptrs, _, _ = ctx
    HAS_BIAS: tl.constexpr = ctx[6]
    REDUCE: tl.constexpr = ctx[7]
    if REDUCE:                                              # the K-quants' [BN, S, w] sums: words, then steps
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
    else:
        y = acc
    if HAS_BIAS:
        y += tl.load(b_ptrs, mask=live, other=0.0)
    tl.store(y_ptrs + (m0 + R) * Y_STRIDE, y, mask=live & ((live.to(tl.int32) * 0 + m0 + R) < M))
    return acc


@triton.jit
def store_rows(accs, y_ptrs, live, m0, M, Y_STRIDE, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, b_ptrs,
               REDUCE: tl.constexpr):
    """Each of the program's rows m0 + R (R < ROWS, m0 + R < M): its sum accs[R] (reduced, with REDUCE), plus the
    bias, stored at y_ptrs + (m0 + R) * Y_STRIDE."""
    each_row(accs, _store_row, ROWS, (y_ptrs, live, m0, M, Y_STRIDE, b_ptrs, HAS_BIAS, REDUCE))
