"""The tensor-core kernels' PTX (jllm.cuda.ptx) run through an emulator of its instructions (tests/ptx_subset.py):
every code of a word, times its scale, exactly, at the output the kernels expect it. Needs neither a GPU nor
Triton, so CI runs it; the kernels around the assembly are tested in tests/test_cuda_matvec.py."""

import numpy as np
import pytest

from jllm.cuda import ptx
from ptx_subset import run


def f16_bits(v) -> np.ndarray:
    return np.asarray(v, dtype=np.float16).view(np.uint16).astype(np.uint32)


def as_f16(bits: np.ndarray) -> np.ndarray:
    return (bits & 0xFFFF).astype(np.uint16).view(np.float16)


def test_q4_k_codes_are_each_nibble_times_its_scale_exactly():
    rng = np.random.default_rng(0)
    n = 4096
    w = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    s = rng.integers(0, 64, n).astype(np.float16)
    s[:2] = (63, 0)                                      # the largest product, 15 * 63, and a zero scale
    w[:2] = 0xFFFFFFFF
    out = run(ptx.Q4_K_CODES, [w, f16_bits(s), f16_bits(s / np.float16(16))], 8)
    for p in range(8):
        want = ((w >> (4 * p)) & 15).astype(np.float16) * s          # exact: <= 945
        assert np.array_equal(as_f16(out[p]), want), p


def _six_code(q: np.ndarray, h: np.ndarray, t: int, pair: int, half: int) -> np.ndarray:
    """The 6-bit code the kernels' order puts at half `half` of pair `pair` of ql word t (jllm.cuda.ptx)."""
    byte = pair % 2 + 2 * half
    high = pair // 2
    low = (q >> (8 * byte + 4 * high)) & 15
    top = (h >> (8 * byte + 4 * t + 2 * high)) & 3
    return (low | (top << 4)).astype(np.int64)


@pytest.mark.parametrize("extremes", [False, True])
def test_q6_k_codes_are_each_code_minus_32_times_both_halves_of_its_scale_exactly(extremes):
    rng = np.random.default_rng(1)
    n = 4096
    q0, q1, h = (rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32) for _ in range(3))
    scale = rng.integers(-128, 128, n)
    if extremes:                                         # codes all 0 or all 63; scales -128 and 127
        q0[:] = q1[:] = h[:] = np.where(np.arange(n) % 2, 0xFFFFFFFF, 0)
        scale = np.where(np.arange(n) % 4 < 2, -128, 127)
    a, b = scale >> 4, scale & 15
    assert np.array_equal(16 * a + b, scale)
    af, bf = a.astype(np.float16), b.astype(np.float16)
    ins = [q0, q1, h]
    for v in (af, bf):
        ins += [f16_bits(v), f16_bits(v * np.float16(-1056)), f16_bits(v / np.float16(16)),
                f16_bits(v * np.float16(-96))]
    out = run(ptx.Q6_K_CODES, ins, 32)
    for t, q in enumerate((q0, q1)):
        for pair in range(4):
            for half in range(2):
                c = _six_code(q, h, t, pair, half) - 32
                i = 8 * half + 4 * t + pair
                assert np.array_equal(as_f16(out[i]).astype(np.int64), c * a), (t, pair, half)
                assert np.array_equal(as_f16(out[16 + i]).astype(np.int64), c * b), (t, pair, half)
                got = 16 * as_f16(out[i]).astype(np.int64) + as_f16(out[16 + i]).astype(np.int64)
                assert np.array_equal(got, c * scale)                    # up to 4,096 in magnitude


def test_the_emulator_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match="not emulated"):
        run("{ add.u32 $0, $1, $1; }", [np.zeros(1, np.uint32)], 1)
    with pytest.raises(ValueError, match="unknown operand"):
        run("{ mov.b32 $0, r9; }", [np.zeros(1, np.uint32)], 1)


def test_the_emulators_lop3_and_fma_follow_ptx():
    ones = np.array([0xFFFFFFFF], np.uint32)
    x = np.array([0x12345678], np.uint32)
    # (a & b) | c with a = x, b = 0x0F0F0F0F, c = 0: the table 0xea
    assert run("{ lop3.b32 $0, $1, 0x0F0F0F0F, 0, 0xea; }", [x], 1)[0][0] == 0x02040608
    assert run("{ lop3.b32 $0, $1, $2, 0, 0x3c; }", [x, ones], 1)[0][0] == 0x12345678 ^ 0xFFFFFFFF   # a ^ b
    # fma rounds once: 1025 * 3 - 3072 = 3, where a rounded product (3075 -> 3072 in f16) would give 0
    h = lambda v: f16_bits(np.array([v]))
    got = run("{ fma.rn.f16x2 $0, $1, $2, $3; }", [h(1025.0) | (h(1.0) << 16), h(3.0) | (h(2.0) << 16),
                                                   h(-3072.0) | (h(0.5) << 16)], 1)[0]
    assert float(as_f16(got)[0]) == 3.0 and float(as_f16(got >> 16)[0]) == 2.5
