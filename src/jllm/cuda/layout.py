"""What every device layout of GGUF blocks starts from: the tensor's bytes checked against its shape and cut
into its blocks, and the bytes a layout holds on the device."""

from __future__ import annotations

import torch


def file_blocks(raw, type_name: str, shape: tuple[int, int], values: int, size: int) -> torch.Tensor:
    """raw bytes of an (N, K) tensor of blocks of `values` values and `size` bytes -> uint8 [N, K / values, size];
    ValueError in one line if K or the byte count do not fit."""
    n, k = shape
    if k % values:
        raise ValueError(f"a {type_name} row holds a multiple of {values} values, not {k}")
    nb = k // values
    b = torch.as_tensor(raw, dtype=torch.uint8).reshape(-1)
    if b.numel() != n * nb * size:
        raise ValueError(f"{b.numel()} bytes for a {type_name} tensor of {n} x {k} (want {n * nb * size})")
    return b.view(n, nb, size)


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
