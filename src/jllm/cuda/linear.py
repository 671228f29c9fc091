"""The `blocks` precision's linear layer: the GGUF's own blocks on the GPU (Q4_K, Q6_K, Q4_0, Q5_0, Q8_0) and
the Triton matvec over them for passes of up to MATVEC_ROWS rows (decode and verify: each output row from its
own input row, so a verify row is bitwise a decode step); a longer pass (a prefill chunk) multiplies on the
tensor cores over the matrix dequantized to f16 (Q4_K, Q6_K; the others stay on the matvec). A layer of
several matrices (q|k|v, gate|up) keeps one part per run of matrices of one type, their outputs side by side;
a matrix of another type (F32, F16, BF16) is a bf16 part, multiplied by torch (which gives no such row
guarantee; the Q4_K_M files' matrices are all block types).

It runs where Triton runs: on a CUDA device, or, for the tests, in Triton's interpreter on the CPU
(TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from jllm.errors import JllmError


def check_device(device: torch.device) -> None:
    """JllmError in one line unless the blocks precision can run here."""
    if device.type == "cuda":
        pass
    elif os.environ.get("TRITON_INTERPRET") != "1":
        raise JllmError("precision blocks needs a CUDA device (on the CPU use native or int8)")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise JllmError("precision blocks needs triton (it comes with torch's CUDA builds)") from None


def device_weight(raw, ggml_type: T, shape: tuple[int, int], device: torch.device):
    """The device layout of an (N, K) matrix of one of jllm.cuda.layout.BLOCK_TYPES, from its file bytes."""
    from jllm.cuda.blocks32 import Blocks32Weight
    from jllm.cuda.q4_k import Q4KWeight
    from jllm.cuda.q6_k import Q6KWeight

    raw = torch.from_numpy(raw.copy()) if not isinstance(raw, torch.Tensor) else raw
    if ggml_type == T.Q4_K:
        return Q4KWeight.from_gguf(raw, shape, device)
    if ggml_type == T.Q6_K:
        return Q6KWeight.from_gguf(raw, shape, device)
    return Blocks32Weight.from_gguf(raw, ggml_type, shape, device)


MATVEC_ROWS = 16        # passes of up to this many rows (decode, verify; the CUDA graphs' passes) multiply
                        # over the blocks, each row alone; longer ones (a prefill's chunks) over the matrix
                        # dequantized to f16 on the tensor cores, a temporary of 2 bytes a weight


def _dequantize(p):
    """The part in f16 for a matrix product, or None where its type has no dequantizing kernel."""
    from jllm.cuda import q4_k, q6_k

    if isinstance(p, q4_k.Q4KWeight):
        return q4_k.dequantize(p)
    if isinstance(p, q6_k.Q6KWeight):
        return q6_k.dequantize(p)
    return None


class BlocksLinear:
    """y = x @ W.T (+ b), W the row-wise concatenation of `parts` (device block weights, or bf16 tensors)."""

    def __init__(self, parts: list, bias: torch.Tensor | None = None):
        self.parts, self.bias = parts, bias
        shapes = [tuple(p.shape) for p in parts]
        self.in_features = shapes[0][1]
        self.out_features = sum(s[0] for s in shapes)

    def __call__(self, x: torch.Tensor, prep=None) -> torch.Tensor:
        """prep: x already made ready for this layer's parts that take it (by a producer given empty_prep()'s
        room), else made here when they run (jllm.cuda.ready: the tensor cores' and the dp4a kernels' parts)."""
        from jllm.cuda import ready
        from jllm.cuda.matvec import matvec

        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        if prep is None:
            prep = ready.prepare(x2, self._matvec_parts(x2))   # one x for all of them (q|k|v: both types)
        at = 0
        for p in self.parts:                   # each part writes its columns of y, adding its part of the bias
            n = p.shape[0]
            cols, bias = y[:, at:at + n], None if self.bias is None else self.bias[at:at + n]
            dense = p if isinstance(p, torch.Tensor) else (
                _dequantize(p) if x2.shape[0] > MATVEC_ROWS else None)
            if dense is not None:
                cols.copy_(F.linear(x2.to(dense.dtype), dense).float() + (0 if bias is None else bias))
            else:
                matvec(x2, p, out=cols, bias=bias, prep=prep)
            at += n
        return y.reshape(*lead, self.out_features)

    def empty_prep(self, x: torch.Tensor):
        """Room for x [T, in_features] made ready for this layer's parts that take it (jllm.cuda.ready.empty),
        for the kernel that writes x to fill (jllm.cuda.fused); None where none of its parts does."""
        from jllm.cuda import ready

        return ready.empty(x, self.in_features, self._matvec_parts(x))

    def _matvec_parts(self, x: torch.Tensor) -> list:
        """The block parts whose products over x run on the matvec kernels (a prefill's chunk runs none)."""
        return [] if x.shape[0] > MATVEC_ROWS else [p for p in self.parts if not isinstance(p, torch.Tensor)]

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else p.nbytes() for p in self.parts)
