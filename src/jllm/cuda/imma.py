"""The dp4a kernels' products (jllm.cuda.dp4a) for passes of 2..16 rows on the tensor cores (int8 `mma`), each
output bitwise the dp4a kernel's: meant to give a verify pass's rows at about one row's cost while a decode step
keeps the dp4a kernel, as fast for one row as the float kernels (BENCHMARKS.md, "Session 33 on the GPU": 610.65
against 617.00 tok/s on the real 1.5B). Not there yet: see the note at the end.

Why this can be exact: speculation needs a verify pass's row to be bitwise the decode step's (so that greedy
output is plain decoding's). The tensor-core kernels of jllm.cuda.mma keep that by serving decode too, and
their one row is 1.33x the CUDA cores' (session 28). Here the split is by row count instead, and exactness
holds because the two kernels compute the same numbers by construction:
- each block of 32 (Q4_K: a sub-block; Q6_K: a group of 16) contributes an integer sum of int8 x codes times
  weight codes, exact in any order: dp4a chains there, one `tl.dot` (int8 in, int32 out) here, started from
  the same integer (MAGIC, or Q6_K's c6);
- every float operation after it is elementwise and the dp4a kernel's, one for one, in its order: per output,
  row and super-block lane, _times and two fmas a sub-block (Q4_K) or two _times, an add and an fma a block of
  32 (Q6_K), super-blocks of a lane one after the other (dp4a's steps of SB super-blocks, taken last first);
- a row's output is the sum of its SB <= 2 lanes (one addition, which commutes), then its shares of the row
  added by jllm.cuda.matvec in one fixed order, as for dp4a.
Both compile with enable_fp_fusion=False and their fmas explicit, so no multiply-add is contracted in one and
not the other. SB = 4 would leave dp4a's four-lane sum to the compiler's reduction order: not taken here.

Layout: a program takes BLOCK_N outputs and all of a pass's rows (x's rows past M reload the last, as
jllm.cuda.rows does, and are not stored); per super-block lane and block of 32, x's 32 codes a row (dp4a's
order: byte f of a sub-block is x[16h + 4i + t] for word 4h + t, byte i, which is exactly where the weight
words' unpacked codes land) times the weights' codes unpacked to [32, BLOCK_N] int8.

Without a GPU (Triton's interpreter in the tests) tl.dot sums int8 in int32 as the GPU's mma does.

Equal to dp4a bit for bit on an H100 too (session 33: tests/test_cuda_imma.py, and benchmarks/cuda_imma_time.py
compares every pass it times), but not yet a gain, so off by default (JLLM_MATVEC_IMMA=1 turns it on): a pass of
4 rows of ffn_gate_up takes 39.9 us against dp4a's 14.9 (BENCHMARKS.md, "Session 33 on the GPU"). By its SASS (`python benchmarks/cuda_sass.py
q4_k_imma --block-n 64 --sb 2`, Triton 3.9, sm_90) the Q4_K kernel is 9.1 instructions a weight for any pass of
up to 16 rows, against dp4a's 1.20 / 2.63 / 4.38 for 1 / 4 / 8 rows (Q6_K: 14.1 against 1.66 / 3.20 / 6.68). Two
things cost it: dp4a's float terms per block of 32 run for all 16 rows of the tile (~2.75 a weight: _times and
two fmas per row, output and sub-block), and the weight codes go to shared memory a byte at a time for the mma's
operand (~4 a weight of shifts, masks, STS and LDS). What would make it pay: x scaled per super-block rather than
per block of 32 (the sub-blocks' integer sums times their 6-bit scales then add up exactly in int32, and the
float terms fall eightfold, in dp4a's kernel and here alike), and the codes handed to the mma as packed words.
Tried offline (session 33): the codes made four at a time by inline PTX (pack=4: one shr and one and a word) cut
the shifts and masks from ~545 to ~165 a step and the loop to 7.6 a weight, but Triton still writes the int8
operand to shared memory a byte at a time (STS 256 a step), with the weights as the A operand (wgmma on sm_90:
7.9) as with x (7.6); that store, not the unpacking, is the wall.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from jllm.cuda import dp4a
from jllm.cuda.codes import ASM
from jllm.cuda.dp4a import _MAGIC, _times
from jllm.cuda.q4_k import Q4KWeight

ROWS = 16                   # a tl.dot's least M, and dp4a's most rows a pass


def enabled() -> bool:
    """JLLM_MATVEC_IMMA: 1 runs dp4a's passes of 2..16 rows here; 0 (the default: see the module's note) keeps them
    on dp4a's kernels."""
    v = os.environ.get("JLLM_MATVEC_IMMA", "0")
    if v not in ("0", "1"):
        raise ValueError(f"JLLM_MATVEC_IMMA={v!r}: 1 or 0")
    return v == "1"


def fits(m: int, block_n: int, sb: int) -> bool:
    """Whether a dp4a pass of m rows at this setting can run here: 2..16 rows, at least 16 outputs a program
    (tl.dot's least), one or two super-blocks a step (see the module's note on SB = 4), and a setting dp4a's
    kernel takes too (block_n x sb >= 32), which the pass's rows must match."""
    return 2 <= m <= ROWS and block_n >= 16 and sb <= 2 and block_n * sb >= 32    # the last: dp4a's own least


def takes(m: int, block_n: int, sb: int) -> bool:
    """Whether matvec runs such a pass here: it fits and JLLM_MATVEC_IMMA turns this path on."""
    return fits(m, block_n, sb) and enabled()


@triton.jit
def _tile(M, N, NB, NB_PART, BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """The program's outputs (live: inside N; nn: clamped in bounds unless EVEN), the rows of x it reads (past M
    the last, not stored), its share of the row and where the share ends, as dp4a's kernels have them."""
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = outs < N
    nn = outs
    if not EVEN:
        nn = tl.minimum(outs, N - 1)
    part = tl.program_id(2)
    return outs, live, nn, tl.minimum(tl.arange(0, 16), M - 1), part, tl.minimum(NB, (part + 1) * NB_PART)


@triton.jit
def _step_q4(acc, xrow_ptr, s4row_ptr, w_ptr, at, d, dmin, sc_ptr, mn_ptr, J: tl.constexpr,
             BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """Sub-block J of one super-block lane (at [BN]: the outputs' super-block index; xrow_ptr [16]: the rows'
    codes of that super-block; s4row_ptr [16]: their (dx, bsx)) into acc [16, BN], as dp4a's _q4_k_row."""
    k = tl.arange(0, 32)
    x = tl.load(xrow_ptr[:, None] + (32 * J + k)[None, :])                          # int8 [16, 32]
    q = tl.load(w_ptr + at[:, None] * 32 + 4 * J + tl.arange(0, 4)[None, :])       # int32 [BN, 4]: words t
    sh = (8 * (tl.arange(0, 4)[None, None, :]) + 4 * tl.arange(0, 2)[:, None, None])  # [2 h, 1, 4 i]
    c = (q[:, None, :, None] >> sh[None, :, :, :]) & 0x0F                             # [BN, 2 h, 4 t, 4 i]
    w = tl.reshape(c, (BLOCK_N, 32)).to(tl.int8)                                     # k = 16h + 4t + i
    s = tl.dot(x, tl.trans(w), out_dtype=tl.int32) + _MAGIC                         # dp4a's chain, [16, BN]
    sc = tl.load(sc_ptr + at * 8 + J).to(tl.float32)
    mn = tl.load(mn_ptr + at * 8 + J).to(tl.float32)
    dsc = d * sc
    ndscm = dsc * -12582912.0
    ndmm = -(dmin * mn)
    dx = tl.load(s4row_ptr + 2 * J)
    bsx = tl.load(s4row_ptr + 2 * J + 1)
    acc = tl.fma(_times(s, dsc[None, :], ndscm[None, :], USE_ASM), dx[:, None], acc)
    return tl.fma(ndmm[None, :], bsx[:, None], acc)


@triton.jit
def _q4_k_imma(xq_ptr, s4_ptr, qs_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, b_ptr, y_ptr, M, N, K, NB, Y_STRIDE,
               NB_PART, P_STRIDE, BLOCK_N: tl.constexpr, SB: tl.constexpr, HAS_BIAS: tl.constexpr,
               USE_ASM: tl.constexpr, EVEN: tl.constexpr):
    """x's codes xq (int8 [M, K], Q4_K's order) and (dx, bsx) s4 [M, K / 32, 2] -> y, dp4a's _q4_k_dp4a's
    numbers (its grid's outputs and shares, all rows in one program)."""
    outs, live, nn, xr, part, end = _tile(M, N, NB, NB_PART, BLOCK_N, EVEN)
    acc0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)    # lane 0: dp4a's c = SB - 1, the step's last super-block
    acc1 = tl.zeros((16, BLOCK_N), dtype=tl.float32)    # lane 1 (SB = 2): the step's first
    for kb in range(0, tl.cdiv(NB_PART, SB)):
        for lane in tl.static_range(SB):
            blk = part * NB_PART + kb * SB + (SB - 1 - lane)
            here = (live & (blk < end)) | EVEN
            if not EVEN:
                blk = tl.minimum(blk, NB - 1)
            at = nn * NB + blk                                                       # [BN]
            d = tl.where(here, tl.load(d_ptr + at).to(tl.float32), 0.0)
            dmin = tl.where(here, tl.load(dmin_ptr + at).to(tl.float32), 0.0)
            xrow = xq_ptr + xr * K + blk * 256
            s4row = s4_ptr + xr * (K // 16) + blk * 16
            for j in tl.static_range(8):
                if lane == 0:
                    acc0 = _step_q4(acc0, xrow, s4row, qs_ptr, at, d, dmin, sc_ptr, mn_ptr, j, BLOCK_N, USE_ASM)
                else:
                    acc1 = _step_q4(acc1, xrow, s4row, qs_ptr, at, d, dmin, sc_ptr, mn_ptr, j, BLOCK_N, USE_ASM)
    y = acc0
    if SB == 2:
        y = acc1 + acc0
    _store(y, b_ptr, y_ptr + part * P_STRIDE, outs, live, M, Y_STRIDE, HAS_BIAS)


@triton.jit
def _store(y, b_ptr, y_ptr, outs, live, M, Y_STRIDE, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(b_ptr + outs, mask=live, other=0.0)[None, :]
    r = tl.arange(0, 16)
    tl.store(y_ptr + r[:, None] * Y_STRIDE + outs[None, :], y, mask=(r < M)[:, None] & live[None, :])


@triton.jit
def _step_q6(acc, xrow_ptr, s6row_ptr, ql_ptr, qh_ptr, sc_ptr, at, d, J: tl.constexpr, BLOCK_N: tl.constexpr,
             USE_ASM: tl.constexpr):
    """Block of 32 J (groups 2J, 2J + 1) of one super-block lane into acc [16, BN], as dp4a's _q6_k_row."""
    x = tl.load(xrow_ptr[:, None] + (32 * J + tl.arange(0, 32))[None, :])          # int8 [16, 32]
    # dp4a's word w of group g (a0 a1 a2 a3, b0 b1 b2 b3): ql word 2g + w % 2 of the block, with the group's qh
    # word shifted left by 4 where w % 2 = 0; its low nibbles' codes for w < 2, its high ones' for w >= 2
    g = tl.arange(0, 2)[:, None, None]                  # [2 g, 4 w, 4 i]
    w = tl.arange(0, 4)[None, :, None]
    i = tl.arange(0, 4)[None, None, :]
    q = tl.load(ql_ptr + at[:, None, None, None] * 32 + 4 * J + (2 * g + w % 2)[None])        # [BN, 2, 4, 1]
    h = tl.load(qh_ptr + at[:, None, None, None] * 16 + 2 * J + g[None])                      # [BN, 2, 1, 1]
    h = tl.where((w % 2 == 0)[None], h << 4, h)
    hi = (w >= 2)[None]
    lo4 = (q >> (8 * i + tl.where(hi, 4, 0))) & 0x0F
    up2 = (h >> (8 * i + tl.where(hi, 2, 0))) & 0x30
    codes = tl.reshape(lo4 | up2, (BLOCK_N, 32)).to(tl.int8)                          # k = 16g + 4w + i
    first = (tl.arange(0, 32) < 16)[None, :]
    s0 = tl.dot(x, tl.trans(tl.where(first, codes, 0).to(tl.int8)), out_dtype=tl.int32)       # group 2J
    s1 = tl.dot(x, tl.trans(tl.where(first, 0, codes).to(tl.int8)), out_dtype=tl.int32)       # group 2J + 1
    dxb = tl.load(s6row_ptr + 4 * J)                    # (dx's bits, c6 of group 0, of group 1, 0)
    c0 = tl.load(s6row_ptr + 4 * J + 1)
    c1 = tl.load(s6row_ptr + 4 * J + 2)
    s0 = s0 + c0[:, None]
    s1 = s1 + c1[:, None]
    dsc0 = d * tl.load(sc_ptr + at * 16 + 2 * J).to(tl.float32)
    dsc1 = d * tl.load(sc_ptr + at * 16 + 2 * J + 1).to(tl.float32)
    v = (_times(s0, dsc0[None, :], (dsc0 * -12582912.0)[None, :], USE_ASM)
         + _times(s1, dsc1[None, :], (dsc1 * -12582912.0)[None, :], USE_ASM))
    return tl.fma(v, dxb.to(tl.float32, bitcast=True)[:, None], acc)


@triton.jit
def _q6_k_imma(xq_ptr, s6_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, b_ptr, y_ptr, M, N, K, NB, Y_STRIDE, NB_PART,
               P_STRIDE, BLOCK_N: tl.constexpr, SB: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr,
               EVEN: tl.constexpr):
    """x's codes xq (int8 [M, K], Q6_K's order) and s6 [M, K / 32, 4] -> y, dp4a's _q6_k_dp4a's numbers."""
    outs, live, nn, xr, part, end = _tile(M, N, NB, NB_PART, BLOCK_N, EVEN)
    acc0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(NB_PART, SB)):
        for lane in tl.static_range(SB):
            blk = part * NB_PART + kb * SB + (SB - 1 - lane)
            here = (live & (blk < end)) | EVEN
            if not EVEN:
                blk = tl.minimum(blk, NB - 1)
            at = nn * NB + blk
            d = tl.where(here, tl.load(d_ptr + at).to(tl.float32), 0.0)
            xrow = xq_ptr + xr * K + blk * 256
            s6row = s6_ptr + xr * (K // 8) + blk * 32
            for j in tl.static_range(8):
                if lane == 0:
                    acc0 = _step_q6(acc0, xrow, s6row, ql_ptr, qh_ptr, sc_ptr, at, d, j, BLOCK_N, USE_ASM)
                else:
                    acc1 = _step_q6(acc1, xrow, s6row, ql_ptr, qh_ptr, sc_ptr, at, d, j, BLOCK_N, USE_ASM)
    y = acc0
    if SB == 2:
        y = acc1 + acc0
    _store(y, b_ptr, y_ptr + part * P_STRIDE, outs, live, M, Y_STRIDE, HAS_BIAS)


def launch(x: torch.Tensor, w, y: torch.Tensor, block_n: int, bias: torch.Tensor | None = None, sb: int = 2,
           split: int = 1, stages: int = 1, prep: dp4a.Prepared | None = None) -> None:
    """dp4a.launch's product (same arguments, same numbers) for 2..16 rows (takes): y [M, N], or with split > 1
    y [split, M, N] of the shares' partial sums. stages: unused (dp4a's loads-in-flight setting)."""
    n, k = w.shape
    nb = w.d.shape[1]
    m = x.shape[0]
    if not fits(m, block_n, sb) or block_n & (block_n - 1) or sb & (sb - 1):
        raise ValueError(f"{m} rows at block_n {block_n} x sb {sb}: not a pass for the int8 tensor cores")
    part = -(-nb // split)
    q4 = isinstance(w, Q4KWeight)
    if prep is None or (prep.q4 if q4 else prep.q6) is None:
        prep = dp4a.prepare(x, [w])
    grid = (1, triton.cdiv(n, block_n), split)
    b = y if bias is None else bias
    common = dict(BLOCK_N=block_n, SB=sb, HAS_BIAS=bias is not None, USE_ASM=ASM,
                  EVEN=n % block_n == 0 and part % sb == 0 and part * split == nb,
                  num_warps=4, enable_fp_fusion=False)
    shape = (m, n, k, nb, y.stride(-2), part, y.stride(0) if split > 1 else 0)
    if q4:
        xq, s4 = prep.q4
        _q4_k_imma[grid](xq, s4, w.qs.view(torch.int32), w.d, w.dmin, w.sc, w.mn, b, y, *shape, **common)
    else:
        xq, s6 = prep.q6
        _q6_k_imma[grid](xq, s6, w.ql.view(torch.int32), w.qh.view(torch.int32), w.sc, w.d, b, y, *shape,
                         **common)
