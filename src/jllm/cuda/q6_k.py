"""Q6_K weights on the GPU at their GGUF size, and the Triton kernel of y = x W^T over them (see q4_k.py for
the row-independence this keeps).

Layout (`Q6KWeight.from_gguf`): a Q6_K super-block of 256 weights is 210 bytes (ql[128]: the low 4 bits,
qh[64]: the high 2, 16 int8 scales, d f16); on the device the same bytes split by field, ql [N, K/2],
qh [N, K/4], scales [N, K/256, 16] int8, d [N, K/256] f16: 1.00x the file's. Weight 128h + 32s + l of a
block (h < 2, s < 4, l < 32) has its low bits in the low (s < 2) or high (s >= 2) nibble of ql[64h + 32(s % 2)
+ l], its high bits at bit 2s of qh[32h + l], and scale 8h + 2s + l // 16; value = (d * scale) * (q - 32) in
float32, as jllm.gguf.quants decodes it.
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
def _q6_k_matvec(x_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, y_ptr, N, K, NB, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    lane = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kb in range(0, NB):
        d = tl.load(d_ptr + rows * NB + kb, mask=live, other=0.0).to(tl.float32)
        for h in tl.static_range(2):
            hi = tl.load(qh_ptr + rows[:, None] * (NB * 64) + kb * 64 + h * 32 + lane[None, :],
                         mask=live[:, None], other=0)
            for s in tl.static_range(4):
                lo = tl.load(ql_ptr + rows[:, None] * (NB * 128) + kb * 128 + h * 64 + (s % 2) * 32 + lane[None, :],
                             mask=live[:, None], other=0)
                q = ((lo >> (4 * (s // 2))) & 15) | (((hi >> (2 * s)) & 3) << 4)
                sc = tl.load(sc_ptr + (rows[:, None] * NB + kb) * 16 + 8 * h + 2 * s + lane[None, :] // 16,
                             mask=live[:, None], other=0).to(tl.float32)
                w = (d[:, None] * sc) * (q.to(tl.float32) - 32.0)
                x = tl.load(x_ptr + m * K + kb * 256 + h * 128 + s * 32 + lane).to(tl.float32)
                acc += tl.sum(w * x[None, :], axis=1)
    tl.store(y_ptr + m * N + rows, acc, mask=live)


def launch(x: torch.Tensor, w: Q6KWeight, y: torch.Tensor, block_n: int) -> None:
    n, k = w.shape
    grid = (triton.cdiv(n, block_n), x.shape[0])
    _q6_k_matvec[grid](x, w.ql, w.qh, w.sc, w.d, y, n, k, w.d.shape[1], BLOCK_N=block_n)
