"""Linear layers in the compute representation: exact float, or int8 weights with int8 activations.

The int8 path is *batch-invariant*: a row's output is bitwise the same whatever other rows share the call.
Speculative decoding depends on this (the verify pass over k+1 tokens must produce exactly the logits that
k+1 single decode steps would), and so does the persistent KV cache (any chunking of a prompt yields the same
cache). FBGEMM's dynamic int8 linear alone is not batch-invariant: it picks one activation scale for the
whole input. We therefore quantize each row ourselves to the integer grid [-127, 127] with its own scale and
prepend one calibration row holding 127 and -128: FBGEMM then always chooses scale 1 and zero point 128,
quantizes our integer-valued input exactly, accumulates exactly in int32, and we rescale each row by its own
scale afterwards. Cost: one extra row, free for the small M of decode and verify.

Accuracy: one int8 grid per row is too coarse for LLM activations, whose outlier channels stretch the row's
range (Qwen2.5-1.5B teacher-forced on the llama.cpp greedy fixtures: 224/235 top-1 agreement). So each row is
quantized twice: q1 = round(x / s1), then the remainder r = x - s1 q1 on its own grid, q2 = round(r / s2),
with s2 <= s1 / 254. Both go through the same GEMM as extra rows and y = s1 (q1 W) + s2 (q2 W): about 15-bit
activations (230/235, the same as float activations with these int8 weights; the f32-exact model gets 229).

Weights: per-output-channel symmetric int8, from the exactly dequantized GGUF weights. On CPUs without
AVX-512 VNNI, FBGEMM multiplies with AVX2's vpmaddubsw, which adds two products of an activation byte
(0..255 after the zero point) and a weight in 16 bits with saturation: 2 x 255 x 127 overflows, so there the
weights keep 7 bits (|q| <= 63, 2 x 255 x 63 < 2^15). Without that the tiny llama oracle's argmax agreed at
75 % of positions on an AVX2-only EPYC.
"""

from __future__ import annotations

import warnings

import torch

# FBGEMM's linear needs a per-channel quantized weight tensor to pack; torch warns that creating quantized
# tensors is deprecated (the packed linear is not). Silenced once, here, for the packing worker threads too.
warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*", category=UserWarning)
import torch.nn.functional as F

from jllm.kernels import cpu_flags


WEIGHT_LEVELS = 127.0 if "avx512_vnni" in cpu_flags() else 63.0


def quantize_weight_int8(w: torch.Tensor, out: torch.Tensor | None = None,
                         scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (int8 [N, K], scale float32 [N]) symmetric per output channel, |q| <= WEIGHT_LEVELS.

    Overwrites w (a scratch chunk) to avoid temporaries; writes into out / scale_out when given."""
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / WEIGHT_LEVELS, torch.ones_like(amax))
    w.div_(scale[:, None]).round_()
    if out is None:
        out = torch.empty(w.shape, dtype=torch.int8)
    out.copy_(w)                                  # |w| <= WEIGHT_LEVELS after the division: no clamp needed
    if scale_out is not None:
        scale_out.copy_(scale)
        scale = scale_out
    return out, scale


class DenseLinear:
    """y = x @ W.T (+ b) with float weights (f32 for the exact path, bf16/f16 on CUDA)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(self.weight.dtype), self.weight)
        y = y.float()
        return y + self.bias if self.bias is not None else y

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int8Linear:
    """Batch-invariant int8 x int8 linear on FBGEMM (x86 CPUs).

    Construction is cheap; `pack()` does FBGEMM's (slow, ~40 MB/s) weight packing and may run on a worker
    thread, which is how loading packs two matrices at a time.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: bool = False):
        self.out_features, self.in_features = qweight.shape
        self._q, self._scale = qweight, scale
        self.packed = None
        self.bias = bias
        self.residual = residual

    def pack(self) -> "Int8Linear":
        if self.packed is None:
            n = self.out_features
            qw = torch._make_per_channel_quantized_tensor(self._q, self._scale.double(),
                                                          torch.zeros(n, dtype=torch.long), 0)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)
            self._q = self._scale = None
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] float32
        m = x.shape[0]
        s1 = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).div_(127.0)    # [M, 1]
        t = x / s1
        if self.residual:
            buf = _input_buffer(self.in_features, 2 * m + 1)
            q1 = torch.round(t, out=buf[1:m + 1])
            torch.round((t - q1).mul_(254.0), out=buf[m + 1:2 * m + 1])           # |t - q1| <= 0.5
            y = torch.ops.quantized.linear_dynamic(buf[:2 * m + 1], self.packed, False)
            y = y[1:m + 1].add_(y[m + 1:], alpha=1.0 / 254.0).mul_(s1)           # [M, N]
        else:
            buf = _input_buffer(self.in_features, m + 1)
            torch.round(t, out=buf[1:m + 1])
            y = torch.ops.quantized.linear_dynamic(buf[:m + 1], self.packed, False)[1:].mul_(s1)
        return y.add_(self.bias) if self.bias is not None else y

    def nbytes(self) -> int:
        return self.out_features * (self.in_features + 4)


_buffers: dict[int, torch.Tensor] = {}


def _input_buffer(k: int, rows: int) -> torch.Tensor:
    """A [rows, k] scratch input whose row 0 is the calibration row (127, -128, 0, ...), shared by all
    linears of width k: calls run one at a time, and a call reads only the rows it wrote."""
    buf = _buffers.get(k)
    if buf is None or buf.shape[0] < rows:
        buf = torch.zeros(max(rows, 16), k)
        buf[0, 0], buf[0, 1 % k] = 127.0, -128.0
        _buffers[k] = buf
    return buf


def int8_supported() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines
