"""Q4_K weights on the GPU at about their GGUF size, and y = x W^T over them in Triton (issue 23's first piece).

Layout (`Q4KWeight.from_gguf`, made once at load): a Q4_K super-block of 256 weights is 144 bytes in the file
(d and dmin f16, eight 6-bit scale and min codes packed in 12 bytes, 128 bytes of 4-bit codes). On the device
the codes stay as they are, qs [N, K/2] uint8 (within each 64 weights of a block, byte l holds weight l in
its low nibble and weight 32 + l in its high one), and the header is unpacked once: d, dmin [N, K/256] f16 and
the scale and min codes [N, K/256, 8] uint8, 148 bytes a block (1.03x the file's). Unpacking the codes in the
kernel would save those 4 bytes a block for more integer work every step; this keeps the kernel simple first.

The kernel (`launch`, called by jllm.cuda.matvec) computes each output y[m, n] from its own row x[m] only,
with one fixed order of operations whatever the number of rows M: one program per (one row of x, BLOCK_N
outputs), a loop over the super-blocks, SB of them (SB * 128 contiguous bytes of each output's codes) a step so
that enough bytes are in flight; per sub-block of 32 weights the codes' dot product with x and x's sum, then
d * scale * dot - dmin * min * sum in float32 (the dequantized weights' dot product, factored). So a verify
pass over k + 1 rows gives each row the logits of a pass over that row alone, bit for bit, which exact
speculation on the GPU needs (tests/test_cuda_matvec.py). Without a GPU the same kernel runs in Triton's interpreter
(TRITON_INTERPRET=1), which is how the tests check it on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gguf import GGMLQuantizationType as T

from jllm.cuda.layout import file_blocks, nbytes
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
        return cls(qs=b[:, 16:].reshape(n, nb * 128).contiguous().to(device),
                   d=d.to(torch.float16).view(n, nb).to(device), dmin=dmin.to(torch.float16).view(n, nb).to(device),
                   sc=sc.reshape(n, nb, 8).contiguous().to(device), mn=mn.reshape(n, nb, 8).contiguous().to(device))


@triton.jit
def _q4_k_matvec(x_ptr, qs_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, b_ptr, y_ptr, N, K, NB, Y_STRIDE,
                 BLOCK_N: tl.constexpr, SB: tl.constexpr, HAS_BIAS: tl.constexpr):
    m = tl.program_id(0)                  # the rows of one block of outputs run side by side: its weights
    pid_n = tl.program_id(1)              # are read from memory once, the other rows find them in L2
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    j = tl.arange(0, 4 * SB)              # 32-byte chunks of SB super-blocks: chunk j holds sub-blocks 2j, 2j + 1
    lane = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_N, 4 * SB), dtype=tl.float32)
    for kb in range(0, tl.cdiv(NB, SB)):
        b0 = kb * SB                                            # the first super-block of this step
        ok = (b0 + j // 4) < NB                                 # the last step may hold fewer
        m2 = live[:, None] & ok[None, :]
        q = tl.load(qs_ptr + rows[:, None, None] * (NB * 128) + b0 * 128 + j[None, :, None] * 32
                    + lane[None, None, :], mask=m2[:, :, None], other=0)                  # [BN, 4 SB, 32]
        xo = m * K + b0 * 256 + j[:, None] * 64 + lane[None, :]                           # sub-block 2j
        x_lo = tl.load(x_ptr + xo, mask=ok[:, None], other=0.0).to(tl.float32)
        x_hi = tl.load(x_ptr + xo + 32, mask=ok[:, None], other=0.0).to(tl.float32)     # sub-block 2j + 1
        s_lo = tl.sum((q & 15).to(tl.float32) * x_lo[None, :, :], axis=2)                 # [BN, 4 SB]
        s_hi = tl.sum((q >> 4).to(tl.float32) * x_hi[None, :, :], axis=2)
        meta = (rows[:, None] * NB + b0) * 8 + 2 * j[None, :]
        sc_lo = tl.load(sc_ptr + meta, mask=m2, other=0).to(tl.float32)
        sc_hi = tl.load(sc_ptr + meta + 1, mask=m2, other=0).to(tl.float32)
        mn_lo = tl.load(mn_ptr + meta, mask=m2, other=0).to(tl.float32)
        mn_hi = tl.load(mn_ptr + meta + 1, mask=m2, other=0).to(tl.float32)
        blk = rows[:, None] * NB + b0 + j[None, :] // 4
        d = tl.load(d_ptr + blk, mask=m2, other=0.0).to(tl.float32)
        dmin = tl.load(dmin_ptr + blk, mask=m2, other=0.0).to(tl.float32)
        acc += d * (sc_lo * s_lo + sc_hi * s_hi) - dmin * (mn_lo * tl.sum(x_lo, axis=1)[None, :]
                                                           + mn_hi * tl.sum(x_hi, axis=1)[None, :])
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=live, other=0.0)
    tl.store(y_ptr + m * Y_STRIDE + rows, y, mask=live)


def launch(x: torch.Tensor, w: Q4KWeight, y: torch.Tensor, block_n: int, bias: torch.Tensor | None = None,
           sb: int = 2) -> None:
    """y [M, N] (rows y.stride(0) apart: a column range of a wider output) = x W^T (+ bias)."""
    n, k = w.shape
    grid = (x.shape[0], triton.cdiv(n, block_n))
    _q4_k_matvec[grid](x, w.qs, w.d, w.dmin, w.sc, w.mn, y if bias is None else bias, y, n, k, w.d.shape[1],
                       y.stride(0), BLOCK_N=block_n, SB=sb, HAS_BIAS=bias is not None)


@triton.jit
def _q4_k_dequantize(qs_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, w_ptr, N, NB, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    j = tl.arange(0, 4)
    lane = tl.arange(0, 32)
    q = tl.load(qs_ptr + rows[:, None, None] * (NB * 128) + kb * 128 + j[None, :, None] * 32 + lane[None, None, :],
                mask=live[:, None, None], other=0)
    meta = (rows[:, None] * NB + kb) * 8 + 2 * j[None, :]
    d = tl.load(d_ptr + rows * NB + kb, mask=live, other=0.0).to(tl.float32)[:, None, None]
    dmin = tl.load(dmin_ptr + rows * NB + kb, mask=live, other=0.0).to(tl.float32)[:, None, None]
    for half in tl.static_range(2):                     # sub-block 2j + half: the low nibbles, then the high
        sc = tl.load(sc_ptr + meta + half, mask=live[:, None], other=0).to(tl.float32)[:, :, None]
        mn = tl.load(mn_ptr + meta + half, mask=live[:, None], other=0).to(tl.float32)[:, :, None]
        code = ((q >> (4 * half)) & 15).to(tl.float32)
        val = d * sc * code - dmin * mn
        at = rows[:, None, None] * (NB * 256) + kb * 256 + j[None, :, None] * 64 + half * 32 + lane[None, None, :]
        tl.store(w_ptr + at, val.to(tl.float16), mask=live[:, None, None])


def dequantize(w: Q4KWeight) -> torch.Tensor:
    """The matrix in float16 [N, K] (a prefill's matrix product on the tensor cores)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float16, device=w.qs.device)
    _q4_k_dequantize[(triton.cdiv(n, 16), w.d.shape[1])](w.qs, w.d, w.dmin, w.sc, w.mn, out, n, w.d.shape[1],
                                                          BLOCK_N=16)
    return out
