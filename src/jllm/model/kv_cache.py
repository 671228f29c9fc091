"""Preallocated KV cache: one buffer per model, indexed by position; rollback moves a length, never copies.

Layout: k, v: [n_layers, n_kv_heads, max_tokens, head_dim]. `length` counts the positions that hold
valid keys/values; a forward over T new tokens writes positions [length, length + T) and advances it.
`truncate(n)` is how speculative decoding rejects tokens and how a cached conversation is cut back to the
common prefix: later writes simply overwrite.

The native CPU stack keeps keys and values in f16, as llama.cpp does by default: a decode step reads the
whole cache, so at long contexts it is a real share of the bytes per token (the 1.5B at 4,096 tokens: 117 MB
in f16 beside 1,000 MB of weights), and the memory and the persistent cache's files halve. The GPU's blocks
precision does the same (a Qwen3-4B at 4,096 tokens: 576 MB instead of 1,152). Elsewhere (torch attention,
the exact, int8 and bf16 precisions) the cache stays f32.
"""

from __future__ import annotations

import torch

from jllm.errors import JllmError
from jllm.model import hugepages


def kv_dtype(half: bool) -> torch.dtype:
    """float16 for the native CPU stack and the GPU's blocks precision, float32 for the rest."""
    return torch.float16 if half else torch.float32


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (n_layers, n_kv_heads, max_tokens, head_dim)
        if torch.device(device).type == "cpu":          # attention streams the cache: huge pages
            self.k, self.v = hugepages.zeros(shape, dtype), hugepages.zeros(shape, dtype)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_tokens = max_tokens
        self.length = 0

    def reserve(self, n_new: int) -> int:
        """Check that n_new more tokens fit; return the first position they will occupy."""
        if self.length + n_new > self.max_tokens:
            raise JllmError(f"context full: {self.length} + {n_new} tokens exceed the context size "
                            f"{self.max_tokens} (raise -c/--ctx-size)")
        return self.length

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        self.length = n

    def move(self, src: int, dst: int) -> None:
        """Copy the keys and values at position src to position dst (every layer and head): a speculative
        side leaf, verified in a spare position, put where it belongs once taken."""
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]

    def export(self, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the first n positions: k, v [n_layers, n_kv_heads, n, head_dim]."""
        n = self.length if n is None else n
        return self.k[:, :, :n].clone(), self.v[:, :, :n].clone()

    def load(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the cache contents with k, v as returned by export()."""
        n = k.shape[2]
        if k.shape != v.shape or k.shape[:2] != self.k.shape[:2] or k.shape[3] != self.k.shape[3]:
            raise ValueError(f"KV shape {tuple(k.shape)} does not fit cache {tuple(self.k.shape)}")
        if n > self.max_tokens:
            raise JllmError(f"cached state of {n} tokens exceeds the context size {self.max_tokens}")
        self.k[:, :, :n].copy_(k)
        self.v[:, :, :n].copy_(v)
        self.length = n

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
