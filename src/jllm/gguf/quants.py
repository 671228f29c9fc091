"""Dequantization of GGUF tensor types to float32, in torch, bit for bit equal to gguf-py.

Every supported type is a sequence of fixed-size blocks (ggml's block_* structs, little-endian), each
decoding to `block_size` consecutive values of a row. The decoders below follow gguf-py's
`gguf.quants` float32 arithmetic step by step, so results match it bitwise (signed zeros included):

    type  bytes/block -> values  layout                                     value
    Q8_0  34 -> 32     d:f16, q:int8[32]                                    q * d
    Q4_0  18 -> 32     d:f16, qs[16] (lo nibbles = 0..15, hi = 16..31)       (q - 8) * d
    Q4_1  20 -> 32     d:f16, m:f16, qs[16]                                 q * d + m
    Q5_0  22 -> 32     d:f16, qh:u32 (bit i = 5th bit of value i), qs[16]   (q - 16) * d
    Q5_1  24 -> 32     d:f16, m:f16, qh:u32, qs[16]                         q * d + m
    Q4_K  144 -> 256   d, dmin:f16, 12 bytes of 6-bit (scale, min) x 8, qs[128]
                       value = (d*scale) * q - (dmin*min), per sub-block of 32
    Q5_K  176 -> 256   as Q4_K plus qh[32] (bit j of qh[l] = 5th bit of value 32*j + l)
    Q6_K  210 -> 256   ql[128], qh[64], scales:int8[16], d:f16
                       value = (d*scale) * (q - 32), per sub-block of 16

Large tensors are decoded in chunks of blocks so the integer temporaries stay small and cache-resident;
`dequantize_rows` hands out row chunks so a caller never has to hold a whole float32 matrix.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from jllm.errors import JllmError

# Torch threads used while decoding. One, on purpose: the decode is ~10 short memory-bound ops per chunk,
# each a fork/join of torch's OpenMP pool, and when the machine has other busy processes every join waits
# for a descheduled thread: on this project's shared 2-core box (load ~4), 2 threads took 10.5 s for the
# 1.5B model's embedding matrix where 1 thread took 0.23 s. A second thread gained only ~1.4x in a
# microbenchmark at lighter load. The caller's own setting is restored after every chunk.
DECODE_THREADS = 1

# Values decoded per inner step (4 MB of float32): large enough to amortise torch's ~5 us per op, small
# enough that the temporaries stay in the CPU cache.
CHUNK_VALUES = 1 << 20

_NIB = 0x0F0F0F0F0F0F0F0F          # the low nibble of every byte of an int64 word
_LSB = 0x0101010101010101          # bit 0 of every byte
_SHIFT8 = torch.arange(8, dtype=torch.int64).view(8, 1)
_SHIFT4x2 = torch.tensor([0, 2, 4, 6], dtype=torch.int64).view(4, 1)
# byte x -> int64 word whose byte k is (bit k of x) << 4: turns a bit mask into the 5th bits of 8 values
_SPREAD = ((((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) << 4)
           .to(torch.uint8).view(torch.int64).view(256))


def _words(x: torch.Tensor) -> torch.Tensor:
    """[nb, n] bytes (n a multiple of 8) -> [nb, n // 8] int64, copying only if misaligned."""
    if x.stride(0) % 8 or x.storage_offset() % 8:
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(torch.int64)


def _half(b: torch.Tensor, byte: int) -> torch.Tensor:
    """The f16 at byte offset `byte` of each block, as float32: [nb, ts] uint8 -> [nb, 1]."""
    return b[:, byte:byte + 2].view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """Unpack [nb, n] bytes split in `groups` equal groups: group g's low nibbles become values
    2g*(n/groups)..., its high nibbles the next n/groups values. -> [nb, 2n] uint8.
    Works on int64 words, 8 bytes per element."""
    nb, n = qs.shape
    w = _words(qs).view(nb, groups, 1, n // groups // 8)
    q = torch.empty(nb, groups, 2, n // groups // 8, dtype=torch.int64)
    torch.bitwise_and(w, _NIB, out=q[:, :, :1])
    torch.bitwise_and(w >> 4, _NIB, out=q[:, :, 1:])
    return q.view(torch.uint8).view(nb, 2 * n)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """qh [nb, 4] bytes, a little-endian u32 whose bit i is the 5th bit of value i -> [nb, 32] uint8
    of (bit i) << 4."""
    idx = qh.reshape(-1).to(torch.int32)
    return _SPREAD.index_select(0, idx).view(torch.uint8).view(qh.shape[0], 32)


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b[:, 2:].view(torch.int8))
    out.mul_(_half(b, 0))


def _q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_nibbles(b[:, 2:], 1))
    out.sub_(8)
    out.mul_(_half(b, 0))


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_nibbles(b[:, 4:], 1))
    out.mul_(_half(b, 0))
    out.add_(_half(b, 2))


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 6:], 1)
    q |= _fifth_bits(b[:, 2:6])
    out.copy_(q)
    out.sub_(16)
    out.mul_(_half(b, 0))


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 8:], 1)
    q |= _fifth_bits(b[:, 4:8])
    out.copy_(q)
    out.mul_(_half(b, 0))
    out.add_(_half(b, 2))


def k_scale_codes(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K block header -> (d, dmin float32 [nb], scales, mins uint8 [nb, 8]) (also used by model/qlinear).

    Bytes 4..15 hold eight 6-bit scales and mins: bytes 0-3 = scale lo 6 bits (top 2 = scale 4-7 hi),
    bytes 4-7 = min lo 6 bits (top 2 = min 4-7 hi), bytes 8-11 = scale 4-7 lo nibble | min 4-7 lo nibble.
    """
    nb = b.shape[0]
    s = b[:, 4:16].view(nb, 3, 4)
    a, m, c = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (c >> 4) | ((m >> 2) & 0x30)], dim=1)
    return _half(b, 0)[:, 0], _half(b, 2)[:, 0], sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K block header -> (d*scale, dmin*min), each [nb, 8, 1] float32."""
    d, dmin, sc, mn = k_scale_codes(b)
    return (d[:, None] * sc).unsqueeze(-1), (dmin[:, None] * mn).unsqueeze(-1)


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    ds, dm = _k_scales(b)
    out = out.view(-1, 8, 32)
    out.copy_(_nibbles(b[:, 16:], 4).view(-1, 8, 32))
    out.mul_(ds)
    out.sub_(dm)


def q5_k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks [nb, 176] -> their unsigned 5-bit values, uint8 [nb, 8, 32] (also used by model/qlinear)."""
    nb = b.shape[0]
    q = _nibbles(b[:, 48:], 4).view(nb, 8, 32)
    qh = _words(b[:, 16:48]).view(nb, 1, 4)             # bit j of byte l -> value 32j + l
    q.view(torch.int64).bitwise_or_(((qh >> _SHIFT8) & _LSB) << 4)
    return q


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    ds, dm = _k_scales(b)
    q = q5_k_codes(b)
    out = out.view(-1, 8, 32)
    out.copy_(q)
    out.mul_(ds)
    out.sub_(dm)


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    # value 128h + 32s + l: 4 low bits from ql (as _nibbles with 2 groups), 2 high bits at bit 2s of
    # qh[32h + l]
    q = _nibbles(b[:, :128], 2).view(nb, 2, 4, 32)
    qh = _words(b[:, 128:192]).view(nb, 2, 1, 4)
    q.view(torch.int64).bitwise_or_(((qh >> _SHIFT4x2) & (3 * _LSB)) << 4)
    d = (_half(b, 208) * b[:, 192:208].view(torch.int8)).unsqueeze(-1)    # [nb, 16, 1]
    out = out.view(-1, 16, 16)
    out.copy_(q.view(nb, 16, 16))
    out.sub_(32)
    out.mul_(d)


def _f32(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.view(torch.float32))


def _f16(b: torch.Tensor, out: torch.Tensor) -> None:
    h = b.view(torch.float16).view(-1)
    out.copy_(h.view(out.shape))
    nan = out.isnan()
    if nan.any():
        # the CPU's conversion quiets signalling NaNs; gguf-py (numpy) keeps every payload bit
        bits = h.view(torch.int16)[nan.view(-1)].to(torch.int32)     # sign-extended
        out.view(torch.int32)[nan] = (bits << 13) | 0x7F800000


def _bf16(b: torch.Tensor, out: torch.Tensor) -> None:
    bits = out.view(torch.int32)
    bits.copy_(b.view(torch.int16))
    bits <<= 16


# type -> decoder(blocks [nb, type_size] uint8, out [nb, block_size] float32). Plain floats are decoded
# as "blocks" of one value.
_DECODERS: dict[T, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.F32: _f32, T.F16: _f16, T.BF16: _bf16,
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
    T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}

SUPPORTED_TYPES = frozenset(_DECODERS)


def _layout(ggml_type: T, shape: tuple[int, ...], nbytes: int) -> tuple[int, int, int, int]:
    """-> (rows, cols, block_size, type_size), after checking the type and the byte count."""
    if ggml_type not in _DECODERS:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        name = getattr(ggml_type, "name", str(ggml_type))
        raise JllmError(f"tensor type {name} is not supported (supported: {names})")
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    cols = shape[-1] if shape else 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    if cols % block_size:
        raise JllmError(f"{ggml_type.name} tensor of shape {tuple(shape)}: a row of {cols} values is not "
                        f"a multiple of the block size {block_size}")
    expected = rows * cols // block_size * type_size
    if nbytes != expected:
        raise JllmError(f"{ggml_type.name} tensor of shape {tuple(shape)} needs {expected} bytes, "
                        f"got {nbytes}")
    return rows, cols, block_size, type_size


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The raw bytes as a flat uint8 tensor (shares memory where it can; never written to)."""
    if isinstance(raw, np.ndarray):
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        if raw.flags.writeable:
            return torch.from_numpy(raw)
        with warnings.catch_warnings():     # read-only mmap views: torch warns, but we only read
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(raw)
    raw = raw.contiguous().view(-1).view(torch.uint8)
    if raw.storage_offset() % 8:            # int64 / f16 views below need aligned offsets
        raw = raw.clone()
    return raw


@contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


def _decode_blocks(data: torch.Tensor, decode, block_size: int, type_size: int,
                   b0: int, b1: int, out: torch.Tensor) -> None:
    """Decode blocks b0..b1 of `data` into out (flat, (b1 - b0) * block_size values)."""
    step = max(8, CHUNK_VALUES // block_size // 8 * 8)
    out = out.view(-1, block_size)
    with _torch_threads(DECODE_THREADS):
        for s in range(b0, b1, step):
            e = min(b1, s + step)
            decode(data[s * type_size:e * type_size].view(e - s, type_size), out[s - b0:e - b0])


def dequantize(raw: np.ndarray | torch.Tensor, ggml_type: T, shape: tuple[int, ...],
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a whole tensor: raw bytes -> float32 tensor of `shape` (torch order, last dim contiguous).

    `out`, if given, must be a contiguous float32 tensor with `shape`'s number of values; it is filled
    and returned (viewed as `shape`).
    """
    shape = tuple(shape)
    data = _as_bytes(raw)
    rows, cols, block_size, type_size = _layout(ggml_type, shape, data.numel())
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != rows * cols:
        raise ValueError(f"out must be a contiguous float32 tensor of {rows * cols} values")
    n_blocks = rows * cols // block_size
    if n_blocks:
        _decode_blocks(data, _DECODERS[ggml_type], block_size, type_size, 0, n_blocks, out.view(-1))
    return out.view(shape)


def dequantize_rows(raw: np.ndarray | torch.Tensor, ggml_type: T, shape: tuple[int, ...],
                    rows_per_chunk: int, out: torch.Tensor | None = None
                    ) -> Iterator[tuple[int, torch.Tensor]]:
    """Decode a tensor in row chunks: yields (first_row, float32 [n, cols]) with n <= rows_per_chunk.

    The tensor is seen as a matrix of prod(shape[:-1]) rows. Each chunk is a fresh tensor the caller may
    keep, unless `out` (a contiguous float32 buffer of at least rows_per_chunk * cols values) is given:
    then every chunk is a view of it, overwritten by the next one, which saves the page faults of a fresh
    allocation per chunk (about a quarter of the time). Chunks of a million values or more keep torch's
    per-op overhead negligible. Peak memory is one chunk plus small temporaries.
    """
    shape = tuple(shape)
    data = _as_bytes(raw)
    rows, cols, block_size, type_size = _layout(ggml_type, shape, data.numel())
    if rows_per_chunk < 1:
        raise ValueError("rows_per_chunk must be at least 1")
    if out is not None and (out.dtype != torch.float32 or not out.is_contiguous()
                            or out.numel() < min(rows, rows_per_chunk) * cols):
        raise ValueError(f"out must be a contiguous float32 tensor of at least "
                         f"{min(rows, rows_per_chunk) * cols} values")
    decode, blocks_per_row = _DECODERS[ggml_type], cols // block_size
    for r0 in range(0, rows, rows_per_chunk):
        r1 = min(rows, r0 + rows_per_chunk)
        if out is None:
            chunk = torch.empty(r1 - r0, cols, dtype=torch.float32)
        else:
            chunk = out.view(-1)[:(r1 - r0) * cols].view(r1 - r0, cols)
        _decode_blocks(data, decode, block_size, type_size, r0 * blocks_per_row, r1 * blocks_per_row,
                       chunk.view(-1))
        yield r0, chunk
