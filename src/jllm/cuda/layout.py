"""What every device layout of GGUF blocks starts from: which block types have one, the bytes they take on the
device, the tensor's bytes checked against its shape and cut into its blocks; and attention's chunking. No
triton here: `jllm plan` budgets the layouts and attention's scratch from this alone."""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

BLOCK_TYPES = (T.Q4_K, T.Q6_K, T.Q4_0, T.Q5_0, T.Q8_0)     # the types with a device layout and a kernel
UNPACKED = {T.Q4_K: 4}      # bytes a block gains on the device: Q4_K's 12-byte header unpacked to 16 (q4_k.py)


def device_bytes(ggml_type: T, rows: int, cols: int) -> int:
    """The device bytes of an (rows, cols) matrix of one of BLOCK_TYPES."""
    values, size = GGML_QUANT_SIZES[ggml_type]
    return rows * (cols // values) * (size + UNPACKED.get(ggml_type, 0))


def file_blocks(raw, ggml_type: T, shape: tuple[int, int]) -> torch.Tensor:
    """raw bytes of an (N, K) tensor of `ggml_type` -> uint8 [N, K / values a block, bytes a block];
    ValueError in one line if K or the byte count do not fit."""
    values, size = GGML_QUANT_SIZES[ggml_type]
    n, k = shape
    if k % values:
        raise ValueError(f"a {ggml_type.name} row holds a multiple of {values} values, not {k}")
    nb = k // values
    b = torch.as_tensor(raw, dtype=torch.uint8).reshape(-1)
    if b.numel() != n * nb * size:
        raise ValueError(f"{b.numel()} bytes for a {ggml_type.name} tensor of {n} x {k} (want {n * nb * size})")
    return b.view(n, nb, size)


QUERIES = 16            # attention's queries a launch: a prefill's scratch stays that of 16 (jllm.cuda.attention)


def chunk_size(max_t: int) -> int:
    """Attention's keys per chunk for a cache of max_t positions: a power of two >= 64, at most 64 chunks. A
    function of the cache alone, so that every query of every call of up to QUERIES queries is split the same way
    (a longer call takes each query's keys as one chunk: jllm.cuda.attention)."""
    size = 64
    while n_chunks(max_t, size) > 64:
        size *= 2
    return size


def n_chunks(max_t: int, size: int | None = None) -> int:
    """How many chunks of `size` (default chunk_size(max_t)) keys cover a cache of max_t positions."""
    return -(-max_t // (size or chunk_size(max_t)))


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
