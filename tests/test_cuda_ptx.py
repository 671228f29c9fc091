"""The tensor-core kernels' PTX (jllm.cuda.ptx) run through an emulator of its instructions (tests/ptx_subset.py):
every code of a word, times its scale, exactly, at the output the kernels expect it. Needs neither a GPU nor
Triton, so CI runs it; the kernels around the assembly are tested in tests/test_cuda_matvec.py."""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")          # before triton is imported (the tests that use it)

from jllm.cuda import ptx  # noqa: E402
from ptx_subset import run  # noqa: E402


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


try:                                                        # the tests of the kernels' other path need triton
    import triton
    import triton.language as tl

    from jllm.cuda import mma
except ImportError:
    triton = None


def _interpreter():
    if triton is None:
        pytest.skip("triton is not installed (it comes with torch's CUDA builds)")
    if torch.cuda.is_available():
        pytest.skip("the interpreter's path: on a GPU the kernels run the PTX itself (tests/test_cuda_matvec.py)")


if triton is not None:
    @triton.jit
    def _q4(w_ptr, s_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        o = mma._q4_codes(tl.load(w_ptr + i), tl.load(s_ptr + i), False)
        for j in tl.static_range(8):
            tl.store(o_ptr + j * N + i, o[j])

    @triton.jit
    def _q6(q0_ptr, q1_ptr, h_ptr, a_ptr, b_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        o = mma._q6_codes(tl.load(q0_ptr + i), tl.load(q1_ptr + i), tl.load(h_ptr + i), tl.load(a_ptr + i),
                          tl.load(b_ptr + i), False)
        for j in tl.static_range(32):
            tl.store(o_ptr + j * N + i, o[j])


def test_the_kernels_other_path_puts_the_same_values_where_the_ptx_does():
    """The interpreter's shifts and masks (mma._q4_codes / _q6_codes without the assembly, which the CPU tests
    of the kernels run) against the emulated PTX, output by output, on the same words: the two paths agree on
    what lands where."""
    _interpreter()
    n = 256
    rng = np.random.default_rng(2)
    words = [rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32) for _ in range(3)]
    s = rng.integers(0, 64, n).astype(np.float16)
    out = torch.empty(8, n, dtype=torch.float16)
    _q4[(1,)](torch.from_numpy(words[0].view(np.int32)), torch.from_numpy(s), out, N=n)
    emulated = run(ptx.Q4_K_CODES, [words[0], f16_bits(s), f16_bits(s / np.float16(16))], 8)
    for j in range(8):
        assert np.array_equal(out[j].numpy(), as_f16(emulated[j])), j
    scale = rng.integers(-128, 128, n)
    a, b = (scale >> 4).astype(np.float16), (scale & 15).astype(np.float16)
    out = torch.empty(32, n, dtype=torch.float16)
    _q6[(1,)](*(torch.from_numpy(w.view(np.int32)) for w in words), torch.from_numpy(a), torch.from_numpy(b), out,
              N=n)
    ins = list(words)
    for v in (a, b):
        ins += [f16_bits(v), f16_bits(v * np.float16(-1056)), f16_bits(v / np.float16(16)),
                f16_bits(v * np.float16(-96))]
    emulated = run(ptx.Q6_K_CODES, ins, 32)
    for j in range(32):
        assert np.array_equal(out[j].numpy(), as_f16(emulated[j])), j


@pytest.mark.parametrize("arch", [80, 87, 90])
def test_the_tensor_core_kernels_compile_for_ampere_orin_and_hopper(arch):
    """ptxas and cuobjdump (shipped with triton) take the kernels and their assembly for each GPU the path is
    for, without a GPU (benchmarks/cuda_sass.py, in a process without the interpreter): what the emulator
    cannot tell (operand types, register kinds, syntax)."""
    if triton is None:
        pytest.skip("triton is not installed (it comes with torch's CUDA builds)")
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for kernel in ("q4_k_mma", "q6_k_mma"):
        r = subprocess.run([sys.executable, str(root / "benchmarks" / "cuda_sass.py"), kernel, "--block-n", "64",
                            "--arch", str(arch), "--num-stages", "1"], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"sm_{arch}" in r.stdout and "a weight" in r.stdout, r.stdout
