"""Q4_K weights on the GPU at about their GGUF size, and y = x W^T over them in Triton (issue 23's first piece).

Layout (`Q4KWeight.from_gguf`, made once at load): a Q4_K super-block of 256 weights is 144 bytes in the file
(d and dmin f16, eight 6-bit scale and min codes packed in 12 bytes, 128 bytes of 4-bit codes). On the device
the codes stay as they are, qs [N, K/2] uint8 (within each 64 weights of a block, byte l holds weight l in
its low nibble and weight 32 + l in its high one), and the header is unpacked once: d, dmin [N, K/256] f16 and
the scale and min codes [N, K/256, 8] uint8, 148 bytes a block (1.03x the file's). Unpacking the codes in the
kernel would save those 4 bytes a block for more integer work every step; this keeps the kernel simple first.

The kernel (`launch`, called by jllm.cuda.matvec) computes each output y[m, n] from its own row x[m] only,
with one fixed order of operations whatever the number of rows M: one program per (BLOCK_N outputs, one row
of x), a loop over the super-blocks, 32 weights at a time (one scale and min each), value = (d * scale) * q -
(dmin * min) in float32 as the CPU's dequantization (jllm.gguf.quants) computes it, then a sum per 32. So a
verify pass over k + 1 rows gives each row the logits of a pass over that row alone, bit for bit, which exact
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
def _q4_k_matvec(x_ptr, qs_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, y_ptr, N, K, NB,
                 BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    lane = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kb in range(0, NB):
        d = tl.load(d_ptr + rows * NB + kb, mask=live, other=0.0).to(tl.float32)
        dmin = tl.load(dmin_ptr + rows * NB + kb, mask=live, other=0.0).to(tl.float32)
        for c in tl.static_range(4):                       # 64 weights: 32 bytes, two sub-blocks of 32
            q = tl.load(qs_ptr + rows[:, None] * (NB * 128) + kb * 128 + c * 32 + lane[None, :],
                        mask=live[:, None], other=0)
            for h in tl.static_range(2):                   # the low nibbles, then the high ones
                j = 2 * c + h
                code = ((q >> (4 * h)) & 15).to(tl.float32)
                s = tl.load(sc_ptr + (rows * NB + kb) * 8 + j, mask=live, other=0).to(tl.float32)
                mi = tl.load(mn_ptr + (rows * NB + kb) * 8 + j, mask=live, other=0).to(tl.float32)
                w = (d * s)[:, None] * code - (dmin * mi)[:, None]
                x = tl.load(x_ptr + m * K + kb * 256 + j * 32 + lane).to(tl.float32)
                acc += tl.sum(w * x[None, :], axis=1)
    tl.store(y_ptr + m * N + rows, acc, mask=live)


def launch(x: torch.Tensor, w: Q4KWeight, y: torch.Tensor, block_n: int) -> None:
    n, k = w.shape
    grid = (triton.cdiv(n, block_n), x.shape[0])
    _q4_k_matvec[grid](x, w.qs, w.d, w.dmin, w.sc, w.mn, y, n, k, w.d.shape[1], BLOCK_N=block_n)
