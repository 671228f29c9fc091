"""y = x W^T over Q4_K and Q6_K blocks with x quantized to int8 and integer dot products (PTX `dp4a`) on the
CUDA cores, for passes of 1..16 rows, each row's output its own bit for bit. Standalone: jllm.cuda.matvec does
not call it yet (`handles` and `Prepared` are the hooks, as jllm.cuda.mma has them).

Why: the float kernels (q4_k.py, q6_k.py) turn every code into a float32 and multiply it into every row, ~6 SASS
instructions a weight for one row and ~2.6 for each further row, so a verify pass of 4 rows costs ~1.7 decode
steps. Here one `dp4a` multiplies four codes, a masked byte each in a weight word, by four int8 codes of x and
adds the four products into an int32: the codes are masked once for all rows, and a row pays two `dp4a` per 8
weights plus a few float operations per 32 (instruction counts: benchmarks/cuda_sass.py q4_k_dp4a / q6_k_dp4a).
llama.cpp's MMVQ kernels do the same; jllm's CPU path quantizes x the same way (kernels/qgemm.cpp).

x, made ready once per input (`prepare`, one launch, one program a row and super-block; or a producer of x
fills `empty()`): per row and block of 32 values, dx = amax / 127 and the codes round(x * (127 / amax)) in
[-127, 127] (round to nearest even, as qgemm.cpp's quantize_rows), stored as bytes in the order the weight codes
come out of their words, so that one x word meets one masked weight word:
    Q4_K (q4_k.py's layout): sub-block word t holds weight 4i + t in the low nibble of byte i, 16 + 4i + t in
        the high one; x's 8 words of a sub-block are w = 4h + t with byte i = x[16h + 4i + t]: word t meets
        (q & 0x0F0F0F0F), word 4 + t meets ((q >> 4) & 0x0F0F0F0F). Per block of 32: bsx = dx * sum(codes)
        (f32), for the mins' term, as qgemm.cpp has it.
    Q6_K (q6_k.py's layout): a group of 16 weights (one int8 scale) has ql words t = 0, 1 (byte i: weight
        2i + t's low 4 bits low, 8 + 2i + t's high) and one qh word (byte i: the high 2 bits of weights 2i,
        8 + 2i, 2i + 1, 9 + 2i at bits 0, 2, 4, 6); the 6-bit codes (0..63) are assembled a byte each, and x's
        4 words of a group are w = 2h + t with byte i = x[8h + 2i + t]. The -32 of (q - 32) is folded into
        the integer sum's start: c6 = 0x4B400000 - 32 * sum(group's codes), per row and group (int32).

Integer sums are exact, in any order. Each chain of dp4a starts at 0x4B400000 (the float 1.5 * 2^23) or c6,
so its result, a sum of magnitude below 2^22 (32 * 15 * 127; 16 * 32 * 127), read as a float is 1.5 * 2^23
plus the sum exactly, and one subtraction makes it a float (no I2F). Then per block, in float32:
    Q4_K, per sub-block:  acc = fma((d * sc) * sum, dx, acc);  acc = fma(-(dmin * mn), bsx, acc)
    Q6_K, per block of 32 (groups g0, g1):  v = (d * sc0) * sum0;  v = fma(d * sc1, sum1, v);  acc = fma(v, dx, acc)
and the row's output is its accumulators' sum over the step's blocks at the end.

How a row stays its own: as jllm.cuda.rows: up to 8 rows a program, each with its own accumulators, each row's
step the same operations in the same order as a program of one row runs them; rows past M reload the last row
and are not stored. The kernels compile with enable_fp_fusion=False, so the compiler cannot contract a
multiply and an add into an fma in one ROWS variant and not in another (the fmas above are explicit);
the prep rounds with cvt.rni, whatever the fusion setting of a kernel it may later be fused into. Without a GPU
(Triton's interpreter) the PTX is replaced by shifts, masks and multiplies giving the same integers (ASM).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jllm.cuda.codes import ASM, warps
from jllm.cuda.q4_k import Q4KWeight
from jllm.cuda.q6_k import Q6KWeight
from jllm.cuda.rows import rows_a_program, store_rows

MAGIC = 0x4B400000          # the float 1.5 * 2^23: + an integer below 2^22 in magnitude, still exact
_MAGIC: tl.constexpr = tl.constexpr(MAGIC)
ROWS = 16                   # rows a pass at most (a verify pass of k + 1)

# dp4a.u32.s32 d, a, b, c: d = c + the sum of a's four unsigned bytes times b's four signed bytes.
# Operands as Triton numbers them: the output, then the inputs.
DOT8 = ("{ dp4a.u32.s32 $0, $1, $9, $17; dp4a.u32.s32 $0, $2, $10, $0; dp4a.u32.s32 $0, $3, $11, $0;"
        " dp4a.u32.s32 $0, $4, $12, $0; dp4a.u32.s32 $0, $5, $13, $0; dp4a.u32.s32 $0, $6, $14, $0;"
        " dp4a.u32.s32 $0, $7, $15, $0; dp4a.u32.s32 $0, $8, $16, $0; }")
DOT4 = ("{ dp4a.u32.s32 $0, $1, $5, $9; dp4a.u32.s32 $0, $2, $6, $0; dp4a.u32.s32 $0, $3, $7, $0;"
        " dp4a.u32.s32 $0, $4, $8, $0; }")
_DOT8: tl.constexpr = tl.constexpr(DOT8)
_DOT4: tl.constexpr = tl.constexpr(DOT4)


def _types(v: str) -> tuple:
    """JLLM_MATVEC_DP4A: 1 (Q4_K and Q6_K), q4_k or q6_k (that type only), 0 (none, the default)."""
    table = {"1": (Q4KWeight, Q6KWeight), "q4_k": (Q4KWeight,), "q6_k": (Q6KWeight,), "0": ()}
    if v.lower() not in table:
        raise ValueError(f"JLLM_MATVEC_DP4A={v!r}: 1, q4_k, q6_k or 0")
    return table[v.lower()]


TYPES = _types(os.environ.get("JLLM_MATVEC_DP4A", "0"))     # the block types whose products run here


def handles(x: torch.Tensor, w) -> bool:
    """Whether this pass runs here: enabled for its block type (TYPES), at most ROWS rows."""
    return isinstance(w, TYPES) and x.shape[0] <= ROWS


@triton.jit
def dp4a(a, b, c, USE_ASM: tl.constexpr):
    """c + a's four unsigned bytes times b's four signed bytes, int32 (the interpreter's way without PTX)."""
    if USE_ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return (c + (a & 255) * ((b << 24) >> 24) + ((a >> 8) & 255) * ((b << 16) >> 24)
                + ((a >> 16) & 255) * ((b << 8) >> 24) + ((a >> 24) & 255) * (b >> 24))


@triton.jit
def _dot8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, c, USE_ASM: tl.constexpr):
    """c + the eight words' dp4a, in this order (one chain: DOT8)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_DOT8, "=r," + "r," * 16 + "r",
                                         [a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        c = dp4a(a0, b0, c, False)
        c = dp4a(a1, b1, c, False)
        c = dp4a(a2, b2, c, False)
        c = dp4a(a3, b3, c, False)
        c = dp4a(a4, b4, c, False)
        c = dp4a(a5, b5, c, False)
        c = dp4a(a6, b6, c, False)
        return dp4a(a7, b7, c, False)


@triton.jit
def _dot4(a0, a1, a2, a3, b0, b1, b2, b3, c, USE_ASM: tl.constexpr):
    """c + the four words' dp4a, in this order (DOT4)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_DOT4, "=r," + "r," * 8 + "r", [a0, a1, a2, a3, b0, b1, b2, b3, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        c = dp4a(a0, b0, c, False)
        c = dp4a(a1, b1, c, False)
        c = dp4a(a2, b2, c, False)
        return dp4a(a3, b3, c, False)


@triton.jit
def _sum_float(c):
    """A chain's result (MAGIC + an integer below 2^22 in magnitude) -> that integer as a float32, exactly."""
    return c.to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _four(v, A: tl.constexpr, B: tl.constexpr):
    """[A, B, 4] -> its four [A, B] slices along the last axis, in order (held by one thread: no data moves)."""
    e, o = tl.split(tl.reshape(v, (A, B, 2, 2)))          # last index 2p + c: c = 0 -> t = 0, 2; c = 1 -> 1, 3
    v0, v2 = tl.split(e)
    v1, v3 = tl.split(o)
    return v0, v1, v2, v3


@triton.jit
def _eight(v, A: tl.constexpr):
    """[A, 8] -> its eight [A] columns, in order."""
    e, o = tl.split(tl.reshape(v, (A, 2, 2, 2)))         # j = 4p + 2q + c: c = 0, 1
    e0, e1 = tl.split(e)                                  # q = 0, 1
    o0, o1 = tl.split(o)
    v0, v4 = tl.split(e0)                                 # p = 0, 1
    v2, v6 = tl.split(e1)
    v1, v5 = tl.split(o0)
    v3, v7 = tl.split(o1)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _shuffled(S: tl.constexpr):
    """0 .. S - 1 (a power of two) in an order that is not consecutive (5 s mod S), so that Triton lays the
    step's per-block scale loads out as the words' tiles ([outputs, blocks], a block a thread) instead of
    vectorizing them along the blocks, which would take a shared-memory exchange of every row's sums a step."""
    return (tl.arange(0, S) * 5) & (S - 1)


# ---- x made ready ----------------------------------------------------------------------------------------------

@triton.jit
def _round(v, USE_ASM: tl.constexpr):
    """float32 (|v| < 2^22) -> the nearest integer, ties to even, int32: cvt.rni; in the interpreter the sum
    with 1.5 * 2^23 (which rounds there, unfused, exactly so)."""
    if USE_ASM:
        return tl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=True,
                                         pack=1)
    else:
        return (v + 12582912.0).to(tl.int32, bitcast=True) - _MAGIC


@triton.jit
def _q4_pos(f):
    """Byte f of a row's Q4_K-ordered codes -> the position of its x: sub-block f // 32, word w = 4h + t,
    byte i -> 16h + 4i + t."""
    r = f % 32
    return (f // 32) * 32 + (r // 16) * 16 + (r % 4) * 4 + (r // 4) % 4


@triton.jit
def _q6_pos(f):
    """Byte f of a row's Q6_K-ordered codes -> the position of its x: group f // 16, word w = 2h + t, byte i
    -> 8h + 2i + t."""
    r = f % 16
    return (f // 16) * 16 + (r // 8) * 8 + (r % 4) * 2 + (r // 4) % 2


@triton.jit
def _codes(x_ptr, pos, inv, USE_ASM: tl.constexpr):
    """x at positions pos [8, 32] (each row of pos within its block of 32), times its block's 127 / amax, rounded."""
    return _round(tl.load(x_ptr + pos).to(tl.float32) * inv[:, None], USE_ASM)


@triton.jit
def prep_block(x_ptr, r, kb, K, xq4_ptr, xq6_ptr, dx_ptr, bsx_ptr, c6_ptr, Q4: tl.constexpr, Q6: tl.constexpr,
               USE_ASM: tl.constexpr):
    """Super-block kb (256 values) of row r of x [M, K] made ready: dx [M, K / 32]; with Q4 the codes in Q4_K's
    order (xq4 int8 [M, K]) and bsx [M, K / 32]; with Q6 the codes in Q6_K's order (xq6) and c6 [M, K / 16]."""
    row = x_ptr + r * K + kb * 256
    f = tl.reshape(tl.arange(0, 256), (8, 32))                         # [block of 32, byte]
    amax = tl.max(tl.abs(tl.load(row + f).to(tl.float32)), axis=1)      # [8]
    dx = tl.math.div_rn(amax, tl.full((8,), 127.0, tl.float32))
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full((8,), 127.0, tl.float32), amax), 0.0)
    tl.store(dx_ptr + r * (K // 32) + kb * 8 + tl.arange(0, 8), dx)
    if Q4:
        q = _codes(row, _q4_pos(f), inv, USE_ASM)
        tl.store(xq4_ptr + r * K + kb * 256 + f, q.to(tl.int8))
        tl.store(bsx_ptr + r * (K // 32) + kb * 8 + tl.arange(0, 8), dx * tl.sum(q, axis=1).to(tl.float32))
    if Q6:
        q = _codes(row, _q6_pos(f), inv, USE_ASM)
        tl.store(xq6_ptr + r * K + kb * 256 + f, q.to(tl.int8))
        c6 = _MAGIC - 32 * tl.sum(tl.reshape(q, (16, 16)), axis=1)
        tl.store(c6_ptr + r * (K // 16) + kb * 16 + tl.arange(0, 16), c6)


@triton.jit
def _x_prep(x_ptr, xq4_ptr, xq6_ptr, dx_ptr, bsx_ptr, c6_ptr, K, Q4: tl.constexpr, Q6: tl.constexpr,
            USE_ASM: tl.constexpr):
    """One program a row and super-block (prep_block)."""
    prep_block(x_ptr, tl.program_id(0), tl.program_id(1), K, xq4_ptr, xq6_ptr, dx_ptr, bsx_ptr, c6_ptr, Q4, Q6,
               USE_ASM)


@dataclass
class Prepared:
    """x made ready once for every dp4a product over it (prep_block): dx, and the codes (and their sums) in the
    order of each block type asked for (None where not). Made by prepare(), or empty by empty() for a producer
    of x to fill as it writes x."""
    dx: torch.Tensor                                            # float32 [M, K / 32]
    q4: tuple[torch.Tensor, torch.Tensor] | None                # codes int8 [M, K], bsx float32 [M, K / 32]
    q6: tuple[torch.Tensor, torch.Tensor] | None                # codes int8 [M, K], c6 int32 [M, K / 16]

    def pointers(self) -> tuple:
        """The five tensors prep_block writes (xq4, xq6, dx, bsx, c6), dx where a type is not asked for (its
        stores are compiled out), and the two flags."""
        xq4, bsx = self.q4 or (self.dx, self.dx)
        xq6, c6 = self.q6 or (self.dx, self.dx)
        return (xq4, xq6, self.dx, bsx, c6), self.q4 is not None, self.q6 is not None


def kinds(weights) -> tuple[bool, bool]:
    """Whether products over Q4_K and over Q6_K blocks are among `weights`."""
    return any(isinstance(w, Q4KWeight) for w in weights), any(isinstance(w, Q6KWeight) for w in weights)


def empty(m: int, k: int, q4: bool, q6: bool, device) -> Prepared:
    """Room for m rows of k inputs made ready for Q4_K (q4) and Q6_K (q6) products."""
    f32 = dict(dtype=torch.float32, device=device)
    return Prepared(torch.empty(m, k // 32, **f32),
                    (torch.empty(m, k, dtype=torch.int8, device=device), torch.empty(m, k // 32, **f32))
                    if q4 else None,
                    (torch.empty(m, k, dtype=torch.int8, device=device),
                     torch.empty(m, k // 16, dtype=torch.int32, device=device)) if q6 else None)


def prepare(x: torch.Tensor, weights) -> Prepared:
    """x [M, K] float32 or bfloat16 (contiguous) for the products over `weights` (Q4KWeight / Q6KWeight, all of K
    inputs): one launch, whose result every product over x (q|k|v: Q4_K and Q6_K) then reads."""
    m, k = x.shape
    prep = empty(m, k, *kinds(weights), x.device)
    ptrs, q4, q6 = prep.pointers()
    if m:
        _x_prep[(m, k // 256)](x, *ptrs, k, Q4=q4, Q6=q6, USE_ASM=ASM, enable_fp_fusion=False)
    return prep


# ---- the products ----------------------------------------------------------------------------------------------

@triton.jit
def _q4_k_row(acc, xq_ptr, dx_ptr, bsx_ptr, xo, sub, ok, l0, l1, l2, l3, h0, h1, h2, h3, dsc, ndmm,
              S: tl.constexpr, USE_ASM: tl.constexpr):
    """One row's step: its codes of the step's sub-blocks (xq words at xo [S, 8]) against the masked weight
    words, one chain a sub-block, then the sub-block's float terms into acc [BN, S]. The same operations in the
    same order for every row (jllm.cuda.rows)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _eight(tl.load(xq_ptr + xo, mask=ok[:, None], other=0), S)
    c = _dot8(l0, l1, l2, l3, h0, h1, h2, h3, x0[None, :], x1[None, :], x2[None, :], x3[None, :], x4[None, :],
              x5[None, :], x6[None, :], x7[None, :], _MAGIC, USE_ASM)
    dx = tl.load(dx_ptr + sub, mask=ok, other=0.0)
    bsx = tl.load(bsx_ptr + sub, mask=ok, other=0.0)
    acc = tl.fma(dsc * _sum_float(c), dx[None, :], acc)
    return tl.fma(ndmm, bsx[None, :], acc)


@triton.jit
def _q4_k_dp4a(xq_ptr, dx_ptr, bsx_ptr, qs_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, b_ptr, y_ptr, M, N, K, NB,
               Y_STRIDE, NB_PART, P_STRIDE, BLOCK_N: tl.constexpr, SB: tl.constexpr, ROWS: tl.constexpr,
               HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr):
    """x's codes xq (int32 words [M, K / 4], Q4_K's order), dx and bsx [M, K / 32] -> y (see q4_k._q4_k_matvec
    for the grid, the shares and EVEN). A thread takes a sub-block's four words of an output."""
    m0 = tl.program_id(0) * ROWS
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    S: tl.constexpr = 8 * SB              # sub-blocks of 32 weights a step
    s = _shuffled(S)
    t = tl.arange(0, 4)
    j = tl.arange(0, 8)
    acc0 = tl.zeros((BLOCK_N, S), dtype=tl.float32)       # one sum per row (jllm.cuda.rows)
    acc1 = tl.zeros((BLOCK_N, S), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, S), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, S), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_N, S), dtype=tl.float32)
    acc5 = tl.zeros((BLOCK_N, S), dtype=tl.float32)
    acc6 = tl.zeros((BLOCK_N, S), dtype=tl.float32)
    acc7 = tl.zeros((BLOCK_N, S), dtype=tl.float32)
    part = tl.program_id(2)
    end = tl.minimum(NB, (part + 1) * NB_PART) * 8
    KW = K // 4                           # x's words a row
    KB = K // 32                          # x's blocks of 32 a row
    for kb in tl.range(0, tl.cdiv(NB_PART, SB), num_stages=STAGES):
        sub = part * NB_PART * 8 + kb * S + s
        ok = (sub < end) | EVEN
        m2 = (live[:, None] & ok[None, :]) | EVEN
        q = tl.load(qs_ptr + rows[:, None, None] * (NB * 32) + sub[None, :, None] * 4 + t[None, None, :],
                    mask=m2[:, :, None], other=0)                                   # int32 [BN, S, 4]
        l0, l1, l2, l3 = _four(q & 0x0F0F0F0F, BLOCK_N, S)                          # weights 4i + t
        h0, h1, h2, h3 = _four((q >> 4) & 0x0F0F0F0F, BLOCK_N, S)                   # weights 16 + 4i + t
        meta = rows[:, None] * (NB * 8) + sub[None, :]
        blk = rows[:, None] * NB + sub[None, :] // 8
        dsc = (tl.load(d_ptr + blk, mask=m2, other=0.0).to(tl.float32)
               * tl.load(sc_ptr + meta, mask=m2, other=0).to(tl.float32))
        ndmm = -(tl.load(dmin_ptr + blk, mask=m2, other=0.0).to(tl.float32)
                 * tl.load(mn_ptr + meta, mask=m2, other=0).to(tl.float32))
        xo = sub[:, None] * 8 + j[None, :]
        acc0 = _q4_k_row(acc0, xq_ptr + m0 * KW, dx_ptr + m0 * KB, bsx_ptr + m0 * KB, xo, sub, ok, l0, l1, l2, l3,
                         h0, h1, h2, h3, dsc, ndmm, S, USE_ASM)
        if ROWS > 1:
            r = tl.minimum(m0 + 1, M - 1)
            acc1 = _q4_k_row(acc1, xq_ptr + r * KW, dx_ptr + r * KB, bsx_ptr + r * KB, xo, sub, ok, l0, l1, l2, l3,
                             h0, h1, h2, h3, dsc, ndmm, S, USE_ASM)
        if ROWS > 2:
            r = tl.minimum(m0 + 2, M - 1)
            acc2 = _q4_k_row(acc2, xq_ptr + r * KW, dx_ptr + r * KB, bsx_ptr + r * KB, xo, sub, ok, l0, l1, l2, l3,
                             h0, h1, h2, h3, dsc, ndmm, S, USE_ASM)
        if ROWS > 3:
            r = tl.minimum(m0 + 3, M - 1)
            acc3 = _q4_k_row(acc3, xq_ptr + r * KW, dx_ptr + r * KB, bsx_ptr + r * KB, xo, sub, ok, l0, l1, l2, l3,
                             h0, h1, h2, h3, dsc, ndmm, S, USE_ASM)
        if ROWS > 4:
            r = tl.minimum(m0 + 4, M - 1)
            acc4 = _q4_k_row(acc4, xq_ptr + r * KW, dx_ptr + r * KB, bsx_ptr + r * KB, xo, sub, ok, l0, l1, l2, l3,
                             h0, h1, h2, h3, dsc, ndmm, S, USE_ASM)
        if ROWS > 5:
            r = tl.minimum(m0 + 5, M - 1)
            acc5 = _q4_k_row(acc5, xq_ptr + r * KW, dx_ptr + r * KB, bsx_ptr + r * KB, xo, sub, ok, l0, l1, l2, l3,
                             h0, h1, h2, h3, dsc, ndmm, S, USE_ASM)
        if ROWS > 6:
            r = tl.minimum(m0 + 6, M - 1)
            acc6 = _q4_k_row(acc6, xq_ptr + r * KW, dx_ptr + r * KB, bsx_ptr + r * KB, xo, sub, ok, l0, l1, l2, l3,
                             h0, h1, h2, h3, dsc, ndmm, S, USE_ASM)
        if ROWS > 7:
            r = tl.minimum(m0 + 7, M - 1)
            acc7 = _q4_k_row(acc7, xq_ptr + r * KW, dx_ptr + r * KB, bsx_ptr + r * KB, xo, sub, ok, l0, l1, l2, l3,
                             h0, h1, h2, h3, dsc, ndmm, S, USE_ASM)
    store_rows(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1),
               tl.sum(acc4, axis=1), tl.sum(acc5, axis=1), tl.sum(acc6, axis=1), tl.sum(acc7, axis=1),
               y_ptr + part * P_STRIDE + rows, live, m0, M, Y_STRIDE, ROWS, HAS_BIAS, b_ptr + rows, False)


@triton.jit
def _six(q, h):
    """A group's ql word (t = 0 or 1) and its qh word shifted for it (h << 4 for t = 0, h for t = 1) -> the
    6-bit codes of the low nibbles' weights (2i + t) and, with h >> 2 more, of the high ones'."""
    return (q & 0x0F0F0F0F) | (h & 0x30303030), ((q >> 4) & 0x0F0F0F0F) | ((h >> 2) & 0x30303030)


@triton.jit
def _q6_k_row(acc, xq_ptr, dx_ptr, c6_ptr, xo, blk, ok, a0, a1, a2, a3, b0, b1, b2, b3, dsc0, dsc1,
              B: tl.constexpr, USE_ASM: tl.constexpr):
    """One row's step: its codes of the step's blocks of 32 (xq words at xo [B, 8]: group 0's four, group 1's)
    against the groups' 6-bit code words a0..a3, b0..b3, each chain from the group's c6, then the float terms
    into acc [BN, B]. The same operations in the same order for every row."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _eight(tl.load(xq_ptr + xo, mask=ok[:, None], other=0), B)
    cg = tl.load(c6_ptr + blk[:, None] * 2 + tl.arange(0, 2)[None, :], mask=ok[:, None], other=_MAGIC)
    c0, c1 = tl.split(cg)
    s0 = _dot4(a0, a1, a2, a3, x0[None, :], x1[None, :], x2[None, :], x3[None, :], c0[None, :], USE_ASM)
    s1 = _dot4(b0, b1, b2, b3, x4[None, :], x5[None, :], x6[None, :], x7[None, :], c1[None, :], USE_ASM)
    v = dsc0 * _sum_float(s0)
    v = tl.fma(dsc1, _sum_float(s1), v)
    return tl.fma(v, tl.load(dx_ptr + blk, mask=ok, other=0.0)[None, :], acc)


@triton.jit
def _q6_k_dp4a(xq_ptr, dx_ptr, c6_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, b_ptr, y_ptr, M, N, K, NB, Y_STRIDE,
               NB_PART, P_STRIDE, BLOCK_N: tl.constexpr, SB: tl.constexpr, ROWS: tl.constexpr,
               HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr):
    """x's codes xq (int32 words [M, K / 4], Q6_K's order), dx [M, K / 32], c6 [M, K / 16] -> y. A thread takes
    a block of 32 weights of an output: two groups, four ql words, two qh words, two scales."""
    m0 = tl.program_id(0) * ROWS
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    B: tl.constexpr = 8 * SB              # blocks of 32 weights (two groups) a step
    b = _shuffled(B)
    t = tl.arange(0, 4)
    u = tl.arange(0, 2)
    j = tl.arange(0, 8)
    acc0 = tl.zeros((BLOCK_N, B), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, B), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, B), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, B), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_N, B), dtype=tl.float32)
    acc5 = tl.zeros((BLOCK_N, B), dtype=tl.float32)
    acc6 = tl.zeros((BLOCK_N, B), dtype=tl.float32)
    acc7 = tl.zeros((BLOCK_N, B), dtype=tl.float32)
    part = tl.program_id(2)
    end = tl.minimum(NB, (part + 1) * NB_PART) * 8
    KW = K // 4
    KB = K // 32
    KG = K // 16
    for kb in tl.range(0, tl.cdiv(NB_PART, SB), num_stages=STAGES):
        blk = part * NB_PART * 8 + kb * B + b
        ok = (blk < end) | EVEN
        m2 = (live[:, None] & ok[None, :]) | EVEN
        at = rows[:, None, None] * (NB * 16) + blk[None, :, None] * 2 + u[None, None, :]        # [BN, B, 2]
        q0, q1, q2, q3 = _four(tl.load(ql_ptr + rows[:, None, None] * (NB * 32) + blk[None, :, None] * 4
                                       + t[None, None, :], mask=m2[:, :, None], other=0), BLOCK_N, B)
        h0, h1 = tl.split(tl.load(qh_ptr + at, mask=m2[:, :, None], other=0))
        sc0, sc1 = tl.split(tl.load(sc_ptr + at, mask=m2[:, :, None], other=0).to(tl.float32))
        d = tl.load(d_ptr + rows[:, None] * NB + blk[None, :] // 8, mask=m2, other=0.0).to(tl.float32)
        dsc0 = d * sc0
        dsc1 = d * sc1
        a0, a2 = _six(q0, h0 << 4)        # group 0: words lo t=0, lo t=1, hi t=0, hi t=1 (x's order)
        a1, a3 = _six(q1, h0)
        b0, b2 = _six(q2, h1 << 4)        # group 1
        b1, b3 = _six(q3, h1)
        xo = blk[:, None] * 8 + j[None, :]
        acc0 = _q6_k_row(acc0, xq_ptr + m0 * KW, dx_ptr + m0 * KB, c6_ptr + m0 * KG, xo, blk, ok, a0, a1, a2, a3,
                         b0, b1, b2, b3, dsc0, dsc1, B, USE_ASM)
        if ROWS > 1:
            r = tl.minimum(m0 + 1, M - 1)
            acc1 = _q6_k_row(acc1, xq_ptr + r * KW, dx_ptr + r * KB, c6_ptr + r * KG, xo, blk, ok, a0, a1, a2, a3,
                             b0, b1, b2, b3, dsc0, dsc1, B, USE_ASM)
        if ROWS > 2:
            r = tl.minimum(m0 + 2, M - 1)
            acc2 = _q6_k_row(acc2, xq_ptr + r * KW, dx_ptr + r * KB, c6_ptr + r * KG, xo, blk, ok, a0, a1, a2, a3,
                             b0, b1, b2, b3, dsc0, dsc1, B, USE_ASM)
        if ROWS > 3:
            r = tl.minimum(m0 + 3, M - 1)
            acc3 = _q6_k_row(acc3, xq_ptr + r * KW, dx_ptr + r * KB, c6_ptr + r * KG, xo, blk, ok, a0, a1, a2, a3,
                             b0, b1, b2, b3, dsc0, dsc1, B, USE_ASM)
        if ROWS > 4:
            r = tl.minimum(m0 + 4, M - 1)
            acc4 = _q6_k_row(acc4, xq_ptr + r * KW, dx_ptr + r * KB, c6_ptr + r * KG, xo, blk, ok, a0, a1, a2, a3,
                             b0, b1, b2, b3, dsc0, dsc1, B, USE_ASM)
        if ROWS > 5:
            r = tl.minimum(m0 + 5, M - 1)
            acc5 = _q6_k_row(acc5, xq_ptr + r * KW, dx_ptr + r * KB, c6_ptr + r * KG, xo, blk, ok, a0, a1, a2, a3,
                             b0, b1, b2, b3, dsc0, dsc1, B, USE_ASM)
        if ROWS > 6:
            r = tl.minimum(m0 + 6, M - 1)
            acc6 = _q6_k_row(acc6, xq_ptr + r * KW, dx_ptr + r * KB, c6_ptr + r * KG, xo, blk, ok, a0, a1, a2, a3,
                             b0, b1, b2, b3, dsc0, dsc1, B, USE_ASM)
        if ROWS > 7:
            r = tl.minimum(m0 + 7, M - 1)
            acc7 = _q6_k_row(acc7, xq_ptr + r * KW, dx_ptr + r * KB, c6_ptr + r * KG, xo, blk, ok, a0, a1, a2, a3,
                             b0, b1, b2, b3, dsc0, dsc1, B, USE_ASM)
    store_rows(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1),
               tl.sum(acc4, axis=1), tl.sum(acc5, axis=1), tl.sum(acc6, axis=1), tl.sum(acc7, axis=1),
               y_ptr + part * P_STRIDE + rows, live, m0, M, Y_STRIDE, ROWS, HAS_BIAS, b_ptr + rows, False)


def launch(x: torch.Tensor, w, y: torch.Tensor, block_n: int, bias: torch.Tensor | None = None, sb: int = 1,
           split: int = 1, stages: int = 1, prep: Prepared | None = None) -> None:
    """y [M, N] (rows y.stride(-2) apart: a column range of a wider output) = x W^T (+ bias); with split > 1,
    y [split, M, N] holds each share of the super-blocks' partial sums (jllm.cuda.matvec adds them). prep: x
    already prepared for w's type (else prepared here)."""
    n, k = w.shape
    nb = w.d.shape[1]
    part = -(-nb // split)
    q4 = isinstance(w, Q4KWeight)
    if prep is None or (prep.q4 if q4 else prep.q6) is None:
        prep = prepare(x, [w])
    r = rows_a_program(x.shape[0])
    grid = (triton.cdiv(x.shape[0], r), triton.cdiv(n, block_n), split)
    b = y if bias is None else bias
    common = dict(BLOCK_N=block_n, SB=sb, ROWS=r, HAS_BIAS=bias is not None, USE_ASM=ASM,
                  EVEN=n % block_n == 0 and part % sb == 0 and part * split == nb, STAGES=stages,
                  num_warps=warps(block_n, sb), enable_fp_fusion=False)
    shape = (x.shape[0], n, k, nb, y.stride(-2), part, y.stride(0) if split > 1 else 0)
    if q4:
        xq, bsx = prep.q4
        _q4_k_dp4a[grid](xq.view(torch.int32), prep.dx, bsx, w.qs.view(torch.int32), w.d, w.dmin, w.sc, w.mn, b, y,
                         *shape, **common)
    else:
        xq, c6 = prep.q6
        _q6_k_dp4a[grid](xq.view(torch.int32), prep.dx, c6, w.ql.view(torch.int32), w.qh.view(torch.int32), w.sc,
                         w.d, b, y, *shape, **common)
