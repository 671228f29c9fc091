"""Q6_K weights on the GPU at their GGUF size, and the Triton kernel of y = x W^T over them (see q4_k.py for
the row-independence this keeps).

Layout (`Q6KWeight.from_gguf`): a Q6_K super-block of 256 weights is 210 bytes (ql[128]: the low 4 bits,
qh[64]: the high 2, 16 int8 scales, d f16); on the device the same bytes split by field, ql [N, K/2],
qh [N, K/4], scales [N, K/256, 16] int8, d [N, K/256] f16: 1.00x the file's. Weight 128h + 32s + l of a
block (h < 2, s < 4, l < 32) has its low bits in the low (s < 2) or high (s >= 2) nibble of ql[64h + 32(s % 2)
+ l], its high bits at bit 2s of qh[32h + l], and scale 8h + 2s + l // 16; value = (d * scale) * (q - 32) in
float32, as jllm.gguf.quants decodes it. The kernel takes SB super-blocks of each output row a step, and per
group of 16 weights the codes' dot product with x, times d * scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from jllm.cuda.layout import file_blocks, nbytes


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
        return cls(ql=b[:, :, :128].reshape(n, nb * 128).contiguous().to(device),
                   qh=b[:, :, 128:192].reshape(n, nb * 64).contiguous().to(device),
                   sc=b[:, :, 192:208].contiguous().view(torch.int8).to(device),
                   d=b[:, :, 208:210].contiguous().view(torch.float16).reshape(n, nb).to(device))


@triton.jit
def _q6_k_matvec(x_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, b_ptr, y_ptr, N, K, NB, Y_STRIDE,
                 BLOCK_N: tl.constexpr, SB: tl.constexpr, HAS_BIAS: tl.constexpr):
    m = tl.program_id(0)                  # the rows of one block of outputs run side by side: its weights
    pid_n = tl.program_id(1)              # are read from memory once, the other rows find them in L2
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    J: tl.constexpr = 8 * SB              # runs of 32 weights in SB super-blocks: run j is 128h + 32s of block j // 8
    j = tl.arange(0, J)
    lane = tl.arange(0, 32)
    g = tl.arange(0, 2 * J)               # the 16-weight groups, one scale each
    r = j % 8
    h, s = r // 4, r % 4
    lo_at = (j // 8) * 128 + h * 64 + (s % 2) * 32
    hi_at = (j // 8) * 64 + h * 32
    acc = tl.zeros((BLOCK_N, 2 * J), dtype=tl.float32)
    for kb in range(0, tl.cdiv(NB, SB)):
        b0 = kb * SB
        ok = (b0 + j // 8) < NB
        m3 = (live[:, None] & ok[None, :])[:, :, None]
        lo = tl.load(ql_ptr + rows[:, None, None] * (NB * 128) + b0 * 128 + lo_at[None, :, None]
                     + lane[None, None, :], mask=m3, other=0)
        hi = tl.load(qh_ptr + rows[:, None, None] * (NB * 64) + b0 * 64 + hi_at[None, :, None]
                     + lane[None, None, :], mask=m3, other=0)
        q = ((lo >> (4 * (s // 2))[None, :, None]) & 15) | (((hi >> (2 * s)[None, :, None]) & 3) << 4)
        x = tl.load(x_ptr + m * K + b0 * 256 + j[:, None] * 32 + lane[None, :], mask=ok[:, None],
                    other=0.0).to(tl.float32)
        prod = (q.to(tl.float32) - 32.0) * x[None, :, :]                                 # [BN, J, 32]
        part = tl.sum(tl.reshape(prod, (BLOCK_N, 2 * J, 16)), axis=2)                     # group 2j + l // 16
        okg = live[:, None] & ((b0 + g // 16) < NB)[None, :]
        sc = tl.load(sc_ptr + (rows[:, None] * NB + b0) * 16 + g[None, :], mask=okg, other=0).to(tl.float32)
        d = tl.load(d_ptr + rows[:, None] * NB + b0 + g[None, :] // 16, mask=okg, other=0.0).to(tl.float32)
        acc += (d * sc) * part
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=live, other=0.0)
    tl.store(y_ptr + m * Y_STRIDE + rows, y, mask=live)


def launch(x: torch.Tensor, w: Q6KWeight, y: torch.Tensor, block_n: int, bias: torch.Tensor | None = None,
           sb: int = 1) -> None:
    """y [M, N] (rows y.stride(0) apart) = x W^T (+ bias)."""
    n, k = w.shape
    grid = (x.shape[0], triton.cdiv(n, block_n))
    _q6_k_matvec[grid](x, w.ql, w.qh, w.sc, w.d, y if bias is None else bias, y, n, k, w.d.shape[1],
                       y.stride(0), BLOCK_N=block_n, SB=sb, HAS_BIAS=bias is not None)


@triton.jit
def _q6_k_dequantize(ql_ptr, qh_ptr, sc_ptr, d_ptr, w_ptr, N, NB, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    j = tl.arange(0, 8)                   # run j of 32 weights: 128h + 32s, h = j // 4, s = j % 4
    lane = tl.arange(0, 32)
    h, s = j // 4, j % 4
    m3 = live[:, None, None]
    lo = tl.load(ql_ptr + rows[:, None, None] * (NB * 128) + kb * 128 + (h * 64 + (s % 2) * 32)[None, :, None]
                 + lane[None, None, :], mask=m3, other=0)
    hi = tl.load(qh_ptr + rows[:, None, None] * (NB * 64) + kb * 64 + (h * 32)[None, :, None] + lane[None, None, :],
                 mask=m3, other=0)
    q = ((lo >> (4 * (s // 2))[None, :, None]) & 15) | (((hi >> (2 * s)[None, :, None]) & 3) << 4)
    g = 2 * j[None, :, None] + lane[None, None, :] // 16                    # the run's 16-weight groups
    sc = tl.load(sc_ptr + (rows[:, None, None] * NB + kb) * 16 + g, mask=m3, other=0).to(tl.float32)
    d = tl.load(d_ptr + rows * NB + kb, mask=live, other=0.0).to(tl.float32)[:, None, None]
    val = (d * sc) * (q.to(tl.float32) - 32.0)
    at = rows[:, None, None] * (NB * 256) + kb * 256 + j[None, :, None] * 32 + lane[None, None, :]
    tl.store(w_ptr + at, val.to(tl.float16), mask=m3)


def dequantize(w: Q6KWeight) -> torch.Tensor:
    """The matrix in float16 [N, K] (a prefill's matrix product on the tensor cores)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float16, device=w.ql.device)
    _q6_k_dequantize[(triton.cdiv(n, 16), w.d.shape[1])](w.ql, w.qh, w.sc, w.d, out, n, w.d.shape[1], BLOCK_N=16)
    return out
