"""y = x W^T over Q4_K and Q6_K blocks on the tensor cores, for passes of up to 16 rows (decode and verify), each
row's sums its own (issue 23; off by default until timed: JLLM_MATVEC_MMA=1).

Why: on the CUDA cores (q4_k.py, q6_k.py) every row of a verify pass pays its own floating-point work on every
weight: in SASS the Q4_K loop is 193 instructions for a thread's 32 weights with one row and 85 more for each
further row (BENCHMARKS.md, "Session 26 on the GPU"), so a pass of 4 rows costs ~1.8 decode steps and
speculation cannot pay. On the tensor cores the rows ride along in one matrix product.

How a row stays its own: every pass is one 16-row tile, its rows padded with zeros (decode too), so every call
runs the same products in the same order whatever rows share it, and a tensor-core product's output element
comes from its own row of x only. A sub-block's codes (Q4_K: 32 weights, 0..15; Q6_K: 16 weights, -32..31) are
f16 integers, exact; x is split into two f16 parts, hi = f16(x) and lo = f16(x - hi), so x's 24 bits meet
the codes as 22 of them (a relative error ~2^-22, against the f32 kernels' 2^-24 per product) where |x| is
about 0.125 to 65504: past it f16 overflows, below it the low half goes subnormal (a per-row power-of-two scale
would widen that; to do before this path can be the default); each sub-block's
products are summed in f32 by the tensor cores, then scaled (the CUDA-core kernels' factoring, regrouped):
    Q4_K:  acc += d * (x . (q * scale)) - dmin * sum over sub-blocks of min * sum(x)   a super-block (256) a step
    Q6_K:  acc += (d * scale) * (x . (q - 32))                                    a group of 16 a step
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from jllm.cuda.q4_k import Q4KWeight
from jllm.cuda.q6_k import Q6KWeight

ENABLED = os.environ.get("JLLM_MATVEC_MMA", "0") == "1"
ROWS = 16                   # every pass is one tile of 16 rows (tl.dot's least)


@triton.jit
def _split(x_ptr, at, ok):
    """x [16, W] f32 at offsets `at` (rows past M masked to 0) -> its f16 halves and its row sums."""
    x = tl.load(x_ptr + at, mask=ok, other=0.0)
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    return hi, lo, x


@triton.jit
def _q4_k_mma(x_ptr, qs_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, b_ptr, y_ptr, M, N, K, NB, Y_STRIDE, NB_PART,
              P_STRIDE, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A super-block a step: its codes times their sub-block's 6-bit scale (q * scale <= 945: an exact f16
    integer) in one product of K = 256 with x's halves, times d after; the mins' term from x's sub-block sums."""
    pid_n = tl.program_id(0)
    part = tl.program_id(1)                        # this program's share of the row's super-blocks
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < N
    m = tl.arange(0, 16)
    k = tl.arange(0, 256)
    # sub-block s's code of weight 16h + 4i + t: nibble h of byte i of its word t (q4_k.pack_codes)
    s = tl.arange(0, 8)[:, None, None, None]
    h = tl.arange(0, 2)[None, :, None, None]
    i = tl.arange(0, 4)[None, None, :, None]
    t = tl.arange(0, 4)[None, None, None, :]
    shift = 8 * i + 4 * h + 0 * t + 0 * s                                    # [8, 2, 4, 4]
    word = 4 * s + t + 0 * h + 0 * i
    j8 = tl.arange(0, 8)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for kb in range(part * NB_PART, tl.minimum(NB, (part + 1) * NB_PART)):
        w = tl.load(qs_ptr + n[:, None, None, None, None] * (NB * 32) + kb * 32 + word[None],
                    mask=live[:, None, None, None, None], other=0)           # int32 [BN, 8, 2, 4, 4]
        meta = n[:, None] * (NB * 8) + kb * 8 + j8[None, :]                  # [BN, 8]
        sc = tl.load(sc_ptr + meta, mask=live[:, None], other=0).to(tl.int32)
        mn = tl.load(mn_ptr + meta, mask=live[:, None], other=0).to(tl.float32)
        q = ((w >> shift[None]) & 15) * sc[:, :, None, None, None]
        q = tl.reshape(q, (BLOCK_N, 256)).to(tl.float16)
        xh, xl, x = _split(x_ptr, m[:, None] * K + kb * 256 + k[None, :], (m < M)[:, None])
        qt = tl.trans(q)                                                     # [256, BN]
        p = tl.dot(xh, qt, out_dtype=tl.float32)
        p = tl.dot(xl, qt, p, out_dtype=tl.float32)
        xs = tl.sum(tl.reshape(x, (16, 8, 32)), axis=2)                     # [16, 8] the sub-blocks' sums
        mins = tl.sum(xs[:, None, :] * mn[None, :, :], axis=2)              # [16, BN]
        d = tl.load(d_ptr + n * NB + kb, mask=live, other=0.0).to(tl.float32)
        dmin = tl.load(dmin_ptr + n * NB + kb, mask=live, other=0.0).to(tl.float32)
        acc += p * d[None, :] - mins * dmin[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=live, other=0.0)[None, :]
    tl.store(y_ptr + part * P_STRIDE + m[:, None] * Y_STRIDE + n[None, :], acc,
             mask=(m < M)[:, None] & live[None, :])


@triton.jit
def _q6_k_mma(x_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, b_ptr, y_ptr, M, N, K, NB, Y_STRIDE, NB_PART, P_STRIDE,
              BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    part = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < N
    m = tl.arange(0, 16)
    k = tl.arange(0, 16)
    # a group's code of weight 8h + 2j + t: the low 4 bits are nibble h of byte j of ql word t, the high 2 bits
    # 2 (1 - h)... of the qh word: bits 8j + 4t + 2h, 8j + 4t + 2h + 1 (q6_k.pack_codes, _six_bits)
    h = tl.arange(0, 2)[:, None, None]
    j = tl.arange(0, 4)[None, :, None]
    t = tl.arange(0, 2)[None, None, :]
    lo_shift = 8 * j + 4 * h + 0 * t                                         # [2, 4, 2]
    hi_shift = 8 * j + 4 * t + 2 * h
    word = 0 * h + 0 * j + t
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    first = part * NB_PART * 16
    end = tl.minimum(NB, (part + 1) * NB_PART) * 16
    for grp in range(first, end):
        w = tl.load(ql_ptr + n[:, None, None, None] * (NB * 32) + grp * 2 + word[None, :, :, :],
                    mask=live[:, None, None, None], other=0)                  # int32 [BN, 2, 4, 2]
        hw = tl.load(qh_ptr + n * (NB * 16) + grp, mask=live, other=0)        # int32 [BN]
        code = ((w >> lo_shift[None, :, :, :]) & 15) | (((hw[:, None, None, None] >> hi_shift[None, :, :, :]) & 3) << 4)
        q = (tl.reshape(code, (BLOCK_N, 16)) - 32).to(tl.float16)
        xh, xl, x = _split(x_ptr, m[:, None] * K + grp * 16 + k[None, :], (m < M)[:, None])
        qt = tl.trans(q)                                                     # [16, BN]
        p = tl.dot(xh, qt, out_dtype=tl.float32)
        p = tl.dot(xl, qt, p, out_dtype=tl.float32)
        dsc = tl.load(d_ptr + n * NB + grp // 16, mask=live, other=0.0).to(tl.float32) \
            * tl.load(sc_ptr + n * (NB * 16) + grp, mask=live, other=0).to(tl.float32)
        acc += p * dsc[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=live, other=0.0)[None, :]
    tl.store(y_ptr + part * P_STRIDE + m[:, None] * Y_STRIDE + n[None, :], acc,
             mask=(m < M)[:, None] & live[None, :])


def handles(x: torch.Tensor, w) -> bool:
    """Whether this pass runs here: enabled, a K-quant, at most 16 rows."""
    return ENABLED and isinstance(w, (Q4KWeight, Q6KWeight)) and x.shape[0] <= ROWS


def launch(x: torch.Tensor, w, y: torch.Tensor, block_n: int, bias: torch.Tensor | None = None, sb: int = 1,
           split: int = 1, stages: int = 1) -> None:
    """y [M, N] (rows y.stride(-2) apart) = x W^T (+ bias); with split > 1, y [split, M, N] holds each share's
    partial sums (jllm.cuda.matvec adds them). sb, stages: the CUDA-core kernels' (one sub-block a step here)."""
    n, k = w.shape
    nb = w.d.shape[1]
    part = -(-nb // split)
    grid = (triton.cdiv(n, block_n), split)
    b = y if bias is None else bias
    common = dict(BLOCK_N=block_n, HAS_BIAS=bias is not None, num_warps=4)
    if isinstance(w, Q4KWeight):
        _q4_k_mma[grid](x, w.qs.view(torch.int32), w.d, w.dmin, w.sc, w.mn, b, y, x.shape[0], n, k, nb,
                        y.stride(-2), part, y.stride(0) if split > 1 else 0, **common)
    else:
        _q6_k_mma[grid](x, w.ql.view(torch.int32), w.qh.view(torch.int32), w.sc, w.d, b, y, x.shape[0], n, k, nb,
                        y.stride(-2), part, y.stride(0) if split > 1 else 0, **common)
