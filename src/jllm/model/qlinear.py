"""Block-quantized linear layers for the native CPU kernel (jllm/kernels/qgemm.cpp): the GGUF's own low-bit
weights, read at their own width, with int8 activations quantized per row and per block of 32.

Representation: every block of 32 weights of a row is `s * q - m` with unsigned integers q and a (scale s,
min m) pair. Tiles of 16 rows hold one kind (qgemm.cpp has the byte layouts):

    kind      q         (s, m) stored as                                     bytes a weight
    8-bit     < 256     f16 per block                                        1.125
    4-bit     < 16      f16 per block                                        0.625
    compact   < 16      f16 units per super-block of g blocks, int8 codes    0.578 (g = 8), 0.580 (g = 7)
    6-bit     < 64      as compact                                           0.828 (g = 8)

From the GGUF types (row_kind):

    Q4_K  compact, exactly: units its f16 d and dmin, codes its 6-bit scales and mins
    Q5_K  6-bit, exactly, the same way
    Q4_0  4-bit: q = nibble, s = d, m = 8 d        (exact up to the f16 rounding of s and m)
    Q4_1  4-bit: q = nibble, s = d, m = -min
    Q6_K  6-bit: dequantized, requantized per block onto 64 affine levels (_requantize_compact: its scales are
          per 16 inputs and do not fit blocks of 32)
    Q5_0 / Q5_1   8-bit, exactly: 5-bit q, s = d, m = 16 d or -min
    Q8_0  8-bit: q = int8 + 128, s = d, m = 128 d
    F16, BF16, F32  8-bit: requantized per block onto 255 levels (q = round(v / s) + 128, s = amax / 127)
    with four_bit (a draft model, `native4`): everything but Q4_0/Q4_1 compact, requantized onto 16 levels

A tile whose rows differ takes the narrowest kind that holds every row's q and scales (_tile_kind).

`reference_matmul` is the same arithmetic in plain torch, the oracle the kernel is tested against.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from jllm.errors import JllmError
from jllm.gguf import quants
from jllm.gguf.quants import _fifth_bits, _half, _nibbles

TILE = 16
BLOCK = 32
GROUP_BYTES = 96 * 1024             # weights of a tile group stay in L2 while all row chunks pass over them
FOUR_BIT = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})
EIGHT, FOUR, COMPACT, SIX = 0, 1, 2, 3       # tile kinds (qgemm.cpp's Kind); see _tile_kind for mixed tiles
BLOCK_BYTES = {EIGHT: 512 + 4 * TILE, FOUR: 256 + 4 * TILE, COMPACT: 256 + 2 * TILE, SIX: 384 + 2 * TILE}
UNIT_BYTES = 4 * TILE               # + per super-block of COMPACT and SIX tiles: f16 (D, Dm) per row
WITH_UNITS = (COMPACT, SIX)
LEVELS = {EIGHT: 256, FOUR: 16, COMPACT: 16, SIX: 64}     # q < LEVELS[kind]
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


def super_blocks(nb: int) -> int:
    """Blocks per super-block of a compact tile whose rows hold nb blocks: the largest divisor of nb up to 8
    (8 for Q4_K, whose super-blocks are 256 inputs; 7 for the 896 inputs of a 0.5B model). qgemm.cpp: same.
    A prime block count would give 1, and a compact block would then take 352 bytes, more than a 4-bit one's
    320; no model in use has one (5 to 8 here)."""
    g = 8
    while nb % g:
        g -= 1
    return g


def row_kind(ggml_type: T, four_bit: bool = False) -> int:
    """The tile kind rows of this GGUF type get. Q6_K is requantized onto 64 levels per block (6-bit tiles,
    0.83 bytes a weight against 1.125 at 8 bits; the 1.5B's KL to exact 0.0015 against 0.0005, BENCHMARKS.md). four_bit:
    types wider than 4 bits are requantized to compact 4-bit (a draft model, where fewer bytes matter more
    than precision)."""
    if ggml_type == T.Q4_K or (four_bit and ggml_type not in FOUR_BIT):
        return COMPACT
    if ggml_type in (T.Q5_K, T.Q6_K):
        return SIX
    return FOUR if ggml_type in FOUR_BIT else EIGHT


def compact_codes(raw: torch.Tensor, ggml_type: T, rows: int, cols: int, kind: int = COMPACT
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF bytes of `rows` rows -> (q uint8 [rows, cols], units float32 [rows, ns, 2] (D, Dm; f16 values),
    codes int8 [rows, nb, 2] (scale, min)): value = D code_s q - Dm code_m per block, ns super-blocks of
    super_blocks(nb) blocks, q below LEVELS[kind]. Q4_K maps exactly onto COMPACT and Q5_K onto SIX (the
    same scale layout with 5-bit q); everything else is requantized (_requantize_compact)."""
    nb = cols // BLOCK
    g = super_blocks(nb)
    if (ggml_type, kind) in ((T.Q4_K, COMPACT), (T.Q5_K, SIX)):
        b = _blocks(raw, ggml_type)
        d, dmin, sc, mn = quants.k_scale_codes(b)
        q = _nibbles(b[:, 16:], 4) if ggml_type == T.Q4_K else quants.q5_k_codes(b)
        units = torch.stack([d, dmin], dim=-1)
        codes = torch.stack([sc, mn], dim=-1).to(torch.int8)
    else:
        v = quants.dequantize(raw, ggml_type, (rows, cols)).view(rows, nb // g, g, BLOCK)
        q, units, codes = _requantize_compact(v, LEVELS[kind])
    return q.reshape(rows, cols), units.reshape(rows, nb // g, 2).float(), codes.reshape(rows, nb, 2)


def _requantize_compact(v: torch.Tensor, levels: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [rows, ns, g, 32] -> affine q in [0, levels), units [rows, ns, 2], codes int8 [rows, ns, g, 2].
    The block's (s, m) are rounded up onto their super-block's int8 grid, m first and then s so that the grid
    -m .. -m + (levels - 1) s still spans the block; q is fitted to the rounded pair, so every weight is
    within half a step of its value."""
    lo, hi = v.amin(dim=-1), v.amax(dim=-1)
    unit_m = _unit((-lo).abs().amax(dim=-1))
    code_m = _codes(-lo, unit_m)
    m2 = unit_m[..., None] * code_m                                 # >= -lo: the grid starts at or below lo
    s = (hi + m2) / (levels - 1)                                    # the step that reaches hi from -m2
    unit_s = _unit(s.amax(dim=-1))
    code_s = _codes(s, unit_s)
    s2 = unit_s[..., None] * code_s
    inv = torch.where(s2 > 0, 1.0 / s2, torch.zeros_like(s2))
    q = ((v + m2[..., None]) * inv[..., None]).round_().clamp_(0, levels - 1).to(torch.uint8)
    return q, torch.stack([unit_s, unit_m], dim=-1), torch.stack([code_s, code_m], dim=-1).to(torch.int8)


def _unit(amax: torch.Tensor) -> torch.Tensor:
    """The smallest f16 value >= amax / 127 (as float32), so no code needs more than 127: rounding to nearest
    instead clipped the largest blocks of tiny tensors, whose units are f16 subnormals."""
    u = (amax / 127).half()
    short = u.float() * 127 < amax
    u = torch.where(short, (u.view(torch.int16) + 1).view(torch.float16), u).float()
    if not torch.isfinite(u).all():
        raise JllmError(f"weights up to {float(amax.max()):.3g} are beyond f16 scale units")
    return u


def _codes(x: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """x / unit rounded up (x = unit * code >= x), in [-127, 127] since unit >= max |x| / 127."""
    inv = torch.where(unit > 0, 1.0 / unit, torch.zeros_like(unit))
    code = (x * inv[..., None]).ceil()
    return torch.where(unit[..., None] * code < x, code + 1, code).clamp(-127, 127)


def compact_scales(units: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """units [rows, ns, 2], codes [rows, nb, 2] -> s, m float32 [rows, nb], exactly as the kernel forms them."""
    g = codes.shape[1] // units.shape[1]
    u = units.repeat_interleave(g, dim=1)
    sm = u * codes.float()
    return sm[..., 0].contiguous(), sm[..., 1].contiguous()


def block_codes(raw: torch.Tensor, ggml_type: T, rows: int, cols: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF bytes of `rows` rows of a type held in 8-bit or 4-bit tiles -> (q uint8 [rows, cols], s float32
    [rows, cols/32], m float32 [rows, cols/32]) with value = s * q - m per block of 32 (see the module doc)."""
    nb = rows * cols // BLOCK
    if ggml_type == T.Q4_0:
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
    elif ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K):
        raise ValueError(f"{ggml_type.name} rows go into compact or 6-bit tiles: compact_codes")
    else:                                             # plain floats: requantize
        v = quants.dequantize(raw, ggml_type, (rows, cols)).view(nb, BLOCK)
        q, s, m = _requantize(v)
    return q.reshape(rows, cols), s.reshape(rows, -1).float(), m.reshape(rows, -1).float()


def _pack_tiles(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, units: torch.Tensor, codes: torch.Tensor,
                kind: int) -> torch.Tensor:
    """Tiles of one kind: q [16 t, K], s, m [16 t, K/32] (COMPACT, SIX: units [16 t, ns, 2], codes
    [16 t, K/32, 2]) -> uint8 [t, tile bytes] in the kernel's layout (qgemm.cpp)."""
    n, k = q.shape
    t, nb = n // TILE, k // BLOCK
    g = q.view(t, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4)            # [t, nb, group, row, 4]
    if kind == EIGHT:
        data = g.reshape(t, nb, -1)
    else:
        lo = g & 0x0F
        data = (lo[:, :, :4] | (lo[:, :, 4:] << 4)).reshape(t, nb, -1)
        if kind == SIX:                                               # + 2 planes of the 2 high bits
            hb = g >> 4
            planes = [hb[:, :, i] | (hb[:, :, i + 1] << 2) | (hb[:, :, i + 2] << 4) | (hb[:, :, i + 3] << 6)
                      for i in (0, 4)]
            data = torch.cat([data] + [p.reshape(t, nb, -1) for p in planes], dim=2)
    if kind not in WITH_UNITS:
        sm = torch.stack([s.half().view(t, TILE, nb), m.half().view(t, TILE, nb)], dim=2)   # [t, 16, 2, nb]
        sm = sm.permute(0, 3, 2, 1).contiguous().view(torch.uint8).view(t, nb, 4 * TILE)
        return torch.cat([data, sm], dim=2).reshape(t, -1)
    ns = units.shape[1]
    cs = codes.view(t, TILE, nb, 2).permute(0, 2, 3, 1).contiguous().view(torch.uint8)     # [t, nb, 2, 16]
    blocks = torch.cat([data, cs.view(t, nb, 2 * TILE)], dim=2).view(t, ns, -1)
    us = units.half().view(t, TILE, ns, 2).permute(0, 2, 3, 1).contiguous().view(torch.uint8)  # [t, ns, 2, 32]
    return torch.cat([us.view(t, ns, UNIT_BYTES), blocks], dim=2).reshape(t, -1)


class PackedMatrix:
    """Collects rows (as block codes) and packs them into the kernel's tiles."""

    def __init__(self, cols: int):
        if cols % BLOCK:
            raise ValueError(f"a row of {cols} values is not a multiple of {BLOCK}")
        self.cols = cols
        self.nb = cols // BLOCK
        self.ns = self.nb // super_blocks(self.nb)
        self.parts: list[tuple] = []
        self.rows = 0

    def add(self, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, kind: int) -> None:
        """Rows given as (q, s, m) per block, for 8-bit or 4-bit tiles."""
        if kind in WITH_UNITS:
            raise ValueError("compact and 6-bit rows come with their codes: add_compact")
        _check_levels(q, kind)
        rows = q.shape[0]
        self.parts.append((q, s, m, torch.zeros(rows, self.ns, 2), torch.zeros(rows, self.nb, 2, dtype=torch.int8),
                           kind))
        self.rows += rows

    def add_compact(self, q: torch.Tensor, units: torch.Tensor, codes: torch.Tensor, kind: int = COMPACT) -> None:
        """Rows with compact scales (compact_codes), for COMPACT or SIX tiles; in a tile of another kind they
        use s and m."""
        if kind not in WITH_UNITS:
            raise ValueError("add_compact takes compact or 6-bit rows")
        _check_levels(q, kind)
        s, m = compact_scales(units, codes)
        self.parts.append((q, s, m, units, codes, kind))
        self.rows += q.shape[0]

    def pack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (data uint8, offsets int64 [t + 1], kinds uint8 [t]) (_tile_kind: the kind of a tile)."""
        q, s, m, units, codes = (torch.cat([p[i] for p in self.parts]) for i in range(5))
        kinds = _tile_kinds([(p[0].shape[0], p[5]) for p in self.parts])
        self.parts = []
        pad = -q.shape[0] % TILE
        if pad:
            q, s, m, units, codes = (torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in (q, s, m, units, codes))
        blobs, t0 = [], 0
        flags = kinds.tolist()
        while t0 < len(flags):                         # runs of tiles of one kind
            t1 = t0
            while t1 < len(flags) and flags[t1] == flags[t0]:
                t1 += 1
            r0, r1 = t0 * TILE, t1 * TILE
            blobs.append(_pack_tiles(q[r0:r1], s[r0:r1], m[r0:r1], units[r0:r1], codes[r0:r1], flags[t0]).reshape(-1))
            t0 = t1
        sizes = torch.tensor([_tile_bytes(self.cols, f) for f in flags], dtype=torch.int64)
        offsets = torch.zeros(len(flags) + 1, dtype=torch.int64)
        torch.cumsum(sizes, 0, out=offsets[1:])
        return torch.cat(blobs), offsets, kinds


def _check_levels(q: torch.Tensor, kind: int) -> None:
    top = LEVELS[kind]
    if q.numel() and int(q.max()) >= top:
        raise ValueError(f"q reaches {int(q.max())}, beyond the {top} levels of tile kind {kind}")


def _tile_kind(kinds: set[int]) -> int:
    """The kind of a tile whose rows have these kinds: theirs if one, else the narrowest that holds every
    row's q and has its scales (4-bit q fit 6-bit and 8-bit tiles; FOUR rows have no compact codes)."""
    if len(kinds) == 1:
        return next(iter(kinds))
    if kinds <= {FOUR, COMPACT}:
        return FOUR
    if kinds <= {SIX, COMPACT}:
        return SIX
    return EIGHT


def _tile_kinds(parts: list[tuple[int, int]]) -> torch.Tensor:
    """Row blocks [(rows, kind)] -> uint8 kind per tile of 16 rows (padding rows take any)."""
    row_kind = [kind for rows, kind in parts for _ in range(rows)]
    return torch.tensor([_tile_kind(set(row_kind[i:i + TILE])) for i in range(0, len(row_kind), TILE)],
                        dtype=torch.uint8)


def _tile_bytes(cols: int, kind: int) -> int:
    nb = cols // BLOCK
    return nb * BLOCK_BYTES[kind] + (nb // super_blocks(nb) * UNIT_BYTES if kind in WITH_UNITS else 0)


def packed_bytes(parts: list[tuple[int, int]], cols: int) -> int:
    """Bytes PackedMatrix.pack will produce for row blocks [(rows, kind)] of width cols (for `jllm plan`)."""
    return sum(_tile_bytes(cols, kind) for kind in _tile_kinds(parts).tolist())


def pack_gguf_rows(matrix: PackedMatrix, raw: np.ndarray | torch.Tensor, ggml_type: T, rows: int,
                   four_bit: bool = False) -> None:
    """Append the rows of one GGUF matrix (raw bytes) to `matrix`, converting _ROWS rows at a time; four_bit:
    requantize wider types to compact 4-bit (row_kind)."""
    data = quants._as_bytes(raw)
    cols = matrix.cols
    row_bytes = data.numel() // rows
    kind = row_kind(ggml_type, four_bit)
    for r0 in range(0, rows, _ROWS):
        r1 = min(rows, r0 + _ROWS)
        part = data[r0 * row_bytes:r1 * row_bytes]
        if kind in WITH_UNITS:
            matrix.add_compact(*compact_codes(part, ggml_type, r1 - r0, cols, kind), kind)
        else:
            matrix.add(*block_codes(part, ggml_type, r1 - r0, cols), kind)


class QLinear:
    """y = x @ W.T (+ b) on the native kernel."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, kinds: torch.Tensor, out_features: int,
                 in_features: int, bias: torch.Tensor | None = None):
        from jllm.kernels import qgemm

        self._op = qgemm().qmatmul
        self.data, self.offsets, self.kinds = data, offsets, kinds
        self.out_features, self.in_features = out_features, in_features
        self.bias = bias if bias is not None else torch.empty(0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.data, self.offsets, self.kinds, self.out_features, self.bias, GROUP_BYTES)

    def nbytes(self) -> int:
        return self.data.numel()


def unpack(data: torch.Tensor, offsets: torch.Tensor, kinds: torch.Tensor, n: int, k: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of PackedMatrix.pack -> (q uint8 [n, k], s, m float32 [n, k/32]); for tests and the oracle."""
    nb = k // BLOCK
    ns = nb // super_blocks(nb)
    qs, ss, ms = [], [], []
    for t in range(kinds.numel()):
        tile = data[offsets[t]:offsets[t + 1]]
        kind = int(kinds[t])
        if kind in WITH_UNITS:
            supers = tile.view(ns, -1)
            units = supers[:, :UNIT_BYTES].contiguous().view(torch.float16).view(ns, 2, TILE).float()
            blocks = supers[:, UNIT_BYTES:].reshape(nb, -1)
            codes = blocks[:, -2 * TILE:].contiguous().view(torch.int8).view(nb, 2, TILE)
            s, m = compact_scales(units.permute(2, 0, 1), codes.permute(2, 0, 1))
            ss.append(s)
            ms.append(m)
        else:
            blocks = tile.view(nb, -1)
            sm = blocks[:, -4 * TILE:].contiguous().view(torch.float16).view(nb, 2, TILE).float()
            ss.append(sm[:, 0].T)
            ms.append(sm[:, 1].T)
        if kind != EIGHT:
            b = blocks[:, :256].reshape(nb, 4, TILE, 4)
            g = torch.cat([b & 0x0F, b >> 4], dim=1)                       # [nb, 8, 16, 4]
            if kind == SIX:
                planes = blocks[:, 256:384].reshape(nb, 2, 1, TILE, 4)
                hb = torch.cat([(planes >> (2 * i)) & 3 for i in range(4)], dim=2)   # [nb, 2, 4, 16, 4]
                g = g | (hb.reshape(nb, 8, TILE, 4) << 4)
        else:
            g = blocks[:, :512].reshape(nb, 8, TILE, 4)
        qs.append(g.permute(2, 0, 1, 3).reshape(TILE, k))
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
