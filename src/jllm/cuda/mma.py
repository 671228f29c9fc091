"""y = x W^T over Q4_K and Q6_K blocks on the tensor cores, for passes of up to 16 rows (decode and verify), each
row's sums its own (issue 23; off by default until timed: JLLM_MATVEC_MMA=1). x is prepared once a call
(_x_prep: its f16 halves and the halves of its sub-block sums), then every program reads it.

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
    Q6_K:  acc += d * (16 x . ((q - 32) a) + x . ((q - 32) b)), scale = 16 a + b       a super-block a step
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
BLOCK_N = 64                # outputs a program: x's tile is read once for these (SASS: 6.8 instructions a weight
                            # for all 16 rows on sm_90 at 64, 15 at 32; benchmarks/cuda_sass.py q4_k_mma)


@triton.jit
def _x_prep(x_ptr, xh_ptr, xl_ptr, sh_ptr, sl_ptr, M, K, NB):
    """Once a call, for every program of the product: x [M, K] f32 -> its f16 halves xh, xl [16, K] (rows past M
    zero) and the halves of its sums over each sub-block of 32, sh, sl [16, NB * 16] (a super-block's 8 sums,
    then 8 zeros: the mins' product needs K = 16)."""
    r = tl.program_id(0)
    kb = tl.program_id(1)
    k = tl.arange(0, 256)
    x = tl.load(x_ptr + r * K + kb * 256 + k, mask=k < tl.where(r < M, 256, 0), other=0.0)   # rows past M: 0
    hi = x.to(tl.float16)
    tl.store(xh_ptr + r * K + kb * 256 + k, hi)
    tl.store(xl_ptr + r * K + kb * 256 + k, (x - hi.to(tl.float32)).to(tl.float16))
    sums = tl.sum(tl.reshape(x, (8, 32)), axis=1)                           # [8]
    j = tl.arange(0, 16)
    s16 = tl.sum(tl.where(j[:, None] == tl.arange(0, 8)[None, :], sums[None, :], 0.0), axis=1)   # [16], 8 zeros
    shi = s16.to(tl.float16)
    tl.store(sh_ptr + r * (NB * 16) + kb * 16 + j, shi)
    tl.store(sl_ptr + r * (NB * 16) + kb * 16 + j, (s16 - shi.to(tl.float32)).to(tl.float16))


@triton.jit
def _q4_k_mma(xh_ptr, xl_ptr, sh_ptr, sl_ptr, qs_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, b_ptr, y_ptr, M, N, K, NB,
              Y_STRIDE, NB_PART, P_STRIDE, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A super-block a step, the weights as the product's first operand ([BLOCK_N, 256] x [256, 16 rows]): its
    codes times their sub-block's 6-bit scale (q * scale <= 945, an exact f16 integer) against x's halves, times
    d after; the mins' term a product of the 6-bit mins with the halves of x's sub-block sums, times dmin."""
    pid_n = tl.program_id(0)
    part = tl.program_id(1)                        # this program's share of the row's super-blocks
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < N
    nn = tl.minimum(n, N - 1)                      # rows past N read the last one (in bounds), are not stored
    m = tl.arange(0, 16)
    k = tl.arange(0, 256)
    j16 = tl.arange(0, 16)
    j8 = tl.arange(0, 8)
    # sub-block s's code of weight 16h + 4i + t: nibble h of byte i of its word t (q4_k.pack_codes)
    s = tl.arange(0, 8)[:, None, None, None]
    h = tl.arange(0, 2)[None, :, None, None]
    i = tl.arange(0, 4)[None, None, :, None]
    t = tl.arange(0, 4)[None, None, None, :]
    shift = 8 * i + 4 * h + 0 * t + 0 * s                                    # [8, 2, 4, 4]
    word = 4 * s + t + 0 * h + 0 * i
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for kb in range(part * NB_PART, tl.minimum(NB, (part + 1) * NB_PART)):
        w = tl.load(qs_ptr + nn[:, None, None, None, None] * (NB * 32) + kb * 32 + word[None])   # [BN, 8, 2, 4, 4]
        sc = tl.load(sc_ptr + nn[:, None] * (NB * 8) + kb * 8 + j8[None, :]).to(tl.float16)    # [BN, 8]
        q = (((w >> shift[None]) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
        q = tl.reshape(q * sc[:, :, None, None, None], (BLOCK_N, 256))                           # exact
        at = m[None, :] * K + kb * 256 + k[:, None]                                              # [256, 16]
        p = tl.dot(q, tl.load(xh_ptr + at), out_dtype=tl.float32)
        p = tl.dot(q, tl.load(xl_ptr + at), p, out_dtype=tl.float32)
        mn = tl.load(mn_ptr + nn[:, None] * (NB * 8) + kb * 8 + j16[None, :], mask=(j16 < 8)[None, :],
                     other=0).to(tl.float16)                                                     # [BN, 16]
        sat = m[None, :] * (NB * 16) + kb * 16 + j16[:, None]                                    # [16, 16]
        mins = tl.dot(mn, tl.load(sh_ptr + sat), out_dtype=tl.float32)
        mins = tl.dot(mn, tl.load(sl_ptr + sat), mins, out_dtype=tl.float32)
        d = tl.load(d_ptr + nn * NB + kb).to(tl.float32)
        dmin = tl.load(dmin_ptr + nn * NB + kb).to(tl.float32)
        acc += p * d[:, None] - mins * dmin[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + nn)[:, None]
    tl.store(y_ptr + part * P_STRIDE + m[None, :] * Y_STRIDE + n[:, None], acc, mask=(m < M)[None, :] & live[:, None])


@triton.jit
def _q6_k_mma(xh_ptr, xl_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, b_ptr, y_ptr, M, N, K, NB, Y_STRIDE, NB_PART,
              P_STRIDE, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A super-block a step, the weights as the first operand. (q - 32) * scale can reach 4,064, past f16's exact
    integers, so the int8 scale is split, scale = 16 a + b (a = scale >> 4 in -8..7, b = scale & 15): the codes
    times a (|.| <= 256) and times b (<= 480) are two exact f16 tiles, and a super-block is
    d * (16 (x . (q - 32) a) + x . (q - 32) b)."""
    pid_n = tl.program_id(0)
    part = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < N
    nn = tl.minimum(n, N - 1)
    m = tl.arange(0, 16)
    k = tl.arange(0, 256)
    # group g's code of weight 8h + 2j + t: its low 4 bits nibble h of byte j of the group's ql word t, its high
    # 2 bits bits 8j + 4t + 2h (and + 1) of the group's qh word (q6_k.pack_codes)
    g = tl.arange(0, 16)[:, None, None, None]
    h = tl.arange(0, 2)[None, :, None, None]
    j = tl.arange(0, 4)[None, None, :, None]
    t = tl.arange(0, 2)[None, None, None, :]
    lo_shift = 8 * j + 4 * h + 0 * t + 0 * g                                 # [16, 2, 4, 2]
    hi_shift = 8 * j + 4 * t + 2 * h + 0 * g
    word = 2 * g + t + 0 * h + 0 * j
    g16 = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for kb in range(part * NB_PART, tl.minimum(NB, (part + 1) * NB_PART)):
        w = tl.load(ql_ptr + nn[:, None, None, None, None] * (NB * 32) + kb * 32 + word[None])   # [BN, 16, 2, 4, 2]
        hw = tl.load(qh_ptr + nn[:, None] * (NB * 16) + kb * 16 + g16[None, :])                  # [BN, 16]
        code = ((w >> lo_shift[None]) & 15) | (((hw[:, :, None, None, None] >> hi_shift[None]) & 3) << 4)
        q = (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1056.0                  # q - 32, exact
        sc = tl.load(sc_ptr + nn[:, None] * (NB * 16) + kb * 16 + g16[None, :]).to(tl.int32)     # [BN, 16]
        hi_sc = (sc >> 4).to(tl.float16)[:, :, None, None, None]
        lo_sc = (sc & 15).to(tl.float16)[:, :, None, None, None]
        qa = tl.reshape(q * hi_sc, (BLOCK_N, 256))                                               # exact
        qb = tl.reshape(q * lo_sc, (BLOCK_N, 256))
        at = m[None, :] * K + kb * 256 + k[:, None]                                              # [256, 16]
        xh = tl.load(xh_ptr + at)
        xl = tl.load(xl_ptr + at)
        pa = tl.dot(qa, xh, out_dtype=tl.float32)
        pa = tl.dot(qa, xl, pa, out_dtype=tl.float32)
        pb = tl.dot(qb, xh, out_dtype=tl.float32)
        pb = tl.dot(qb, xl, pb, out_dtype=tl.float32)
        d = tl.load(d_ptr + nn * NB + kb).to(tl.float32)
        acc += (16.0 * pa + pb) * d[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + nn)[:, None]
    tl.store(y_ptr + part * P_STRIDE + m[None, :] * Y_STRIDE + n[:, None], acc, mask=(m < M)[None, :] & live[:, None])


def handles(x: torch.Tensor, w) -> bool:
    """Whether this pass runs here: enabled, a K-quant, at most 16 rows."""
    return ENABLED and isinstance(w, (Q4KWeight, Q6KWeight)) and x.shape[0] <= ROWS


def launch(x: torch.Tensor, w, y: torch.Tensor, block_n: int, bias: torch.Tensor | None = None, sb: int = 1,
           split: int = 1, stages: int = 1) -> None:
    """y [M, N] (rows y.stride(-2) apart) = x W^T (+ bias); with split > 1, y [split, M, N] holds each share's
    partial sums (jllm.cuda.matvec adds them). sb, stages: the CUDA-core kernels' (unused here)."""
    n, k = w.shape
    nb = w.d.shape[1]
    part = -(-nb // split)
    xh = torch.empty(ROWS, k, dtype=torch.float16, device=x.device)
    xl = torch.empty_like(xh)
    sums = torch.empty(2, ROWS, nb * 16, dtype=torch.float16, device=x.device)
    _x_prep[(ROWS, nb)](x, xh, xl, sums[0], sums[1], x.shape[0], k, nb)
    grid = (triton.cdiv(n, block_n), split)
    b = y if bias is None else bias
    # one stage: Triton's pipelining would hold ~200 KB of shared memory at 64 outputs, past sm_80's 164 KB
    common = dict(BLOCK_N=block_n, HAS_BIAS=bias is not None, num_warps=4, num_stages=1)
    if isinstance(w, Q4KWeight):
        _q4_k_mma[grid](xh, xl, sums[0], sums[1], w.qs.view(torch.int32), w.d, w.dmin, w.sc, w.mn, b, y, x.shape[0],
                        n, k, nb, y.stride(-2), part, y.stride(0) if split > 1 else 0, **common)
    else:
        _q6_k_mma[grid](xh, xl, w.ql.view(torch.int32), w.qh.view(torch.int32), w.sc, w.d, b, y, x.shape[0], n, k, nb,
                        y.stride(-2), part, y.stride(0) if split > 1 else 0, **common)
