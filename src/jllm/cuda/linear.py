"""The `blocks` precision's linear layer: the GGUF's own blocks on the GPU (Q4_K, Q6_K, Q4_0, Q5_0, Q8_0) and
the Triton matvec over them, for every row count (decode, verify and prefill alike, each output row from its
own input row). A layer of several matrices (q|k|v, gate|up) keeps one part per matrix, each in its own
type, their outputs side by side; a matrix of another type (F32, F16, BF16) is a bf16 part, multiplied by
torch (which gives no such row guarantee; the Q4_K_M files' matrices are all block types).

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


class BlocksLinear:
    """y = x @ W.T (+ b), W the row-wise concatenation of `parts` (device block weights, or bf16 tensors)."""

    def __init__(self, parts: list, bias: torch.Tensor | None = None):
        self.parts, self.bias = parts, bias
        shapes = [tuple(p.shape) for p in parts]
        self.in_features = shapes[0][1]
        self.out_features = sum(s[0] for s in shapes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from jllm.cuda.matvec import matvec

        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        at = 0
        for p in self.parts:                   # each part writes its columns of y, adding its part of the bias
            n = p.shape[0]
            cols, bias = y[:, at:at + n], None if self.bias is None else self.bias[at:at + n]
            if isinstance(p, torch.Tensor):
                cols.copy_(F.linear(x2.to(p.dtype), p).float() + (0 if bias is None else bias))
            else:
                matvec(x2, p, out=cols, bias=bias)
            at += n
        return y.reshape(*lead, self.out_features)

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else p.nbytes() for p in self.parts)
