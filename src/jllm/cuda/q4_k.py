"""Q4_K weights on the GPU at about their GGUF size, and y = x W^T over them in Triton (issue 23).

Layout (`Q4KWeight.from_gguf`, made once at load): a Q4_K super-block of 256 weights is 144 bytes in the file
(d and dmin f16, eight 6-bit scale and min codes packed in 12 bytes, 128 bytes of 4-bit codes). On the device
the header is unpacked once: d, dmin [N, K/256] f16 and the scale and min codes [N, K/256, 8] uint8, 148 bytes a
block (1.03x the file's). The codes are repacked for the kernel, qs [N, K/2] uint8: each sub-block of 32 weights
(one scale, one min) is four 32-bit words, and word t holds weight 4i + t in the low nibble of its byte i and
weight 16 + 4i + t in the high nibble. So one mask of a word gives four codes a byte (jllm.cuda.codes turns
them into floats), and the four words of a sub-block meet x at four consecutive positions per code slot, one
vector load of x for four words.

The kernel (`launch`, called by jllm.cuda.matvec) computes each output y[m, n] from its own row x[m] only, with one
fixed order of operations whatever the number of rows M: one program per (up to 8 rows of x, each with its own sums:
jllm.cuda.rows; BLOCK_N outputs), a loop over the super-blocks, SB of them a step; per word the eight codes'
products with x summed into the word's own float32 sum, then d * scale * that - dmin * min * (x's sum over the
word's positions), the dequantized weights' dot product factored. So a verify pass over k + 1 rows gives each row
the logits of a pass over that row alone, bit for bit, which exact speculation on the GPU needs
(tests/test_cuda_matvec.py). Without a GPU the same kernel runs in Triton's interpreter (TRITON_INTERPRET=1), which
is how the tests check it on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gguf import GGMLQuantizationType as T

from jllm.cuda.codes import ASM, as_float, byte_floats, warps
from jllm.cuda.layout import file_blocks, nbytes
from jllm.cuda.rows import each_row, row_sums, rows_a_program, store_rows, x_row
from jllm.gguf.quants import k_scale_codes


@dataclass
class Q4KWeight:
    qs: torch.Tensor       # uint8 [N, K / 2]
    d: torch.Tensor        # float16 [N, K / 256]
    dmin: torch.Tensor     # float16 [N, K / 256]
    sc: torch.Tensor       # uint8 [N, K / 256, 8]
    mn: torch.Tensor       # uint8 [N, K / 256, 8]

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 2

    def nbytes(self) -> int:
        return nbytes(self.qs, self.d, self.dmin, self.sc, self.mn)

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, shape: tuple[int, int], device: str | torch.device = "cpu") -> "Q4KWeight":
        """raw: the tensor's Q4_K bytes (uint8, N * K / 256 * 144 of them), shape (N, K) -> the device layout."""
        b = file_blocks(raw, T.Q4_K, shape)
        n, nb = b.shape[:2]
        b = b.reshape(n * nb, -1)
        d, dmin, sc, mn = k_scale_codes(b)
        return cls(qs=pack_codes(b[:, 16:]).reshape(n, nb * 128).to(device),
                   d=d.to(torch.float16).view(n, nb).to(device), dmin=dmin.to(torch.float16).view(n, nb).to(device),
                   sc=sc.reshape(n, nb, 8).contiguous().to(device), mn=mn.reshape(n, nb, 8).contiguous().to(device))


def pack_codes(qs: torch.Tensor) -> torch.Tensor:
    """The file's code bytes [R, 128] of R super-blocks (byte 32c + l: weight 64c + l low, 64c + 32 + l high)
    -> the device's [R, 128]: sub-block s's bytes 16s + 4t + i hold weight 4i + t (low) and 16 + 4i + t (high)."""
    r = qs.shape[0]
    q = qs.reshape(r, 4, 1, 32)
    codes = torch.cat([q & 15, q >> 4], dim=2).reshape(r, 8, 8, 4)          # [R, sub-block, slot j, word t]
    packed = codes[:, :, :4] | (codes[:, :, 4:] << 4)                       # [R, s, byte i, word t]
    return packed.transpose(2, 3).contiguous().reshape(r, 128)


@triton.jit
def _q4_k_row(acc, R, ctx):
    """The program's row R's part of a step (jllm.cuda.rows), added to its sums acc; ctx: x_ptr, m0, M, K, xo,
    ok, f, dsc, dmm: the eight code slots' floats f = f0..f7 [BN, S, 4] (slot j of word t: weight 4j + t of its
    sub-block, for j < 4; 16 + 4(j - 4) + t after) against x at offsets xo [S, 4]. The same operations in the
    same order for every row: a row's sum never depends on the rows beside it in the program."""
    x_ptr, m0, M, K, xo, ok, f, dsc, dmm = ctx
    f0, f1, f2, f3, f4, f5, f6, f7 = f
    x_ptr += x_row(m0, R, M) * K
    ok = ok[:, None]
    xs = tl.load(x_ptr + xo, mask=ok, other=0.0)
    sw = f0 * xs[None, :, :]
    xj = tl.load(x_ptr + xo + 4, mask=ok, other=0.0)
    xs += xj
    sw += f1 * xj[None, :, :]
    xj = tl.load(x_ptr + xo + 8, mask=ok, other=0.0)
    xs += xj
    sw += f2 * xj[None, :, :]
    xj = tl.load(x_ptr + xo + 12, mask=ok, other=0.0)
    xs += xj
    sw += f3 * xj[None, :, :]
    xj = tl.load(x_ptr + xo + 16, mask=ok, other=0.0)
    xs += xj
    sw += f4 * xj[None, :, :]
    xj = tl.load(x_ptr + xo + 20, mask=ok, other=0.0)
    xs += xj
    sw += f5 * xj[None, :, :]
    xj = tl.load(x_ptr + xo + 24, mask=ok, other=0.0)
    xs += xj
    sw += f6 * xj[None, :, :]
    xj = tl.load(x_ptr + xo + 28, mask=ok, other=0.0)
    xs += xj
    sw += f7 * xj[None, :, :]
    return acc + (dsc[:, :, None] * sw - dmm[:, :, None] * xs[None, :, :])


@triton.jit
def _q4_k_matvec(x_ptr, qs_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, b_ptr, y_ptr, M, N, K, NB, Y_STRIDE,
                 NB_PART, P_STRIDE, BLOCK_N: tl.constexpr, SB: tl.constexpr, ROWS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr):
    m0 = tl.program_id(0) * ROWS          # rows m0 .. m0 + ROWS - 1 of x (those below M) share the program: the
    pid_n = tl.program_id(1)              # weights are read and unpacked once for all of them
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    S: tl.constexpr = 8 * SB              # sub-blocks of 32 weights a step
    s = tl.arange(0, S)
    t = tl.arange(0, 4)                   # a sub-block's four words
    accs = row_sums((BLOCK_N, S, 4))      # each row's sums: its operations are the one-row program's, in order
    part = tl.program_id(2)               # this program's share of the row: super-blocks part * NB_PART on
    end = tl.minimum(NB, (part + 1) * NB_PART) * 8
    for kb in tl.range(0, tl.cdiv(NB_PART, SB), num_stages=STAGES):   # STAGES > 1: later steps in flight
        sub = part * NB_PART * 8 + kb * S + s                   # the row's sub-block ids this step
        ok = (sub < end) | EVEN                                 # the last step may hold fewer
        m2 = (live[:, None] & ok[None, :]) | EVEN              # EVEN: the tiles fill the matrix, no masks
        q = tl.load(qs_ptr + rows[:, None, None] * (NB * 32) + sub[None, :, None] * 4 + t[None, None, :],
                    mask=m2[:, :, None], other=0)                                   # int32 [BN, S, 4]
        lo = byte_floats(q & 0x0F0F0F0F, USE_ASM)               # slots 0..3
        hi = byte_floats((q >> 4) & 0x0F0F0F0F, USE_ASM)        # slots 4..7
        f = (as_float(lo[0], 0.0), as_float(lo[1], 0.0), as_float(lo[2], 0.0), as_float(lo[3], 0.0),
             as_float(hi[0], 0.0), as_float(hi[1], 0.0), as_float(hi[2], 0.0), as_float(hi[3], 0.0))
        meta = rows[:, None] * (NB * 8) + sub[None, :]
        sc = tl.load(sc_ptr + meta, mask=m2, other=0).to(tl.float32)
        mn = tl.load(mn_ptr + meta, mask=m2, other=0).to(tl.float32)
        blk = rows[:, None] * NB + sub[None, :] // 8
        dsc = tl.load(d_ptr + blk, mask=m2, other=0.0).to(tl.float32) * sc
        dmm = tl.load(dmin_ptr + blk, mask=m2, other=0.0).to(tl.float32) * mn
        xo = sub[:, None] * 32 + t[None, :]                     # slot j of word t: weight 4j + t (+ 16)
        accs = each_row(accs, _q4_k_row, ROWS, (x_ptr, m0, M, K, xo, ok, f, dsc, dmm))
    store_rows(accs, y_ptr + part * P_STRIDE + rows, live, m0, M, Y_STRIDE, ROWS, HAS_BIAS, b_ptr + rows, True)


def launch(x: torch.Tensor, w: Q4KWeight, y: torch.Tensor, block_n: int, bias: torch.Tensor | None = None,
           sb: int = 2, split: int = 1, stages: int = 1) -> None:
    """y [M, N] (rows y.stride(0) apart: a column range of a wider output) = x W^T (+ bias); with split > 1,
    y [split, M, N] holds each share of the super-blocks' partial sums (jllm.cuda.matvec adds them)."""
    n, k = w.shape
    nb = w.d.shape[1]
    part = -(-nb // split)
    r = rows_a_program(x.shape[0])
    grid = (triton.cdiv(x.shape[0], r), triton.cdiv(n, block_n), split)
    _q4_k_matvec[grid](x, w.qs.view(torch.int32), w.d, w.dmin, w.sc, w.mn, y if bias is None else bias, y,
                       x.shape[0], n, k, nb, y.stride(-2), part, y.stride(0) if split > 1 else 0, BLOCK_N=block_n,
                       SB=sb, ROWS=r, HAS_BIAS=bias is not None, USE_ASM=ASM,
                       EVEN=n % block_n == 0 and part % sb == 0 and part * split == nb, STAGES=stages,
                       num_warps=warps(block_n, sb))


@triton.jit
def _q4_k_dequantize(ids_ptr, qs_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, w_ptr, N, NB, BLOCK_N: tl.constexpr,
                     GATHER: tl.constexpr, USE_ASM: tl.constexpr):
    """Output rows pid_n * BLOCK_N .. (of N), super-block kb: matrix rows themselves, or with GATHER the rows
    ids[...]; in w_ptr's type. d * scale * q is exact in float32 (11 + 6 + 4 bits), so a float32 value has one
    rounding, fused or not, as on the CPU (jllm.gguf.quants)."""
    pid_n = tl.program_id(0)
    kb = tl.program_id(1)
    out_rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = out_rows < N
    if GATHER:
        rows = tl.load(ids_ptr + out_rows, mask=live, other=0).to(tl.int64)
    else:
        rows = out_rows
    s = tl.arange(0, 8)
    t = tl.arange(0, 4)
    m3 = live[:, None, None]
    q = tl.load(qs_ptr + rows[:, None, None] * (NB * 32) + kb * 32 + s[None, :, None] * 4 + t[None, None, :],
                mask=m3, other=0)
    meta = (rows[:, None] * NB + kb) * 8 + s[None, :]
    ds = (tl.load(d_ptr + rows * NB + kb, mask=live, other=0.0).to(tl.float32)[:, None]
          * tl.load(sc_ptr + meta, mask=live[:, None], other=0).to(tl.float32))[:, :, None]
    dm = (tl.load(dmin_ptr + rows * NB + kb, mask=live, other=0.0).to(tl.float32)[:, None]
          * tl.load(mn_ptr + meta, mask=live[:, None], other=0).to(tl.float32))[:, :, None]
    lo = byte_floats(q & 0x0F0F0F0F, USE_ASM)
    hi = byte_floats((q >> 4) & 0x0F0F0F0F, USE_ASM)
    at = out_rows[:, None, None] * (NB * 256) + kb * 256 + s[None, :, None] * 32 + t[None, None, :]
    ty = w_ptr.dtype.element_ty
    for j in tl.static_range(4):
        tl.store(w_ptr + at + 4 * j, (ds * as_float(lo[j], 0.0) - dm).to(ty), mask=m3)
        tl.store(w_ptr + at + 16 + 4 * j, (ds * as_float(hi[j], 0.0) - dm).to(ty), mask=m3)


def _launch_dequantize(w: Q4KWeight, out: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    n = out.shape[0]
    if n:
        _q4_k_dequantize[(triton.cdiv(n, 16), w.d.shape[1])](w.d if ids is None else ids, w.qs.view(torch.int32),
                                                              w.d, w.dmin, w.sc, w.mn, out, n, w.d.shape[1],
                                                              BLOCK_N=16, GATHER=ids is not None, USE_ASM=ASM)
    return out


def dequantize(w: Q4KWeight) -> torch.Tensor:
    """The matrix in float16 [N, K] (a prefill's matrix product on the tensor cores)."""
    n, k = w.shape
    return _launch_dequantize(w, torch.empty(n, k, dtype=torch.float16, device=w.qs.device), None)


def rows(w: Q4KWeight, ids: torch.Tensor) -> torch.Tensor:
    """The rows ids (int64 on w's device) dequantized to float32 [len(ids), K], bitwise the CPU's values
    (jllm.gguf.quants): the embedding lookup on the device (jllm.cuda.embedding)."""
    return _launch_dequantize(w, torch.empty(ids.shape[0], w.shape[1], dtype=torch.float32, device=w.qs.device),
                              ids)
