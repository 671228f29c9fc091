"""The GGUF block types of 32 values (Q4_0, Q5_0, Q8_0) on the GPU at their file size, and the Triton kernel
of y = x W^T over them (see q4_k.py for the row-independence this keeps). The 0.5B draft model's matrices are
mostly Q5_0 and Q8_0, and an EAGLE-3 head's are Q4_0.

Layout (`Blocks32Weight.from_gguf`): each block's f16 scale d apart, d [N, K/32], and its codes as the file
has them: Q8_0 int8 [N, K]; Q4_0 qs [N, K/2] (byte l of a block: value l in the low nibble, value 16 + l in
the high one); Q5_0 the same qs plus qh [N, K/32] uint32 (bit i: the fifth bit of value i). Values, in
float32 as jllm.gguf.quants decodes them: Q8_0 q * d, Q4_0 (q - 8) * d, Q5_0 (q - 16) * d.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from jllm.cuda.layout import file_blocks, nbytes
from jllm.cuda.rows import each_row, row_sums, rows_a_program, store_rows, x_row

KIND = {T.Q4_0: 0, T.Q5_0: 1, T.Q8_0: 2}          # the types held here, and the kernel's constexpr switch


@dataclass
class Blocks32Weight:
    kind: T
    d: torch.Tensor                 # float16 [N, K / 32]
    qs: torch.Tensor                # Q8_0: int8 [N, K]; Q4_0, Q5_0: uint8 [N, K / 2]
    qh: torch.Tensor | None = None  # Q5_0: int32 [N, K / 32] (the file's uint32 bits)

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * 32

    def nbytes(self) -> int:
        return nbytes(self.d, self.qs, self.qh)

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, kind: T, shape: tuple[int, int],
                  device: str | torch.device = "cpu") -> "Blocks32Weight":
        """raw: the tensor's bytes (uint8) of type `kind`, shape (N, K) -> the device layout."""
        if kind not in KIND:
            raise ValueError(f"{kind.name} is not a 32-value block type this layout holds")
        b = file_blocks(raw, kind, shape)
        n, nb = b.shape[:2]
        k = nb * 32
        d = b[:, :, :2].contiguous().view(torch.float16).reshape(n, nb).to(device)
        if kind == T.Q8_0:
            return cls(kind, d, b[:, :, 2:].contiguous().view(torch.int8).reshape(n, k).to(device))
        if kind == T.Q4_0:
            return cls(kind, d, b[:, :, 2:].reshape(n, nb * 16).contiguous().to(device))
        qh = b[:, :, 2:6].contiguous().view(torch.int32).reshape(n, nb).to(device)
        return cls(kind, d, b[:, :, 6:].reshape(n, nb * 16).contiguous().to(device), qh)


@triton.jit
def _row(acc, R, ctx):
    """The program's row R's part of a half block (jllm.cuda.rows), added to its sum acc; ctx: x_ptr, m0, M, K,
    at, lane, wd: the weights' values wd [BN, 16] against x at `at`."""
    x_ptr, m0, M, K, at, lane, wd = ctx
    x_ptr += x_row(m0, R, M) * K
    ok = lane >= 0
    x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return acc + tl.sum(wd * x[None, :], axis=1)


@triton.jit
def _blocks32_matvec(x_ptr, d_ptr, qs_ptr, qh_ptr, b_ptr, y_ptr, M, N, K, NB, Y_STRIDE, KIND: tl.constexpr,
                     BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr):
    m0 = tl.program_id(0) * ROWS          # rows m0 .. m0 + ROWS - 1 of x (those below M) share the program
    pid_n = tl.program_id(1)              # (jllm.cuda.rows): the weights are read and decoded once
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    lane = tl.arange(0, 16)
    accs = row_sums((BLOCK_N,))           # each row's sum
    for kb in range(0, NB):
        d = tl.load(d_ptr + rows * NB + kb, mask=live, other=0.0).to(tl.float32)
        if KIND != 2:
            b = tl.load(qs_ptr + rows[:, None] * (NB * 16) + kb * 16 + lane[None, :], mask=live[:, None], other=0)
            if KIND == 1:
                qh = tl.load(qh_ptr + rows * NB + kb, mask=live, other=0)
        for h in tl.static_range(2):
            if KIND == 2:                                      # Q8_0: two halves of 16 int8 codes
                code = tl.load(qs_ptr + rows[:, None] * K + kb * 32 + h * 16 + lane[None, :], mask=live[:, None],
                               other=0).to(tl.float32)
            else:                                              # Q4_0 / Q5_0: low nibbles, then high ones
                q = (b >> (4 * h)) & 15
                if KIND == 1:
                    q = q | (((qh[:, None] >> (lane[None, :] + 16 * h)) & 1) << 4)
                    code = q.to(tl.float32) - 16.0
                else:
                    code = q.to(tl.float32) - 8.0
            wd = code * d[:, None]
            at = kb * 32 + h * 16 + lane
            accs = each_row(accs, _row, ROWS, (x_ptr, m0, M, K, at, lane, wd))
    store_rows(accs, y_ptr + rows, live, m0, M, Y_STRIDE, ROWS, HAS_BIAS, b_ptr + rows, False)


def launch(x: torch.Tensor, w: Blocks32Weight, y: torch.Tensor, block_n: int, bias: torch.Tensor | None = None,
           sb: int = 1) -> None:
    """y [M, N] (rows y.stride(0) apart) = x W^T (+ bias); sb: unused (one block a step)."""
    n, k = w.shape
    r = rows_a_program(x.shape[0])
    grid = (triton.cdiv(x.shape[0], r), triton.cdiv(n, block_n))
    qh = w.qh if w.qh is not None else w.d                   # unread unless Q5_0
    _blocks32_matvec[grid](x, w.d, w.qs, qh, y if bias is None else bias, y, x.shape[0], n, k, k // 32, y.stride(0),
                           KIND=KIND[w.kind], BLOCK_N=block_n, ROWS=r, HAS_BIAS=bias is not None)
