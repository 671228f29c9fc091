"""4-bit and 6-bit codes to float32 inside the GPU's matvec kernels, cheaply (q4_k.py, q6_k.py).

A decode step's matvecs are bound by the integer work of unpacking codes (profiled in SASS: the first Q4_K
and Q6_K kernels spent 8-13 instructions a weight, half of them integer ops, which issue at half the rate of
float ones, and the Q4_K one converted with I2F, at a quarter). Here a 32-bit word of four codes, one a byte
(after one mask of all four), becomes four floats with one byte permute each: the byte under an exponent of
2^23 (0x4B0000bb is the float 2^23 + bb, exactly), and one float subtraction of the offset. On a GPU the
permute is PTX `prmt`; in Triton's interpreter (the CPU tests) the same words come from shifts and masks.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


@triton.jit
def byte_floats(w, ASM: tl.constexpr):
    """int32 words of four bytes b0..b3 -> four int32 words 0x4B0000bi (bitcast: the floats 2^23 + bi)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 m; mov.b32 m, 0x4B000000; prmt.b32 $0, $4, m, 0x7540; prmt.b32 $1, $4, m, 0x7541;"
            " prmt.b32 $2, $4, m, 0x7542; prmt.b32 $3, $4, m, 0x7543; }",
            "=r,=r,=r,=r,r", [w], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        return ((w & 255) | 0x4B000000, ((w >> 8) & 255) | 0x4B000000, ((w >> 16) & 255) | 0x4B000000,
                ((w >> 24) & 255) | 0x4B000000)


@triton.jit
def as_float(w, offset: tl.constexpr):
    """A byte_floats word -> its byte minus `offset`, a float32 (exact: both are integers below 2^24)."""
    return w.to(tl.float32, bitcast=True) - (8388608.0 + offset)


ASM = os.environ.get("TRITON_INTERPRET") != "1"    # the interpreter runs no PTX: shifts and masks there


def warps(block_n: int, sb: int) -> int:
    """Warps a program: as many as its tile's words fill at four a thread, at most 4 (a tile smaller than its
    threads is held twice over, which gave wrong sums for 8 outputs x 1 super-block on the H200)."""
    return max(1, min(4, block_n * sb // 4))
