"""y = x W^T over Q4_K and Q6_K blocks with x quantized to int8 and integer dot products (PTX `dp4a`) on the
CUDA cores, for passes of 1..16 rows, each row's output its own bit for bit. Standalone: jllm.cuda.matvec does
not call it yet (`handles`, `setting`, `Prepared`/`empty`/`prepare` and `launch` are the hooks, as
jllm.cuda.mma has them).

Why: the float kernels (q4_k.py, q6_k.py) turn every code into a float32 and multiply it into every row: in SASS
(benchmarks/cuda_sass.py, sm_90) ~5.2-6.3 instructions a weight for one row and ~2-2.6 more for each further
row, so a verify pass of 4 rows costs ~1.7-2 decode steps. Here one `dp4a` multiplies four codes (a masked byte
each of a weight word) by four int8 codes of x and adds the products into an int32: the codes are masked once
for all rows, and a row pays two `dp4a` per 8 weights plus three or four float operations per 32. At 64 outputs
x 2 super-blocks a program: Q4_K 1.20 instructions a weight for one row, +0.45-0.5 a further row (2.63 for 4
rows); Q6_K 1.66, +0.5-0.55 (3.20 for 4 rows; 8 rows spill registers). llama.cpp's MMVQ kernels work the same
way; jllm's CPU path quantizes x the same way (kernels/qgemm.cpp).

x, made ready once per input (`prepare`: one launch, one program a row and super-block; or a producer of x fills
`empty()` with prep_block): per row and block of 32 values, dx = amax / 127 and the codes round(x * (127 /
amax)) in [-127, 127] (127 / amax in float32, rounded to nearest even: qgemm.cpp's quantize_rows, bit for bit),
stored as bytes in the order the weight codes come out of their words, so that one x word meets one masked
weight word:
    Q4_K (q4_k.py's layout): sub-block word t holds weight 4i + t in the low nibble of byte i, 16 + 4i + t in
        the high one; x's 8 words of a sub-block are w = 4h + t with byte i = x[16h + 4i + t]: word t meets
        (q & 0x0F0F0F0F), word 4 + t meets ((q >> 4) & 0x0F0F0F0F). Per block of 32 (dx, bsx = dx * sum of the
        codes, for the mins' term as qgemm.cpp has it), float32 [M, K / 32, 2].
    Q6_K (q6_k.py's layout): a group of 16 weights (one int8 scale) has ql words t = 0, 1 (byte i: weight
        2i + t's low 4 bits low, 8 + 2i + t's high) and a qh word (byte i: the high 2 bits of weights 2i,
        8 + 2i, 2i + 1, 9 + 2i at bits 0, 2, 4, 6); the unsigned 6-bit codes are assembled a byte each, and x's
        4 words of a group are w = 2h + t with byte i = x[8h + 2i + t]. The -32 of (q - 32) is the integer
        sum's start: c6 = MAGIC - 32 * the group's sum of codes. Per block of 32 (dx's bits, c6 of its two
        groups, 0), int32 [M, K / 32, 4].

The products: a thread takes an output's super-block (its scales and mins loaded once for its 256 weights),
its 8 blocks of 32 one after the other, and for each row of x a dp4a chain a block (Q4_K) or group (Q6_K).
Integer sums are exact, in any order. A chain starts at MAGIC = 0x4B400000 (the float 1.5 * 2^23; Q6_K: c6),
so its result, a sum below 2^22 in magnitude (32 * 15 * 127; 16 * 32 * 127), read as a float is 1.5 * 2^23 plus
the sum exactly; times s = d * scale that is one fma (_times), then per row and block, in float32:
    Q4_K, per sub-block:  acc = fma(round((d * sc) * sum), dx, acc);  acc = fma(-(dmin * mn), bsx, acc)
    Q6_K, per block of 32 (groups 0, 1):  acc = fma(round((d * sc0) * sum0) + round((d * sc1) * sum1), dx, acc)
and the row's output is its accumulators' sum over a step's super-blocks at the end (plus the bias).

How a row stays its own: as jllm.cuda.rows: up to 8 rows a program, each with its own accumulators, each row's
step the same operations in the same order as a program of one row runs them; rows past M reload the last row
and are not stored. The kernels compile with enable_fp_fusion=False, so the compiler cannot contract a
multiply and an add into an fma in one ROWS variant and not in another (the fmas above are explicit); the prep
rounds with cvt.rni, whatever the fusion setting of a kernel it may later be fused into. The products are not
the float kernels' (x rounded to 8 bits a block of 32: ~0.5% rms relative error against the float product on
random weights and x, the CPU's int8 path's own error): a matrix must take this path for every row count or
none. Without a GPU (Triton's interpreter) the PTX
is replaced by shifts, masks and multiplies giving the same integers, and the fma of _times by its exact
two-step equal (ASM).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jllm.cuda.codes import ASM
from jllm.cuda.q4_k import Q4KWeight
from jllm.cuda.q6_k import Q6KWeight
from jllm.cuda.rows import each_row, row_sums, rows_a_program, store_rows, x_rows

MAGIC = 0x4B400000          # the float 1.5 * 2^23: + an integer below 2^22 in magnitude, still exact
_MAGIC: tl.constexpr = tl.constexpr(MAGIC)
ROWS = 16                   # rows a pass at most (a verify pass of k + 1)

# dp4a.u32.s32 d, a, b, c: d = c + the sum of a's four unsigned bytes times b's four signed bytes (int32,
# wrapping). Operands as Triton numbers them: the output, then the inputs (tests/test_cuda_dp4a.py runs these
# through tests/ptx_subset.py's emulator).
DP4A = "{ dp4a.u32.s32 $0, $1, $2, $3; }"
ROUND = "{ cvt.rni.s32.f32 $0, $1; }"              # to the nearest integer, ties to even
DOT8 = ("{ dp4a.u32.s32 $0, $1, $9, $17; dp4a.u32.s32 $0, $2, $10, $0; dp4a.u32.s32 $0, $3, $11, $0;"
        " dp4a.u32.s32 $0, $4, $12, $0; dp4a.u32.s32 $0, $5, $13, $0; dp4a.u32.s32 $0, $6, $14, $0;"
        " dp4a.u32.s32 $0, $7, $15, $0; dp4a.u32.s32 $0, $8, $16, $0; }")
DOT4 = ("{ dp4a.u32.s32 $0, $1, $5, $9; dp4a.u32.s32 $0, $2, $6, $0; dp4a.u32.s32 $0, $3, $7, $0;"
        " dp4a.u32.s32 $0, $4, $8, $0; }")
_DP4A: tl.constexpr = tl.constexpr(DP4A)
_ROUND: tl.constexpr = tl.constexpr(ROUND)
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
        return tl.inline_asm_elementwise(_DP4A, "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
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
def _times(c, s, nsm, USE_ASM: tl.constexpr):
    """A chain's result c (MAGIC + an integer i below 2^22 in magnitude) times s, given nsm = -(s * 1.5 * 2^23)
    (exact where s has at most 21 significant bits: d * scale): on the GPU one fma, round(s * (1.5 * 2^23 + i)
    - s * 1.5 * 2^23) = round(s * i); in the interpreter (whose fma may round twice, Triton 3.6's) the same
    float as (c as a float - 1.5 * 2^23, exact) * s."""
    if USE_ASM:
        return tl.fma(s, c.to(tl.float32, bitcast=True), nsm)
    else:
        return (c.to(tl.float32, bitcast=True) - 12582912.0) * s


@triton.jit
def _four(v, A: tl.constexpr, B: tl.constexpr):
    """[A, B, 4] -> its four [A, B] slices along the last axis, in order (held by one thread: no data moves)."""
    e, o = tl.split(tl.reshape(v, (A, B, 2, 2)))          # last index 2p + c: c = 0 -> t = 0, 2; c = 1 -> 1, 3
    v0, v2 = tl.split(e)
    v1, v3 = tl.split(o)
    return v0, v1, v2, v3


@triton.jit
def _eight3(v, A: tl.constexpr, B: tl.constexpr):
    """[A, B, 8] -> its eight [A, B] slices along the last axis, in order."""
    e, o = tl.split(tl.reshape(v, (A, B, 2, 2, 2)))      # k = 4p + 2q + c: c = 0, 1
    e0, e1 = tl.split(e)                                  # q = 0, 1
    o0, o1 = tl.split(o)
    v0, v4 = tl.split(e0)                                 # p = 0, 1
    v2, v6 = tl.split(e1)
    v1, v5 = tl.split(o0)
    v3, v7 = tl.split(o1)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _sixteen3(v, A: tl.constexpr, B: tl.constexpr):
    """[A, B, 16] -> its sixteen [A, B] slices along the last axis, in order."""
    e, o = tl.split(tl.reshape(v, (A, B, 8, 2)))
    e0, e1, e2, e3, e4, e5, e6, e7 = _eight3(e, A, B)
    o0, o1, o2, o3, o4, o5, o6, o7 = _eight3(o, A, B)
    return e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7


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


# ---- x made ready ----------------------------------------------------------------------------------------------

@triton.jit
def _round(v, USE_ASM: tl.constexpr):
    """float32 (|v| < 2^22) -> the nearest integer, ties to even, int32: cvt.rni; in the interpreter the sum
    with 1.5 * 2^23 (which rounds there, unfused, exactly so)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_ROUND, "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
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
def prep_block(x_ptr, r, kb, K, xq4_ptr, s4_ptr, xq6_ptr, s6_ptr, Q4: tl.constexpr, Q6: tl.constexpr,
               USE_ASM: tl.constexpr):
    """Super-block kb (256 values) of row r of x [M, K] made ready: with Q4 its codes in Q4_K's order (xq4
    int8 [M, K]) and per block of 32 (dx, bsx) (s4 float32 [M, K / 32, 2]); with Q6 its codes in Q6_K's order
    (xq6) and per block of 32 (dx's bits, c6 of its two groups, 0) (s6 int32 [M, K / 32, 4]): a row's block
    of a product is then two 16-byte loads of codes and one of its numbers."""
    row = x_ptr + r * K + kb * 256
    f = tl.reshape(tl.arange(0, 256), (8, 32))                         # [block of 32, byte]
    amax = tl.max(tl.abs(tl.load(row + f).to(tl.float32)), axis=1)      # [8]
    dx = tl.math.div_rn(amax, tl.full((8,), 127.0, tl.float32))
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full((8,), 127.0, tl.float32), tl.where(amax > 0, amax, 1.0)), 0.0)
    i = r * (K // 32) + kb * 8 + tl.arange(0, 8)                        # [8] the blocks' index
    if Q4:
        q = _codes(row, _q4_pos(f), inv, USE_ASM)
        tl.store(xq4_ptr + r * K + kb * 256 + f, q.to(tl.int8))
        tl.store(s4_ptr + 2 * i, dx)
        tl.store(s4_ptr + 2 * i + 1, dx * tl.sum(q, axis=1).to(tl.float32))
    if Q6:
        q = _codes(row, _q6_pos(f), inv, USE_ASM)
        tl.store(xq6_ptr + r * K + kb * 256 + f, q.to(tl.int8))
        c0, c1 = tl.split(tl.sum(tl.reshape(q, (8, 2, 16)), axis=2) * -32 + _MAGIC)      # [8] each
        tl.store(s6_ptr + 4 * i, dx.to(tl.int32, bitcast=True))
        tl.store(s6_ptr + 4 * i + 1, c0)
        tl.store(s6_ptr + 4 * i + 2, c1)
        tl.store(s6_ptr + 4 * i + 3, tl.zeros((8,), tl.int32))


@triton.jit
def _x_prep(x_ptr, xq4_ptr, s4_ptr, xq6_ptr, s6_ptr, K, Q4: tl.constexpr, Q6: tl.constexpr, USE_ASM: tl.constexpr):
    """One program a row and super-block (prep_block)."""
    prep_block(x_ptr, tl.program_id(0), tl.program_id(1), K, xq4_ptr, s4_ptr, xq6_ptr, s6_ptr, Q4, Q6, USE_ASM)


@dataclass
class Prepared:
    """x made ready once for every dp4a product over it (prep_block): for each block type asked for, the codes
    in its order and its numbers per block of 32 (None where not asked for). Made by prepare(), or empty by
    empty() for a producer of x to fill as it writes x."""
    q4: tuple[torch.Tensor, torch.Tensor] | None     # codes int8 [M, K]; (dx, bsx) float32 [M, K / 32, 2]
    q6: tuple[torch.Tensor, torch.Tensor] | None     # codes int8 [M, K]; (dx's bits, c6, c6, 0) int32 [M, K / 32, 4]

    def pointers(self) -> tuple:
        """The four tensors prep_block writes (xq4, s4, xq6, s6), another where a type is not asked for (its
        stores are compiled out), and the two flags."""
        some = (self.q4 or self.q6)[0]
        return (*(self.q4 or (some, some)), *(self.q6 or (some, some))), self.q4 is not None, self.q6 is not None


def kinds(weights) -> tuple[bool, bool]:
    """Whether products over Q4_K and over Q6_K blocks are among `weights`."""
    return any(isinstance(w, Q4KWeight) for w in weights), any(isinstance(w, Q6KWeight) for w in weights)


def empty(m: int, k: int, q4: bool, q6: bool, device) -> Prepared:
    """Room for m rows of k inputs made ready for Q4_K (q4) and Q6_K (q6) products (at least one)."""
    if not (q4 or q6):
        raise ValueError("prepare x for Q4_K or Q6_K products, or both")
    codes = lambda: torch.empty(m, k, dtype=torch.int8, device=device)       # noqa: E731
    return Prepared((codes(), torch.empty(m, k // 32, 2, dtype=torch.float32, device=device)) if q4 else None,
                    (codes(), torch.empty(m, k // 32, 4, dtype=torch.int32, device=device)) if q6 else None)


def prepare(x: torch.Tensor, weights) -> Prepared:
    """x [M, K] float32 or bfloat16 (contiguous; K a multiple of 256) for the products over `weights`
    (Q4KWeight / Q6KWeight, all of K inputs): one launch, whose result every product over x (q|k|v: Q4_K and
    Q6_K) then reads."""
    m, k = x.shape
    prep = empty(m, k, *kinds(weights), x.device)
    ptrs, q4, q6 = prep.pointers()
    if m:
        _x_prep[(m, k // 256)](x, *ptrs, k, Q4=q4, Q6=q6, USE_ASM=ASM, enable_fp_fusion=False)
    return prep


# ---- the products ----------------------------------------------------------------------------------------------

# _descending: a step's SB super-blocks are taken last first, so that no index of a step is consecutive along
# them and Triton lays the per-super-block loads (d, dmin: [BN, SB]) out as the weight words' tiles, a thread
# an output's super-block; ascending, Triton 3.6 vectorized them along SB and exchanged them through shared
# memory every step (benchmarks/cuda_sass.py: BAR, STS, LDS in the loop).

# _in_bounds: a ragged tile (outputs past N, super-blocks past the share's end) loads no masked values: its
# outputs and super-blocks are clamped to the last ones (in bounds) and their d (and dmin) set to 0, so every
# term they add is 0 (d * scale = 0 times a finite chain, dx, bsx): the loads of a ragged step are those of an
# even one, the x rows' too.

@triton.jit
def _q4_k_row(acc, R, ctx):
    """The program's row R's sub-block J of a step's super-blocks (jllm.cuda.rows; ctx: xp, sp, KW, KS, xr,
    words, scales, J, USE_ASM; its row of x r = xr[R]: its codes' words at xp [SB] + r KW + 8 J.., its (dx, bsx)
    at sp [SB] + r KS + 2 J) against the masked weight words [BN, SB] (words: l0..l3, h0..h3): one dp4a chain,
    then the sub-block's float terms (scales: d * sc, -(d * sc) * 1.5 * 2^23, -(dmin * mn)) into acc [BN, SB].
    The same operations in the same order for every row."""
    xp, sp, KW, KS, xr, words, scales, _, _ = ctx
    J: tl.constexpr = ctx[7]
    USE_ASM: tl.constexpr = ctx[8]
    xq = xp + xr[R] * KW
    s4 = sp + xr[R] * KS
    l0, l1, l2, l3, h0, h1, h2, h3 = words
    dsc, ndscm, ndmm = scales
    w = tl.load(xq[:, None] + (8 * J + tl.arange(0, 8))[None, :])
    x0, x1, x2, x3, x4, x5, x6, x7 = _eight(w, w.shape[0])
    c = _dot8(l0, l1, l2, l3, h0, h1, h2, h3, x0[None, :], x1[None, :], x2[None, :], x3[None, :], x4[None, :],
              x5[None, :], x6[None, :], x7[None, :], _MAGIC, USE_ASM)
    dx, bsx = tl.split(tl.load(s4[:, None] + (2 * J + tl.arange(0, 2))[None, :]))
    acc = tl.fma(_times(c, dsc, ndscm, USE_ASM), dx[None, :], acc)
    return tl.fma(ndmm, bsx[None, :], acc)


@triton.jit
def _total(acc, R, ctx):
    """A row's output (a step of each_row, for every row before any is stored): its sums [BN, SB] added over a
    step's super-blocks."""
    return tl.sum(acc, axis=1)


@triton.jit
def _q4_k_dp4a(xq_ptr, s4_ptr, qs_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, b_ptr, y_ptr, M, N, K, NB,
               Y_STRIDE, NB_PART, P_STRIDE, BLOCK_N: tl.constexpr, SB: tl.constexpr, ROWS: tl.constexpr,
               HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr):
    """x's codes xq (int32 words [M, K / 4], Q4_K's order) and (dx, bsx) s4 [M, K / 32, 2] -> y (the grid, the
    shares and EVEN as q4_k._q4_k_matvec's). A step is SB super-blocks of BLOCK_N outputs, an output's
    super-block to a thread, its 8 sub-blocks one after the other: its scales, mins, d and dmin are loaded once
    for its 256 weights, and each row's x words of a sub-block once for all of the thread's outputs."""
    m0 = tl.program_id(0) * ROWS
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    nn = rows
    if not EVEN:
        nn = tl.minimum(rows, N - 1)      # in bounds (see _in_bounds)
    c = (SB - 1) - tl.arange(0, SB)       # a step's super-blocks, last first (_descending)
    t = tl.arange(0, 4)
    j8 = tl.arange(0, 8)
    accs = row_sums((BLOCK_N, SB))        # each row's sums (jllm.cuda.rows)
    part = tl.program_id(2)               # this program's share of the row: super-blocks part * NB_PART on
    end = tl.minimum(NB, (part + 1) * NB_PART)
    KW = tl.multiple_of(K // 4, 64)       # x's words a row (K: a multiple of 256)
    KS = tl.multiple_of(K // 16, 16)      # s4's numbers a row
    xr = x_rows(m0, M)
    for kb in tl.range(0, tl.cdiv(NB_PART, SB), num_stages=STAGES):
        blk = part * NB_PART + kb * SB + c                      # [SB] super-blocks
        here = (live[:, None] & (blk < end)[None, :]) | EVEN
        if not EVEN:
            blk = tl.minimum(blk, NB - 1)                       # in bounds (see _in_bounds)
        at = nn[:, None] * NB + blk[None, :]                    # [BN, SB]
        d = tl.where(here, tl.load(d_ptr + at).to(tl.float32), 0.0)
        dmin = tl.where(here, tl.load(dmin_ptr + at).to(tl.float32), 0.0)
        m8 = at[:, :, None] * 8 + j8[None, None, :]                                 # [BN, SB, 8]
        scs = _eight3(tl.load(sc_ptr + m8), BLOCK_N, SB)
        mns = _eight3(tl.load(mn_ptr + m8), BLOCK_N, SB)
        qp = qs_ptr + at[:, :, None] * 32 + t[None, None, :]   # the super-blocks' words, sub-block 0
        xp = xq_ptr + blk * 64                                  # [SB] x's words of the super-blocks
        sp = s4_ptr + blk * 16                                  # and their (dx, bsx)
        for j in tl.static_range(8):                            # sub-block j of each super-block
            q = tl.load(qp + 4 * j)                                                 # int32 [BN, SB, 4]
            l0, l1, l2, l3 = _four(q & 0x0F0F0F0F, BLOCK_N, SB)                     # weights 4i + t
            h0, h1, h2, h3 = _four((q >> 4) & 0x0F0F0F0F, BLOCK_N, SB)              # weights 16 + 4i + t
            words = (l0, l1, l2, l3, h0, h1, h2, h3)
            dsc = d * scs[j].to(tl.float32)
            scales = (dsc, dsc * -12582912.0, -(dmin * mns[j].to(tl.float32)))     # exact (_times)
            accs = each_row(accs, _q4_k_row, ROWS, (xp, sp, KW, KS, xr, words, scales, j, USE_ASM))
    sums = each_row(accs, _total, ROWS, ())
    store_rows(sums, y_ptr + part * P_STRIDE + rows, live, m0, M, Y_STRIDE, ROWS, HAS_BIAS, b_ptr + rows, False)


@triton.jit
def _six(q, h):
    """A group's ql word (t = 0 or 1) and its qh word shifted for it (h << 4 for t = 0, h for t = 1) -> the
    6-bit codes of the low nibbles' weights (2i + t) and of the high ones' (8 + 2i + t), a byte each."""
    return (q & 0x0F0F0F0F) | (h & 0x30303030), ((q >> 4) & 0x0F0F0F0F) | ((h >> 2) & 0x30303030)


@triton.jit
def _q6_k_row(acc, R, ctx):
    """The program's row R's block of 32 J of a step's super-blocks (ctx as _q4_k_row's; its codes' words at
    xp [SB] + r KW + 8 J..: group 0's four, group 1's; its numbers at sp [SB] + r KS + 4 J..) against the groups'
    6-bit code words [BN, SB] (words: a0..a3, b0..b3), each group's chain from its c6, then the float terms
    (scales: d * sc and -(d * sc) * 1.5 * 2^23 of each group) into acc [BN, SB]. The same operations in the same
    order for every row."""
    xp, sp, KW, KS, xr, words, scales, _, _ = ctx
    J: tl.constexpr = ctx[7]
    USE_ASM: tl.constexpr = ctx[8]
    xq = xp + xr[R] * KW
    s6 = sp + xr[R] * KS
    a0, a1, a2, a3, b0, b1, b2, b3 = words
    dsc0, ndsc0m, dsc1, ndsc1m = scales
    w = tl.load(xq[:, None] + (8 * J + tl.arange(0, 8))[None, :])
    x0, x1, x2, x3, x4, x5, x6, x7 = _eight(w, w.shape[0])
    num = tl.load(s6[:, None] + (4 * J + tl.arange(0, 4))[None, :])
    even, odd = tl.split(tl.reshape(num, (w.shape[0], 2, 2)))
    dx, c1 = tl.split(even)
    c0, _ = tl.split(odd)
    s0 = _dot4(a0, a1, a2, a3, x0[None, :], x1[None, :], x2[None, :], x3[None, :], c0[None, :], USE_ASM)
    s1 = _dot4(b0, b1, b2, b3, x4[None, :], x5[None, :], x6[None, :], x7[None, :], c1[None, :], USE_ASM)
    v = _times(s0, dsc0, ndsc0m, USE_ASM) + _times(s1, dsc1, ndsc1m, USE_ASM)
    return tl.fma(v, dx.to(tl.float32, bitcast=True)[None, :], acc)


@triton.jit
def _q6_k_dp4a(xq_ptr, s6_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, b_ptr, y_ptr, M, N, K, NB, Y_STRIDE,
               NB_PART, P_STRIDE, BLOCK_N: tl.constexpr, SB: tl.constexpr, ROWS: tl.constexpr,
               HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr):
    """x's codes xq (int32 words [M, K / 4], Q6_K's order) and s6 [M, K / 32, 4] -> y. An output's
    super-block to a thread, as _q4_k_dp4a, its 8 blocks of 32 (two groups each: four ql words, two qh
    words, two scales) one after the other."""
    m0 = tl.program_id(0) * ROWS
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    nn = rows
    if not EVEN:
        nn = tl.minimum(rows, N - 1)      # in bounds (see _in_bounds)
    c = (SB - 1) - tl.arange(0, SB)       # a step's super-blocks, last first (_descending)
    t = tl.arange(0, 4)
    accs = row_sums((BLOCK_N, SB))
    part = tl.program_id(2)
    end = tl.minimum(NB, (part + 1) * NB_PART)
    KW = tl.multiple_of(K // 4, 64)       # x's words a row (K: a multiple of 256)
    KS = tl.multiple_of(K // 8, 32)       # s6's numbers a row
    xr = x_rows(m0, M)
    for kb in tl.range(0, tl.cdiv(NB_PART, SB), num_stages=STAGES):
        blk = part * NB_PART + kb * SB + c
        here = (live[:, None] & (blk < end)[None, :]) | EVEN
        if not EVEN:
            blk = tl.minimum(blk, NB - 1)                       # in bounds (see _in_bounds)
        at = nn[:, None] * NB + blk[None, :]
        d = tl.where(here, tl.load(d_ptr + at).to(tl.float32), 0.0)
        qp = ql_ptr + at[:, :, None] * 32 + t[None, None, :]
        g16 = at[:, :, None] * 16 + tl.arange(0, 16)[None, None, :]                 # [BN, SB, 16]
        hs = _sixteen3(tl.load(qh_ptr + g16), BLOCK_N, SB)
        scs = _sixteen3(tl.load(sc_ptr + g16), BLOCK_N, SB)
        xp = xq_ptr + blk * 64
        sp = s6_ptr + blk * 32                                  # and their numbers
        for j in tl.static_range(8):                            # block of 32 j of each super-block
            q0, q1, q2, q3 = _four(tl.load(qp + 4 * j), BLOCK_N, SB)
            h0, h1 = hs[2 * j], hs[2 * j + 1]
            dsc0 = d * scs[2 * j].to(tl.float32)
            dsc1 = d * scs[2 * j + 1].to(tl.float32)
            scales = (dsc0, dsc0 * -12582912.0, dsc1, dsc1 * -12582912.0)           # exact (_times)
            a0, a2 = _six(q0, h0 << 4)    # group 0: words lo t=0, lo t=1, hi t=0, hi t=1 (x's order)
            a1, a3 = _six(q1, h0)
            b0, b2 = _six(q2, h1 << 4)    # group 1
            b1, b3 = _six(q3, h1)
            words = (a0, a1, a2, a3, b0, b1, b2, b3)
            accs = each_row(accs, _q6_k_row, ROWS, (xp, sp, KW, KS, xr, words, scales, j, USE_ASM))
    sums = each_row(accs, _total, ROWS, ())
    store_rows(sums, y_ptr + part * P_STRIDE + rows, live, m0, M, Y_STRIDE, ROWS, HAS_BIAS, b_ptr + rows, False)


def warps(block_n: int, sb: int) -> int:
    """Warps a program: a thread an output's super-block, up to 4 warps; more outputs than that, and a thread
    takes several (sharing each row's x loads)."""
    return max(1, min(4, block_n * sb // 32))


def setting(w) -> tuple[int, int, int]:
    """(outputs a program, super-blocks a step, shares of a row) for a matrix, by its shape alone (never the row
    count: every call sums a row the same way). 64 outputs x 2 super-blocks: 128 threads, a thread an output's
    super-block (benchmarks/cuda_sass.py: ~1.2 SASS instructions a weight for one row of Q4_K, ~0.45 more a
    row). A matrix of fewer programs than the H200's 132 multiprocessors has its rows cut into shares of at least
    2 super-blocks (added in a fixed order by jllm.cuda.matvec). A guess until swept on the GPU."""
    n, k = w.shape
    nb = k // 256
    programs = triton.cdiv(n, 64)
    split = 1 if programs >= 132 else max(1, min(nb // 2, triton.cdiv(132, programs)))
    return 64, 2, split


def launch(x: torch.Tensor, w, y: torch.Tensor, block_n: int, bias: torch.Tensor | None = None, sb: int = 2,
           split: int = 1, stages: int = 1, prep: Prepared | None = None) -> None:
    """y [M, N] (rows y.stride(-2) apart: a column range of a wider output) = x W^T (+ bias); with split > 1,
    y [split, M, N] holds each share of the super-blocks' partial sums (jllm.cuda.matvec adds them). prep: x
    already prepared for w's type (else prepared here). block_n and sb powers of two, block_n * sb >= 32 (a
    thread an output's super-block at least: a tile smaller than its threads is held twice over, which gave the
    float kernels wrong sums on the H200)."""
    n, k = w.shape
    nb = w.d.shape[1]
    if block_n * sb < 32 or block_n & (block_n - 1) or sb & (sb - 1):
        raise ValueError(f"block_n {block_n} x sb {sb}: powers of two, at least 32 super-blocks a step")
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
        xq, s4 = prep.q4
        _q4_k_dp4a[grid](xq.view(torch.int32), s4, w.qs.view(torch.int32), w.d, w.dmin, w.sc, w.mn, b, y,
                         *shape, **common)
    else:
        xq, s6 = prep.q6
        _q6_k_dp4a[grid](xq.view(torch.int32), s6, w.ql.view(torch.int32), w.qh.view(torch.int32), w.sc,
                         w.d, b, y, *shape, **common)
