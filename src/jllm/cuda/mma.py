"""y = x W^T over Q4_K and Q6_K blocks on the tensor cores, for passes of up to 16 rows (decode and verify), each
row's sums its own (issue 23; off by default until timed: JLLM_MATVEC_MMA=1). x is made ready once for all the
products over it (_prep_block): by the kernel that writes it (the norms and the GLU, jllm.cuda.fused; the
attention's merge, jllm.cuda.attention; given `empty()`'s room by jllm.cuda.layers), else by one launch
(`prepare`: a head's layers, a matvec called alone).

Why: on the CUDA cores (q4_k.py, q6_k.py) every row of a verify pass pays its own floating-point work on every
weight: in SASS the Q4_K loop is 193 instructions for a thread's 32 weights with one row and 85 more for each
further row (BENCHMARKS.md, "Session 26 on the GPU"), so a pass of 4 rows costs ~1.8 decode steps and
speculation cannot pay. On the tensor cores the rows ride along in one matrix product.

How a row stays its own: every pass is one 16-row tile, its rows padded with zeros (decode too), so every call
runs the same products in the same order whatever rows share it, and a tensor-core product's output element
comes from its own row of x only.

Exact f16 operands. A weight's code times its sub-block's scale is an f16 integer (Q4_K: q * scale <= 15 * 63;
Q6_K: |(q - 32) * scale| reaches 4,096, past f16's exact integers, so its int8 scale is split, scale = 16 a + b,
a = scale >> 4, b = scale & 15, into two tiles with |.| <= 256 and <= 480). x is scaled per row and super-block
by a power of two (its largest magnitude into [2^9, 2^10): exact, and the sub-block sums stay below f16's
largest value) and split into two f16 parts, hi = f16(x) and lo = f16(x - hi), so x's 24 bits meet the codes
as ~22 of them; the power of two comes off after the super-block's products (exact). Each super-block:
    Q4_K:  acc += (d * (x . (q * scale)) - dmin * (mins . sums of x's sub-blocks)) / 2^e
    Q6_K:  acc += d * (16 x . ((q - 32) a) + x . ((q - 32) b)) / 2^e

Codes, a 32-bit word at a time (PTX, as jllm.cuda.codes does for the CUDA-core kernels): one `lop3` puts two
codes under the f16 exponent of 1024 (0x6400 | code, the f16 1024 + code; or with the code 4 bits up, 1024 +
16 code), and one `fma.rn.f16x2` takes off the 1024 and applies the scale to both: (1024 + c) s - 1024 s = c s
is an f16 integer, so the fused single rounding leaves it exact. The codes come out in the words' own order, so
_prep_block writes x in that order too (_kx: a product's position -> its weight's place in the super-block).
In Triton's interpreter (the CPU tests) shifts and masks give the same values; tests/test_cuda_ptx.py runs
the PTX itself through a small emulator of the instructions it uses.

By SASS (`python benchmarks/cuda_sass.py q4_k_mma --block-n 64 --arch 90 --num-stages 1`): Q4_K 3.85
instructions a weight for all 16 rows, Q6_K 6.75 (sm_90); the CUDA-core kernels take 6.0 and 6.25 for one row.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jllm.cuda import ptx
from jllm.cuda.codes import ASM
from jllm.cuda.q4_k import Q4KWeight
from jllm.cuda.q6_k import Q6KWeight

def _types(v: str) -> tuple:
    """JLLM_MATVEC_MMA: 1 (Q4_K and Q6_K products on the tensor cores), q4_k or q6_k (that type only, the other
    on the CUDA cores), 0 (none). A matrix's kernel is the same for every row count whatever the choice, so
    rows stay their own (session 28: Q6_K's one-row products, the output layer's above all, are ~3x slower on
    the tensor cores, while Q4_K's cost about the same for 1 to 16 rows)."""
    table = {"1": (Q4KWeight, Q6KWeight), "q4_k": (Q4KWeight,), "q6_k": (Q6KWeight,), "0": ()}
    if v.lower() not in table:
        raise ValueError(f"JLLM_MATVEC_MMA={v!r}: 1, q4_k, q6_k or 0")
    return table[v.lower()]


TYPES = _types(os.environ.get("JLLM_MATVEC_MMA", "0"))     # the block types whose products run here (none: off)
ROWS = 16                   # every pass is one tile of 16 rows (tl.dot's least)
BLOCK_N = 64                # outputs a program: x's tile is read once for these (SASS, sm_90, before the row
                            # masks: 3.6 / 6.5 instructions a weight at 64, 8.9 / 18 at 32, 3.5 / 8.8 at 128)


@triton.jit
def _kx(f, KIND: tl.constexpr):
    """Position f (0..255) of a super-block's product -> its weight's place in the super-block: the order the
    codes come out of _q4_codes / _q6_codes and _join8. Q4_K: f = 32 s + 8 t + r, nibble p of sub-block s's
    word t with p = r's 3 bits reversed (byte p // 2, high nibble if p is odd; q4_k.pack_codes: weight 4 i + t,
    + 16 if high). Q6_K: f = 16 g + 8 c0 + 4 c1 + 2 t + h, half h of pair P = c0 + 2 c1 of group g's word t
    (pair P: byte 2 h + P % 2, its high nibble if P > 1; q6_k.pack_codes: byte i of word t holds weight
    2 i + t low, 8 + 2 i + t high)."""
    if KIND == 4:
        r = f % 8
        p = (r & 1) * 4 + (r & 2) + (r >> 2)
        return (f // 32) * 32 + (p % 2) * 16 + (p // 2) * 4 + (f // 8) % 4
    else:
        r = f % 16
        return (f // 16) * 16 + ((r >> 2) & 1) * 8 + (r & 1) * 4 + (r >> 3) * 2 + ((r >> 1) & 1)


@triton.jit
def _prep_block(x_ptr, r, kb, K, NB, xh4_ptr, xl4_ptr, sh_ptr, sl_ptr, xh6_ptr, xl6_ptr, inv_ptr, Q4: tl.constexpr,
                Q6: tl.constexpr):
    """Super-block kb of row r of x [M, K] f32 made ready for the tensor-core products: a power of two 2^e
    putting its largest magnitude into [2^9, 2^10) (inv [M, NB]: 2^-e), and x * 2^e's f16 halves [M, K] in
    the codes' order of Q4_K (xh4, xl4, with the halves of its sums over each sub-block of 32, sh, sl
    [M, NB * 16]: a super-block's 8 sums, then 8 zeros, as the mins' product needs K = 16) and of Q6_K (xh6,
    xl6), as asked (_kx)."""
    f = tl.arange(0, 256)
    row = x_ptr + r * K + kb * 256
    top = tl.max(tl.abs(tl.load(row + f)), axis=0)
    e = tl.minimum(tl.maximum(136 - ((top.to(tl.int32, bitcast=True) >> 23) & 255), -126), 126)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)                  # x * scale: exact, a power of two
    tl.store(inv_ptr + r * NB + kb, ((127 - e) << 23).to(tl.float32, bitcast=True))
    at = r * K + kb * 256 + f
    if Q4:
        x = tl.load(row + _kx(f, 4)) * scale
        hi = x.to(tl.float16)
        tl.store(xh4_ptr + at, hi)
        tl.store(xl4_ptr + at, (x - hi.to(tl.float32)).to(tl.float16))
        sums = tl.sum(tl.reshape(x, (8, 32)), axis=1)                        # [8]: f's sub-blocks are 32 apart
        j = tl.arange(0, 16)
        s16 = tl.sum(tl.where(j[:, None] == tl.arange(0, 8)[None, :], sums[None, :], 0.0), axis=1)   # 8 zeros
        shi = s16.to(tl.float16)
        tl.store(sh_ptr + r * (NB * 16) + kb * 16 + j, shi)
        tl.store(sl_ptr + r * (NB * 16) + kb * 16 + j, (s16 - shi.to(tl.float32)).to(tl.float16))
    if Q6:
        x = tl.load(row + _kx(f, 6)) * scale
        hi = x.to(tl.float16)
        tl.store(xh6_ptr + at, hi)
        tl.store(xl6_ptr + at, (x - hi.to(tl.float32)).to(tl.float16))


@triton.jit
def _x_prep(x_ptr, xh4_ptr, xl4_ptr, sh_ptr, sl_ptr, xh6_ptr, xl6_ptr, inv_ptr, K, NB, Q4: tl.constexpr,
            Q6: tl.constexpr):
    """One program a row and super-block (_prep_block): x made ready for every product over it in one call."""
    _prep_block(x_ptr, tl.program_id(0), tl.program_id(1), K, NB, xh4_ptr, xl4_ptr, sh_ptr, sl_ptr, xh6_ptr,
                xl6_ptr, inv_ptr, Q4, Q6)


@triton.jit
def _join8(o0, o1, o2, o3, o4, o5, o6, o7):
    """8 tensors [..] -> one [.., 2, 2, 2], tensor i at index (i & 1, (i >> 1) & 1, i >> 2): tl.join adds its
    new axis last, so the last axis tells the outermost join's halves apart."""
    return tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))


_Q4_ASM: tl.constexpr = tl.constexpr(ptx.Q4_K_CODES)
_Q4_CONSTRAINTS: tl.constexpr = tl.constexpr(",".join(["=h"] * 8 + ["r", "h", "h"]))


@triton.jit
def _q4_codes(w, s, USE_ASM: tl.constexpr):
    """int32 words [..] of 8 nibbles, their sub-block's scale s (f16 [..]) -> 8 f16 [..]: nibble p times s
    (ptx.Q4_K_CODES; its two codes of one register go to outputs 4 apart, which _join8 puts next to each other,
    so they stay paired on their way to the product: in SASS 13 byte permutes a step instead of ~100)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_Q4_ASM, _Q4_CONSTRAINTS, [w, s, s * 0.0625],
                                         dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        return (((w >> 0) & 15).to(tl.float16) * s, ((w >> 4) & 15).to(tl.float16) * s,
                ((w >> 8) & 15).to(tl.float16) * s, ((w >> 12) & 15).to(tl.float16) * s,
                ((w >> 16) & 15).to(tl.float16) * s, ((w >> 20) & 15).to(tl.float16) * s,
                ((w >> 24) & 15).to(tl.float16) * s, ((w >> 28) & 15).to(tl.float16) * s)


_Q6_ASM: tl.constexpr = tl.constexpr(ptx.Q6_K_CODES)
_Q6_CONSTRAINTS: tl.constexpr = tl.constexpr(",".join(["=h"] * 32 + ["r"] * 3 + ["h"] * 8))


@triton.jit
def _six(q, h, T: tl.constexpr, P: tl.constexpr, H: tl.constexpr, s):
    """(code - 32) * s of half H of pair P of ql word T (the interpreter's way; see _Q6_ASM)."""
    byte = 2 * H + P % 2
    high = P // 2
    lo = (q >> (8 * byte + 4 * high)) & 15
    hb = (h >> (4 * T + 8 * byte + 2 * high)) & 3
    return ((lo | (hb << 4)) - 32).to(tl.float16) * s


@triton.jit
def _q6_codes(q0, q1, h, a, b, USE_ASM: tl.constexpr):
    """A group's two ql words, its qh word, the halves a, b of its scale (f16) -> 32 f16: (code - 32) * a of
    half h of pair P of word t at 8 h + 4 t + P (ptx.Q6_K_CODES), then (code - 32) * b in the same order."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            _Q6_ASM, _Q6_CONSTRAINTS, [q0, q1, h, a, a * -1056.0, a * 0.0625, a * -96.0, b, b * -1056.0, b * 0.0625,
                                       b * -96.0], dtype=(tl.float16,) * 32, is_pure=True, pack=1)
    else:
        return (_six(q0, h, 0, 0, 0, a), _six(q0, h, 0, 1, 0, a), _six(q0, h, 0, 2, 0, a), _six(q0, h, 0, 3, 0, a),
                _six(q1, h, 1, 0, 0, a), _six(q1, h, 1, 1, 0, a), _six(q1, h, 1, 2, 0, a), _six(q1, h, 1, 3, 0, a),
                _six(q0, h, 0, 0, 1, a), _six(q0, h, 0, 1, 1, a), _six(q0, h, 0, 2, 1, a), _six(q0, h, 0, 3, 1, a),
                _six(q1, h, 1, 0, 1, a), _six(q1, h, 1, 1, 1, a), _six(q1, h, 1, 2, 1, a), _six(q1, h, 1, 3, 1, a),
                _six(q0, h, 0, 0, 0, b), _six(q0, h, 0, 1, 0, b), _six(q0, h, 0, 2, 0, b), _six(q0, h, 0, 3, 0, b),
                _six(q1, h, 1, 0, 0, b), _six(q1, h, 1, 1, 0, b), _six(q1, h, 1, 2, 0, b), _six(q1, h, 1, 3, 0, b),
                _six(q0, h, 0, 0, 1, b), _six(q0, h, 0, 1, 1, b), _six(q0, h, 0, 2, 1, b), _six(q0, h, 0, 3, 1, b),
                _six(q1, h, 1, 0, 1, b), _six(q1, h, 1, 1, 1, b), _six(q1, h, 1, 2, 1, b), _six(q1, h, 1, 3, 1, b))


@triton.jit(do_not_specialize=["M"])      # M = 1 (decode) must run verify's binary: one kernel, one rounding
def _q4_k_mma(xh_ptr, xl_ptr, sh_ptr, sl_ptr, inv_ptr, qs_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, b_ptr, y_ptr, M,
              N, K, NB, Y_STRIDE, NB_PART, P_STRIDE, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
              USE_ASM: tl.constexpr):
    """A super-block a step, the weights as the product's first operand ([BLOCK_N, 256] x [256, 16 rows]): its
    codes times their sub-block's 6-bit scale against x's halves, times d after; the mins' term a product of
    the 6-bit mins with the halves of x's sub-block sums, times dmin; both times the super-block's 2^-e."""
    pid_n = tl.program_id(0)
    part = tl.program_id(1)                        # this program's share of the row's super-blocks
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < N
    nn = tl.minimum(n, N - 1)                      # rows past N read the last one (in bounds), are not stored
    m = tl.arange(0, 16)
    here = (m < M)[None, :]                        # x's rows past M: zeros (tile rows of no row of x)
    f = tl.arange(0, 256)
    j16 = tl.arange(0, 16)
    word = 4 * tl.arange(0, 8)[:, None] + tl.arange(0, 4)[None, :]                 # [8, 4]: sub-block s, word t
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for kb in range(part * NB_PART, tl.minimum(NB, (part + 1) * NB_PART)):
        w = tl.load(qs_ptr + nn[:, None, None] * (NB * 32) + kb * 32 + word[None])               # [BN, 8, 4]
        sc = tl.load(sc_ptr + nn[:, None] * (NB * 8) + kb * 8 + tl.arange(0, 8)[None, :]).to(tl.float16)
        o = _q4_codes(w, tl.broadcast_to(sc[:, :, None], (BLOCK_N, 8, 4)), USE_ASM)
        q = tl.reshape(_join8(o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]), (BLOCK_N, 256))    # f = 32 s + 8 t + p
        at = m[None, :] * K + kb * 256 + f[:, None]                                              # [256, 16]
        p = tl.dot(q, tl.load(xh_ptr + at, mask=here, other=0.0), out_dtype=tl.float32)
        p = tl.dot(q, tl.load(xl_ptr + at, mask=here, other=0.0), p, out_dtype=tl.float32)
        mn = tl.load(mn_ptr + nn[:, None] * (NB * 8) + kb * 8 + j16[None, :], mask=(j16 < 8)[None, :],
                     other=0).to(tl.float16)                                                     # [BN, 16]
        sat = m[None, :] * (NB * 16) + kb * 16 + j16[:, None]                                    # [16, 16]
        mins = tl.dot(mn, tl.load(sh_ptr + sat, mask=here, other=0.0), out_dtype=tl.float32)
        mins = tl.dot(mn, tl.load(sl_ptr + sat, mask=here, other=0.0), mins, out_dtype=tl.float32)
        d = tl.load(d_ptr + nn * NB + kb).to(tl.float32)
        dmin = tl.load(dmin_ptr + nn * NB + kb).to(tl.float32)
        acc += (p * d[:, None] - mins * dmin[:, None]) * tl.load(inv_ptr + m * NB + kb, mask=m < M, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + nn)[:, None]
    tl.store(y_ptr + part * P_STRIDE + m[None, :] * Y_STRIDE + n[:, None], acc, mask=(m < M)[None, :] & live[:, None])


@triton.jit(do_not_specialize=["M"])
def _q6_k_mma(xh_ptr, xl_ptr, inv_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, b_ptr, y_ptr, M, N, K, NB, Y_STRIDE,
              NB_PART, P_STRIDE, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr):
    """A super-block a step, the weights as the first operand: the codes minus 32 times a and times b (the
    halves of the int8 scale) against x's halves, d * (16 * the first + the second) * 2^-e after."""
    pid_n = tl.program_id(0)
    part = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < N
    nn = tl.minimum(n, N - 1)
    m = tl.arange(0, 16)
    here = (m < M)[None, :]
    f = tl.arange(0, 256)
    g = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for kb in range(part * NB_PART, tl.minimum(NB, (part + 1) * NB_PART)):
        ql = ql_ptr + nn[:, None] * (NB * 32) + kb * 32 + 2 * g[None, :]                         # [BN, 16]
        hw = tl.load(qh_ptr + nn[:, None] * (NB * 16) + kb * 16 + g[None, :])
        sc = tl.load(sc_ptr + nn[:, None] * (NB * 16) + kb * 16 + g[None, :]).to(tl.int32)
        o = _q6_codes(tl.load(ql), tl.load(ql + 1), hw, (sc >> 4).to(tl.float16), (sc & 15).to(tl.float16), USE_ASM)
        qa = tl.reshape(tl.join(_join8(o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]),
                                _join8(o[8], o[9], o[10], o[11], o[12], o[13], o[14], o[15])), (BLOCK_N, 256))
        qb = tl.reshape(tl.join(_join8(o[16], o[17], o[18], o[19], o[20], o[21], o[22], o[23]),
                                _join8(o[24], o[25], o[26], o[27], o[28], o[29], o[30], o[31])), (BLOCK_N, 256))
        at = m[None, :] * K + kb * 256 + f[:, None]
        xh = tl.load(xh_ptr + at, mask=here, other=0.0)
        xl = tl.load(xl_ptr + at, mask=here, other=0.0)
        pa = tl.dot(qa, xh, out_dtype=tl.float32)
        pa = tl.dot(qa, xl, pa, out_dtype=tl.float32)
        pb = tl.dot(qb, xh, out_dtype=tl.float32)
        pb = tl.dot(qb, xl, pb, out_dtype=tl.float32)
        d = tl.load(d_ptr + nn * NB + kb).to(tl.float32)
        acc += (16.0 * pa + pb) * d[:, None] * tl.load(inv_ptr + m * NB + kb, mask=m < M, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + nn)[:, None]
    tl.store(y_ptr + part * P_STRIDE + m[None, :] * Y_STRIDE + n[:, None], acc, mask=(m < M)[None, :] & live[:, None])


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int | None) -> int:
    device = index if index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(device).multi_processor_count


def setting(w) -> tuple[int, int]:
    """(outputs a program, shares of a row) for a matrix, by its shape and the device alone (never the row
    count: every call sums a row the same way). BLOCK_N outputs a program; a matrix of fewer programs than the
    chip has multiprocessors has its rows cut into shares (added in a fixed order by jllm.cuda.matvec) until
    it has about as many: q|k|v, attn_output and ffn_down of the 1.5B give 28, 4, 24 and 24 programs whole on
    the H200's 132. A guess to be swept on the GPU (benchmarks/cuda_matvec.py with JLLM_MATVEC_MMA=1)."""
    n, k = w.shape
    nb = k // 256
    programs = triton.cdiv(n, BLOCK_N)
    sms = _multiprocessors(w.d.device.index) if w.d.is_cuda else 132
    if programs >= sms // 2:
        return BLOCK_N, 1
    per = triton.cdiv(nb, min(nb, triton.cdiv(sms, programs)))                # super-blocks a share
    return BLOCK_N, triton.cdiv(nb, per)


def handles(x: torch.Tensor, w) -> bool:
    """Whether this pass runs here: enabled for its block type (TYPES), at most 16 rows."""
    return isinstance(w, TYPES) and x.shape[0] <= ROWS


@dataclass
class Prepared:
    """x made ready once for every tensor-core product over it in one call (_prep_block): its scales, and its
    halves in the order of each block type asked for (None where not). Made by prepare(), or empty by
    empty() for a producer of x to fill as it writes x (jllm.cuda.fused: the norms, the GLU)."""
    inv: torch.Tensor
    q4: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None      # xh, xl, sums' hi, lo
    q6: tuple[torch.Tensor, torch.Tensor] | None                                  # xh, xl

    def pointers(self) -> tuple:
        """The seven tensors _prep_block writes (xh4, xl4, sh, sl, xh6, xl6, inv), inv where a type is not asked
        for (its stores are compiled out), and the two flags."""
        a, b = self.q4 or (self.inv,) * 4, self.q6 or (self.inv,) * 2
        return (*a, *b, self.inv), self.q4 is not None, self.q6 is not None


def kinds(weights) -> tuple[bool, bool]:
    """Whether products over Q4_K and over Q6_K blocks are among `weights`."""
    return any(isinstance(w, Q4KWeight) for w in weights), any(isinstance(w, Q6KWeight) for w in weights)


def empty(m: int, k: int, q4: bool, q6: bool, device) -> Prepared:
    """Room for m rows of k inputs made ready for Q4_K (q4) and Q6_K (q6) products."""
    half = dict(dtype=torch.float16, device=device)
    nb = k // 256
    return Prepared(torch.empty(m, nb, dtype=torch.float32, device=device),
                    (torch.empty(m, k, **half), torch.empty(m, k, **half), torch.empty(m, nb * 16, **half),
                     torch.empty(m, nb * 16, **half)) if q4 else None,
                    (torch.empty(m, k, **half), torch.empty(m, k, **half)) if q6 else None)


def prepare(x: torch.Tensor, weights) -> Prepared:
    """x [M <= 16, K] f32 (contiguous) for the products over `weights` (Q4KWeight / Q6KWeight, all of K inputs):
    one launch. Every part of a layer (q|k|v: Q4_K and Q6_K) then reads the same prepared x."""
    m, k = x.shape
    prep = empty(m, k, *kinds(weights), x.device)
    ptrs, q4, q6 = prep.pointers()
    _x_prep[(m, k // 256)](x, *ptrs, k, k // 256, Q4=q4, Q6=q6)
    return prep


def launch(x: torch.Tensor, w, y: torch.Tensor, block_n: int, bias: torch.Tensor | None = None, sb: int = 1,
           split: int = 1, stages: int = 1, prep: Prepared | None = None) -> None:
    """y [M, N] (rows y.stride(-2) apart) = x W^T (+ bias); with split > 1, y [split, M, N] holds each share's
    partial sums (jllm.cuda.matvec adds them). prep: x already prepared for w's type (else prepared here). sb,
    stages: the CUDA-core kernels' (unused here)."""
    n, k = w.shape
    nb = w.d.shape[1]
    part = -(-nb // split)
    q4 = isinstance(w, Q4KWeight)
    if prep is None or (prep.q4 if q4 else prep.q6) is None:
        prep = prepare(x, [w])
    grid = (triton.cdiv(n, block_n), split)
    b = y if bias is None else bias
    # one stage: Triton's pipelining would hold ~200 KB of shared memory at 64 outputs, past sm_80's 164 KB
    common = dict(BLOCK_N=block_n, HAS_BIAS=bias is not None, USE_ASM=ASM, num_warps=4, num_stages=1)
    p_stride = y.stride(0) if split > 1 else 0
    if q4:
        xh, xl, sh, sl = prep.q4
        _q4_k_mma[grid](xh, xl, sh, sl, prep.inv, w.qs.view(torch.int32), w.d, w.dmin, w.sc, w.mn, b, y,
                        x.shape[0], n, k, nb, y.stride(-2), part, p_stride, **common)
    else:
        xh, xl = prep.q6
        _q6_k_mma[grid](xh, xl, prep.inv, w.ql.view(torch.int32), w.qh.view(torch.int32), w.sc, w.d, b, y,
                        x.shape[0], n, k, nb, y.stride(-2), part, p_stride, **common)
