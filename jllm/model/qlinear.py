"""Block-quantized linear layers for the native CPU kernel (jllm/kernels/qgemm.cpp): the GGUF's own low-bit
weights, read at their own width, with int8 activations quantized per row and per block of 32.

Representation: every block of 32 weights of a row is `s * q - m` with unsigned integers q and one f16
(scale s, min m) pair. Tiles of 16 rows are 4-bit (q < 16) or 8-bit. From the GGUF types:

    Q4_0  q = nibble, s = d, m = 8 d              (4-bit, exact up to the f16 rounding of s and m)
    Q4_1  q = nibble, s = d, m = -min             (4-bit)
    Q4_K  q = nibble, s = d * scale, m = dmin * min   (4-bit)
    Q5_0 / Q5_1 / Q5_K   the same with 5-bit q    (8-bit tiles)
    Q8_0  q = int8 + 128, s = d, m = 128 d        (8-bit)
    Q6_K, F16, BF16, F32  exactly dequantized, then requantized per block of 32 onto 255 levels
                          (q = round(v / s) + 128 with s = amax / 127): finer than Q6_K's own 64 levels.

A tile holding rows of both widths is stored at 8 bits (a 4-bit q is also a valid 8-bit q). Bytes per weight:
0.625 at 4 bits, 1.125 at 8 bits (int8 FBGEMM: 1.0 for every tensor, so a Q4_K_M file reads ~25 % fewer
bytes per token).

`reference_matmul` is the same arithmetic in plain torch, the oracle the kernel is tested against.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from jllm.gguf import quants
from jllm.gguf.quants import _fifth_bits, _half, _k_scales, _nibbles

TILE = 16
BLOCK = 32
GROUP_BYTES = 96 * 1024             # weights of a tile group stay in L2 while all row chunks pass over them
FOUR_BIT = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})
_ROWS = 2048                        # rows converted at a time (a multiple of TILE)


def _blocks(raw: torch.Tensor, ggml_type: T) -> torch.Tensor:
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    return raw.view(-1, type_size)


def _requantize(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [nb, 32] -> symmetric 255-level q (stored +128), s, m."""
    s = v.abs().amax(dim=1) / 127.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = (v * inv[:, None]).round_().add_(128).to(torch.uint8)
    return q, s, s * 128.0


def _requantize_affine(v: torch.Tensor, levels: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [nb, 32] -> affine q in [0, levels), s, m (value = s q - m, m = -min)."""
    lo, hi = v.amin(dim=1), v.amax(dim=1)
    s = (hi - lo) / (levels - 1)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = ((v - lo[:, None]) * inv[:, None]).round_().clamp_(0, levels - 1).to(torch.uint8)
    return q, s, -lo


def block_codes(raw: torch.Tensor, ggml_type: T, rows: int, cols: int, four_bit: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF bytes of `rows` rows -> (q uint8 [rows, cols], s float32 [rows, cols/32], m float32 [rows, cols/32])
    with value = s * q - m per block of 32 (see the module doc). four_bit: requantize types wider than 4 bits
    to 16 affine levels per block (for a draft model, where half the bytes matter more than precision)."""
    nb = rows * cols // BLOCK
    if four_bit and ggml_type not in FOUR_BIT:
        v = quants.dequantize(raw, ggml_type, (rows, cols)).view(nb, BLOCK)
        q, s, m = _requantize_affine(v)
    elif ggml_type == T.Q4_0:
        b = _blocks(raw, ggml_type)
        q, d = _nibbles(b[:, 2:], 1), _half(b, 0)[:, 0]
        s, m = d, d * 8.0
    elif ggml_type == T.Q4_1:
        b = _blocks(raw, ggml_type)
        q, s, m = _nibbles(b[:, 4:], 1), _half(b, 0)[:, 0], -_half(b, 2)[:, 0]
    elif ggml_type == T.Q5_0:
        b = _blocks(raw, ggml_type)
        q = _nibbles(b[:, 6:], 1) | _fifth_bits(b[:, 2:6])
        d = _half(b, 0)[:, 0]
        s, m = d, d * 16.0
    elif ggml_type == T.Q5_1:
        b = _blocks(raw, ggml_type)
        q = _nibbles(b[:, 8:], 1) | _fifth_bits(b[:, 4:8])
        s, m = _half(b, 0)[:, 0], -_half(b, 2)[:, 0]
    elif ggml_type == T.Q8_0:
        b = _blocks(raw, ggml_type)
        q = (b[:, 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        d = _half(b, 0)[:, 0]
        s, m = d, d * 128.0
    elif ggml_type in (T.Q4_K, T.Q5_K):
        b = _blocks(raw, ggml_type)
        ds, dm = _k_scales(b)
        q = _nibbles(b[:, 16:], 4) if ggml_type == T.Q4_K else quants.q5_k_codes(b)
        s, m = ds.reshape(-1), dm.reshape(-1)
    else:                                             # Q6_K and plain floats: requantize
        v = quants.dequantize(raw, ggml_type, (rows, cols)).view(nb, BLOCK)
        q, s, m = _requantize(v)
    return q.reshape(rows, cols), s.reshape(rows, -1).float(), m.reshape(rows, -1).float()


def _pack_tiles(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, four: bool) -> torch.Tensor:
    """Tiles of one width: q [16 t, K], s, m [16 t, K/32] -> uint8 [t, tile bytes] in the kernel's layout."""
    n, k = q.shape
    t, nb = n // TILE, k // BLOCK
    g = q.view(t, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4)            # [t, nb, group, row, 4]
    if four:
        data = g[:, :, :4] | (g[:, :, 4:] << 4)                        # [t, nb, 4, 16, 4]
    else:
        data = g
    data = data.reshape(t, nb, -1)
    sm = torch.stack([s.half().view(t, TILE, nb), m.half().view(t, TILE, nb)], dim=2)   # [t, 16, 2, nb]
    sm = sm.permute(0, 3, 2, 1).contiguous().view(torch.uint8).view(t, nb, 4 * TILE)
    return torch.cat([data, sm], dim=2).reshape(t, -1)


class PackedMatrix:
    """Collects rows (as block codes) and packs them into the kernel's tiles."""

    def __init__(self, cols: int):
        if cols % BLOCK:
            raise ValueError(f"a row of {cols} values is not a multiple of {BLOCK}")
        self.cols = cols
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []
        self.rows = 0

    def add(self, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, four: bool) -> None:
        self.parts.append((q, s, m, four))
        self.rows += q.shape[0]

    def pack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (data uint8, offsets int64 [t + 1], four bool [t]). A tile is 4-bit when all its rows are."""
        q = torch.cat([p[0] for p in self.parts])
        s = torch.cat([p[1] for p in self.parts])
        m = torch.cat([p[2] for p in self.parts])
        four = _tile_widths([(p[0].shape[0], p[3]) for p in self.parts])
        self.parts = []
        pad = -q.shape[0] % TILE
        if pad:
            q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
            s = torch.cat([s, s.new_zeros(pad, s.shape[1])])
            m = torch.cat([m, m.new_zeros(pad, m.shape[1])])
        blobs, t0 = [], 0
        flags = four.tolist()
        while t0 < len(flags):                         # runs of tiles of one width
            t1 = t0
            while t1 < len(flags) and flags[t1] == flags[t0]:
                t1 += 1
            r0, r1 = t0 * TILE, t1 * TILE
            blobs.append(_pack_tiles(q[r0:r1], s[r0:r1], m[r0:r1], flags[t0]).reshape(-1))
            t0 = t1
        sizes = torch.tensor([_tile_bytes(self.cols, f) for f in flags], dtype=torch.int64)
        offsets = torch.zeros(len(flags) + 1, dtype=torch.int64)
        torch.cumsum(sizes, 0, out=offsets[1:])
        return torch.cat(blobs), offsets, four


def _tile_widths(parts: list[tuple[int, bool]]) -> torch.Tensor:
    """Row blocks [(rows, four)] -> bool per tile of 16 rows: 4-bit when all its rows are (padding rows are)."""
    row_four = torch.cat([torch.full((rows,), four) for rows, four in parts])
    row_four = torch.cat([row_four, torch.ones(-row_four.numel() % TILE, dtype=torch.bool)])
    return row_four.view(-1, TILE).all(dim=1)


def _tile_bytes(cols: int, four: bool) -> int:
    return cols // BLOCK * ((256 if four else 512) + 4 * TILE)


def packed_bytes(parts: list[tuple[int, bool]], cols: int) -> int:
    """Bytes PackedMatrix.pack will produce for row blocks [(rows, four)] of width cols (for `jllm plan`)."""
    return sum(_tile_bytes(cols, four) for four in _tile_widths(parts).tolist())


def pack_gguf_rows(matrix: PackedMatrix, raw: np.ndarray | torch.Tensor, ggml_type: T, rows: int,
                   four_bit: bool = False) -> None:
    """Append the rows of one GGUF matrix (raw bytes) to `matrix`, converting _ROWS rows at a time."""
    data = quants._as_bytes(raw)
    cols = matrix.cols
    row_bytes = data.numel() // rows
    four = four_bit or ggml_type in FOUR_BIT
    for r0 in range(0, rows, _ROWS):
        r1 = min(rows, r0 + _ROWS)
        q, s, m = block_codes(data[r0 * row_bytes:r1 * row_bytes], ggml_type, r1 - r0, cols, four_bit)
        matrix.add(q, s, m, four)


class QLinear:
    """y = x @ W.T (+ b) on the native kernel."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, four: torch.Tensor, out_features: int,
                 in_features: int, bias: torch.Tensor | None = None):
        from jllm.kernels import qgemm

        self._op = qgemm().qmatmul
        self.data, self.offsets, self.four = data, offsets, four
        self.out_features, self.in_features = out_features, in_features
        self.bias = bias if bias is not None else torch.empty(0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.data, self.offsets, self.four, self.out_features, self.bias, GROUP_BYTES)

    def nbytes(self) -> int:
        return self.data.numel()


def unpack(data: torch.Tensor, offsets: torch.Tensor, four: torch.Tensor, n: int, k: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of PackedMatrix.pack -> (q uint8 [n, k], s, m float32 [n, k/32]); for tests and the oracle."""
    nb = k // BLOCK
    qs, ss, ms = [], [], []
    for t in range(four.numel()):
        tile = data[offsets[t]:offsets[t + 1]].view(nb, -1)
        f = bool(four[t])
        body = tile[:, :256 if f else 512]
        if f:
            b = body.view(nb, 4, TILE, 4)
            g = torch.cat([b & 0x0F, b >> 4], dim=1)                       # [nb, 8, 16, 4]
        else:
            g = body.view(nb, 8, TILE, 4)
        qs.append(g.permute(2, 0, 1, 3).reshape(TILE, k))
        sm = tile[:, -4 * TILE:].contiguous().view(torch.float16).view(nb, 2, TILE).float()
        ss.append(sm[:, 0].T)
        ms.append(sm[:, 1].T)
    return torch.cat(qs)[:n], torch.cat(ss)[:n], torch.cat(ms)[:n]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float [M, K] integers in [-127, 127], dx [M, K/32]), per row and block of 32."""
    M, K = x.shape
    b = x.view(M, K // BLOCK, BLOCK)
    amax = b.abs().amax(dim=2)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(b * inv[..., None])
    return q.view(M, K), d


def reference_matmul(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's arithmetic in float64 torch: sum_b s dx (q_w . q_x) - m dx sum(q_x)."""
    M, K = x.shape
    xq, dx = quantize_activations(x.float())
    xb = xq.double().view(M, K // BLOCK, BLOCK)
    wb = q.double().view(q.shape[0], K // BLOCK, BLOCK)
    dots = torch.einsum("mbi,nbi->mnb", xb, wb)                              # exact integers
    y = (dots * s.double()[None] * dx.double()[:, None]).sum(-1)
    y -= torch.einsum("nb,mb->mn", m.double(), dx.double() * xb.sum(-1))
    y = y.float()
    return y + bias if bias is not None else y
