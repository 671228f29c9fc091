"""Q6_K weights on the GPU at their GGUF size, and the Triton kernel of y = x W^T over them (see q4_k.py for
the row-independence this keeps).

Layout (`Q6KWeight.from_gguf`): a Q6_K super-block of 256 weights is 210 bytes (ql[128]: the low 4 bits,
qh[64]: the high 2, 16 int8 scales, d f16); on the device the same bytes split by field and the codes repacked
for the kernel (1.00x the file's): scales [N, K/256, 16] int8, d [N, K/256] f16, and per group of 16 weights
(one scale) two ql words and one qh word, ql [N, K/2] and qh [N, K/4]. ql word t (0, 1) of a group holds the
low bits of weight 2i + t in the low nibble of its byte i and of weight 8 + 2i + t in the high nibble; byte i
of the qh word holds the high bits of weights 2i, 8 + 2i, 2i + 1, 9 + 2i at bits 0, 2, 4, 6. So a mask and a
shift or two give a word's four codes a byte (jllm.cuda.codes), and code slot j of word t meets x at 2j + t.
Value = (d * scale) * (q - 32) in float32, as jllm.gguf.quants decodes it. The kernel takes SB super-blocks of
each output row a step, per word the eight codes' products with x summed, times d * scale.
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


@dataclass
class Q6KWeight:
    ql: torch.Tensor       # uint8 [N, K / 2]
    qh: torch.Tensor       # uint8 [N, K / 4]
    sc: torch.Tensor       # int8 [N, K / 256, 16]
    d: torch.Tensor        # float16 [N, K / 256]

    @property
    def shape(self) -> tuple[int, int]:
        return self.ql.shape[0], self.ql.shape[1] * 2

    def nbytes(self) -> int:
        return nbytes(self.ql, self.qh, self.sc, self.d)

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, shape: tuple[int, int], device: str | torch.device = "cpu") -> "Q6KWeight":
        """raw: the tensor's Q6_K bytes (uint8, N * K / 256 * 210 of them), shape (N, K) -> the device layout."""
        b = file_blocks(raw, T.Q6_K, shape)
        n, nb = b.shape[:2]
        ql, qh = pack_codes(b.reshape(n * nb, -1))
        return cls(ql=ql.reshape(n, nb * 128).to(device), qh=qh.reshape(n, nb * 64).to(device),
                   sc=b[:, :, 192:208].contiguous().view(torch.int8).to(device),
                   d=b[:, :, 208:210].contiguous().view(torch.float16).reshape(n, nb).to(device))


def pack_codes(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """R file blocks [R, 210] -> the device's code bytes (ql [R, 128], qh [R, 64]; see the module's doc)."""
    r = b.shape[0]
    ql = b[:, :128].reshape(r, 2, 1, 2, 32)                                     # [R, h, _, s % 2, l]
    lo = torch.cat([ql & 15, ql >> 4], dim=2).reshape(r, 2, 4, 32)              # [R, h, s, l]
    hi = (b[:, 128:192].reshape(r, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    lo, hi = lo.reshape(r, 16, 2, 4, 2), hi.reshape(r, 16, 2, 4, 2)           # [R, group, slot j // 4, i, t]
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).transpose(2, 3)                     # [R, group, t, byte i]
    qh = hi[:, :, 0, :, 0] | (hi[:, :, 1, :, 0] << 2) | (hi[:, :, 0, :, 1] << 4) | (hi[:, :, 1, :, 1] << 6)
    return ql.contiguous().reshape(r, 128), qh.contiguous().reshape(r, 64)


@triton.jit
def _six_bits(q, h):
    """ql words and their groups' qh bits (already shifted for the word) -> the codes of slots 0..3, 4..7, a
    byte each."""
    return (q & 0x0F0F0F0F) | ((h << 4) & 0x30303030), ((q >> 4) & 0x0F0F0F0F) | ((h << 2) & 0x30303030)


@triton.jit
def _q6_k_row(acc, R, ctx):
    """The program's row R's part of a step, added to its sums acc; ctx: x_ptr, m0, M, K, xo, ok, f, dsc: the
    eight code slots' floats f = f0..f7 [BN, G, 2] (slot j of word t: weight 2j + t of its group, for j < 4;
    8 + 2(j - 4) + t after) against x at offsets xo [G, 2], in the same order for every row (jllm.cuda.rows)."""
    x_ptr, m0, M, K, xo, ok, f, dsc = ctx
    f0, f1, f2, f3, f4, f5, f6, f7 = f
    x_ptr += x_row(m0, R, M) * K
    ok = ok[:, None]
    sw = f0 * tl.load(x_ptr + xo, mask=ok, other=0.0)[None, :, :]
    sw += f1 * tl.load(x_ptr + xo + 2, mask=ok, other=0.0)[None, :, :]
    sw += f2 * tl.load(x_ptr + xo + 4, mask=ok, other=0.0)[None, :, :]
    sw += f3 * tl.load(x_ptr + xo + 6, mask=ok, other=0.0)[None, :, :]
    sw += f4 * tl.load(x_ptr + xo + 8, mask=ok, other=0.0)[None, :, :]
    sw += f5 * tl.load(x_ptr + xo + 10, mask=ok, other=0.0)[None, :, :]
    sw += f6 * tl.load(x_ptr + xo + 12, mask=ok, other=0.0)[None, :, :]
    sw += f7 * tl.load(x_ptr + xo + 14, mask=ok, other=0.0)[None, :, :]
    return acc + dsc[:, :, None] * sw


@triton.jit
def _q6_k_matvec(x_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, b_ptr, y_ptr, M, N, K, NB, Y_STRIDE,
                 NB_PART, P_STRIDE, BLOCK_N: tl.constexpr, SB: tl.constexpr, ROWS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr):
    m0 = tl.program_id(0) * ROWS          # rows m0 .. m0 + ROWS - 1 of x (those below M) share the program
    pid_n = tl.program_id(1)              # (jllm.cuda.rows): the weights are read and unpacked once
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    G: tl.constexpr = 16 * SB             # groups of 16 weights (one scale each) a step
    g = tl.arange(0, G)
    t = tl.arange(0, 2)                   # a group's two ql words
    accs = row_sums((BLOCK_N, G, 2))      # each row's sums
    part = tl.program_id(2)               # this program's share of the row: super-blocks part * NB_PART on
    end = tl.minimum(NB, (part + 1) * NB_PART) * 16
    for kb in tl.range(0, tl.cdiv(NB_PART, SB), num_stages=STAGES):   # STAGES > 1: later steps in flight
        grp = part * NB_PART * 16 + kb * G + g
        ok = (grp < end) | EVEN
        m2 = (live[:, None] & ok[None, :]) | EVEN              # EVEN: the tiles fill the matrix, no masks
        q = tl.load(ql_ptr + rows[:, None, None] * (NB * 32) + grp[None, :, None] * 2 + t[None, None, :],
                    mask=m2[:, :, None], other=0)                                   # int32 [BN, G, 2]
        h = tl.load(qh_ptr + rows[:, None] * (NB * 16) + grp[None, :], mask=m2, other=0)
        lo6, hi6 = _six_bits(q, h[:, :, None] >> (4 * t)[None, None, :])
        lo = byte_floats(lo6, USE_ASM)
        hi = byte_floats(hi6, USE_ASM)
        f = (as_float(lo[0], 32.0), as_float(lo[1], 32.0), as_float(lo[2], 32.0), as_float(lo[3], 32.0),
             as_float(hi[0], 32.0), as_float(hi[1], 32.0), as_float(hi[2], 32.0), as_float(hi[3], 32.0))
        sc = tl.load(sc_ptr + rows[:, None] * (NB * 16) + grp[None, :], mask=m2, other=0).to(tl.float32)
        dsc = tl.load(d_ptr + rows[:, None] * NB + grp[None, :] // 16, mask=m2, other=0.0).to(tl.float32) * sc
        xo = grp[:, None] * 16 + t[None, :]                     # slot j of word t: weight 2j + t (+ 8)
        accs = each_row(accs, _q6_k_row, ROWS, (x_ptr, m0, M, K, xo, ok, f, dsc))
    store_rows(accs, y_ptr + part * P_STRIDE + rows, live, m0, M, Y_STRIDE, ROWS, HAS_BIAS, b_ptr + rows, True)


def launch(x: torch.Tensor, w: Q6KWeight, y: torch.Tensor, block_n: int, bias: torch.Tensor | None = None,
           sb: int = 1, split: int = 1, stages: int = 1) -> None:
    """y [M, N] (rows y.stride(0) apart) = x W^T (+ bias); with split > 1, y [split, M, N] (see q4_k.launch)."""
    n, k = w.shape
    nb = w.d.shape[1]
    part = -(-nb // split)
    r = rows_a_program(x.shape[0])
    grid = (triton.cdiv(x.shape[0], r), triton.cdiv(n, block_n), split)
    _q6_k_matvec[grid](x, w.ql.view(torch.int32), w.qh.view(torch.int32), w.sc, w.d, y if bias is None else bias,
                       y, x.shape[0], n, k, nb, y.stride(-2), part, y.stride(0) if split > 1 else 0, BLOCK_N=block_n,
                       SB=sb, ROWS=r, HAS_BIAS=bias is not None, USE_ASM=ASM,
                       EVEN=n % block_n == 0 and part % sb == 0 and part * split == nb, STAGES=stages,
                       num_warps=warps(block_n, sb))


@triton.jit
def _q6_k_dequantize(ql_ptr, qh_ptr, sc_ptr, d_ptr, w_ptr, N, NB, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    pid_n = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    g = tl.arange(0, 16)
    t = tl.arange(0, 2)
    m3 = live[:, None, None]
    q = tl.load(ql_ptr + rows[:, None, None] * (NB * 32) + kb * 32 + g[None, :, None] * 2 + t[None, None, :],
                mask=m3, other=0)
    h = tl.load(qh_ptr + rows[:, None] * (NB * 16) + kb * 16 + g[None, :], mask=live[:, None], other=0)
    lo6, hi6 = _six_bits(q, h[:, :, None] >> (4 * t)[None, None, :])
    lo = byte_floats(lo6, USE_ASM)
    hi = byte_floats(hi6, USE_ASM)
    ds = (tl.load(d_ptr + rows * NB + kb, mask=live, other=0.0).to(tl.float32)[:, None]
          * tl.load(sc_ptr + (rows[:, None] * NB + kb) * 16 + g[None, :], mask=live[:, None], other=0)
          .to(tl.float32))[:, :, None]
    at = rows[:, None, None] * (NB * 256) + kb * 256 + g[None, :, None] * 16 + t[None, None, :]
    for j in tl.static_range(4):
        tl.store(w_ptr + at + 2 * j, (ds * as_float(lo[j], 32.0)).to(tl.float16), mask=m3)
        tl.store(w_ptr + at + 8 + 2 * j, (ds * as_float(hi[j], 32.0)).to(tl.float16), mask=m3)


def dequantize(w: Q6KWeight) -> torch.Tensor:
    """The matrix in float16 [N, K] (a prefill's matrix product on the tensor cores)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float16, device=w.ql.device)
    _q6_k_dequantize[(triton.cdiv(n, 16), w.d.shape[1])](w.ql.view(torch.int32), w.qh.view(torch.int32), w.sc, w.d,
                                                          out, n, w.d.shape[1], BLOCK_N=16, USE_ASM=ASM)
    return out
