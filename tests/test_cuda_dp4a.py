"""jllm.cuda.dp4a: y = x W^T over Q4_K / Q6_K blocks with x quantized to int8 and dp4a. Against an independent
torch reference of the same arithmetic (x's int8 codes as the CPU's qgemm.cpp makes them, exact integer dot
products, the float terms per block), against the float product over the CPU's dequantized weights within the
bound that x's rounding allows, each output row bitwise its own whatever rows share its call (also in shares
of a row), x's preparation exactly the reference's, and the dp4a / rounding PTX (through tests/ptx_subset.py's
emulator) equal to the interpreter's integer path. Without a GPU the kernels run in Triton's interpreter; without
triton the tests skip."""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")          # before triton is imported
triton = pytest.importorskip("triton", reason="triton is not installed (it comes with torch's CUDA builds)")

import triton.language as tl  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from jllm.cuda import dp4a  # noqa: E402
from jllm.cuda.linear import device_weight  # noqa: E402
from jllm.gguf.quants import dequantize  # noqa: E402
from jllm.model.qlinear import quantize_activations  # noqa: E402
from ptx_subset import run  # noqa: E402
from test_cuda_matvec import random_blocks  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = [T.Q4_K, T.Q6_K]


def weight(kind, n, k, seed):
    raw = random_blocks(kind, n, k, seed=seed)
    return raw, device_weight(raw, kind, (n, k), torch.device(DEV))


def rand_x(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k // 32, 1, generator=g).repeat_interleave(32, 1).view(m, k)
    x[0, :32] = 0.0                                                      # a block of zeros: dx = 0
    return x


# ---- the reference ---------------------------------------------------------------------------------------------

def ref_quantize(x: torch.Tensor):
    """x [M, K] f32 -> (codes int64 [M, K / 32, 32] in x's order, dx, bsx f32 [M, K / 32]), as qgemm.cpp's
    quantize_rows: 127 / amax in f32, x times it rounded to nearest even, dx = amax / 127, bsx = dx * sum."""
    m, k = x.shape
    b = x.view(m, k // 32, 32)
    amax = b.abs().amax(dim=2)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(b * inv[..., None]).to(torch.int64)
    dx = amax / torch.tensor(127.0)
    return q, dx, dx * q.sum(dim=2).to(torch.float32)


def q4_k_parts(raw: torch.Tensor, n: int, k: int):
    """Q4_K file bytes -> (codes int64 [N, K / 32, 32] in weight order, d * scale, dmin * min f32 [N, K / 32]),
    decoded from the file format as ggml's dequantize_row_q4_K reads it (get_scale_min_k4)."""
    b = raw.view(n * k // 256, 144).to(torch.int64)
    d = b[:, 0:2].to(torch.uint8).contiguous().view(torch.float16).float()
    dmin = b[:, 2:4].to(torch.uint8).contiguous().view(torch.float16).float()
    s = b[:, 4:16]
    sc = torch.empty(b.shape[0], 8, dtype=torch.int64)
    mn = torch.empty_like(sc)
    for j in range(8):
        if j < 4:
            sc[:, j], mn[:, j] = s[:, j] & 63, s[:, j + 4] & 63
        else:
            sc[:, j] = (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4)
            mn[:, j] = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
    qs = b[:, 16:].view(-1, 4, 32)                                         # 64 weights a chunk of 32 bytes
    codes = torch.stack([qs & 0xF, qs >> 4], dim=2).view(n, k // 32, 32)   # sub-block 2c: low, 2c + 1: high
    return codes, (d * sc).view(n, k // 32), (dmin * mn).view(n, k // 32)


def q6_k_parts(raw: torch.Tensor, n: int, k: int):
    """Q6_K file bytes -> (codes 0..63 int64 [N, K / 16, 16], d * scale f32 [N, K / 16]), as ggml's
    dequantize_row_q6_K reads them."""
    b = raw.view(n * k // 256, 210).to(torch.int64)
    codes = torch.empty(b.shape[0], 256, dtype=torch.int64)
    for half in range(2):
        ql, qh = b[:, 64 * half:64 * half + 64], b[:, 128 + 32 * half:128 + 32 * half + 32]
        o = 128 * half
        codes[:, o:o + 32] = (ql[:, :32] & 0xF) | (((qh >> 0) & 3) << 4)
        codes[:, o + 32:o + 64] = (ql[:, 32:] & 0xF) | (((qh >> 2) & 3) << 4)
        codes[:, o + 64:o + 96] = (ql[:, :32] >> 4) | (((qh >> 4) & 3) << 4)
        codes[:, o + 96:o + 128] = (ql[:, 32:] >> 4) | (((qh >> 6) & 3) << 4)
    sc = b[:, 192:208].to(torch.uint8).view(torch.int8).float()
    d = b[:, 208:210].to(torch.uint8).contiguous().view(torch.float16).float()
    return codes.view(n, k // 16, 16), (d * sc).view(n, k // 16)


def reference(kind, raw, n, k, x, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in float64 over its exact integers -> (y [M, N], the sum of its terms' magnitudes,
    a scale for float32 rounding)."""
    q, dx, bsx = ref_quantize(x)
    m = x.shape[0]
    if kind == T.Q4_K:
        codes, dsc, dmm = q4_k_parts(raw, n, k)
        dots = torch.einsum("mbi,nbi->mnb", q, codes).double()             # exact integers
        main = dots * dsc.double()[None] * dx.double()[:, None]
        mins = dmm.double()[None] * bsx.double()[:, None]
        y, size = (main - mins).sum(-1), (main.abs() + mins.abs()).sum(-1)
    else:
        codes, dsc = q6_k_parts(raw, n, k)
        dots = torch.einsum("mgi,ngi->mng", q.view(m, k // 16, 16), codes - 32).double()
        main = dots * dsc.double()[None] * dx.double().repeat_interleave(2, dim=1)[:, None]
        y, size = main.sum(-1), main.abs().sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y, size


def product(x, w, block_n=64, sb=2, split=1, bias=None, prep=None):
    """dp4a.launch into a fresh output; with split > 1 the shares [split, M, N] too."""
    m, n = x.shape[0], w.shape[0]
    if split == 1:
        y = torch.empty(m, n, device=DEV)
        dp4a.launch(x, w, y, block_n, bias, sb, 1, prep=prep)
        return y, None
    parts = torch.empty(split, m, n, device=DEV)
    dp4a.launch(x, w, parts, block_n, None, sb, split, prep=prep)
    y = parts.sum(0) if bias is None else parts.sum(0) + bias
    return y, parts


# ---- (a) the products ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k,block_n,sb", [(48, 1024, 64, 2), (40, 768, 32, 1), (16, 512, 16, 2)])
def test_the_product_is_the_references_arithmetic_and_near_the_float_product(kind, n, k, block_n, sb):
    """Ragged tiles (40, 48 outputs; 768: 3 super-blocks, a ragged step at sb 2) and a bias."""
    raw, w = weight(kind, n, k, seed=n + k)
    x = rand_x(3, k, seed=1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    y = product(x.to(DEV), w, block_n, sb, bias=bias.to(DEV))[0].double().cpu()
    want, size = reference(kind, raw, n, k, x, bias)
    assert torch.all((y - want).abs() <= 1e-5 * size + 1e-6), (y - want).abs().max()
    # against x W^T over the CPU's dequantized weights: x's rounding moves each x by at most dx / 2
    wf = dequantize(raw.numpy(), kind, (n, k)).double()
    exact = x.double() @ wf.T + bias.double()
    _, dx, _ = ref_quantize(x)
    bound = 0.5 * dx.double().repeat_interleave(32, dim=1) @ wf.abs().T
    assert torch.all((y - exact).abs() <= bound + 1e-5 * size + 1e-6)
    rel = ((y - exact).abs().max() / exact.abs().max()).item()
    assert 1e-5 < rel < 2e-2, rel               # int8 x: not the float kernels' 1e-6, not far off either


@pytest.mark.parametrize("kind", KINDS, ids=lambda t: t.name)
def test_a_zero_row_gives_the_bias_and_shares_add_to_the_whole(kind):
    n, k = 32, 1024
    raw, w = weight(kind, n, k, seed=5)
    x = rand_x(2, k, seed=6)
    x[1] = 0.0
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(DEV)
    whole = product(x.to(DEV), w, 32, 1, bias=bias)[0]
    assert torch.equal(whole[1], bias)
    for split in (2, 3, 5):                            # 5 shares of 4 super-blocks: the last is empty
        shared, parts = product(x.to(DEV), w, 32, 1, split=split, bias=bias)
        assert torch.allclose(shared, whole, rtol=1e-5, atol=1e-5 * whole.abs().max().item())
        assert parts.shape == (split, 2, n)


# ---- (b) each row its own --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS, ids=lambda t: t.name)
def test_each_row_is_its_own_bitwise_whatever_rows_share_its_call(kind):
    """M = 1..9 (9: a program of 8 rows and one of 1), each row against a call of that row alone, bit for bit."""
    n, k = 24, 512
    _, w = weight(kind, n, k, seed=3)
    x = rand_x(9, k, seed=4).to(DEV)
    alone = [product(x[i:i + 1], w, 32, 1)[0] for i in range(9)]
    for m in range(1, 10):
        together = product(x[:m], w, 32, 1)[0]
        for i in range(m):
            assert torch.equal(together[i:i + 1], alone[i]), (m, i)


@pytest.mark.parametrize("kind", KINDS, ids=lambda t: t.name)
@pytest.mark.parametrize("split", [2, 3])
def test_each_rows_shares_are_its_own_bitwise(kind, split):
    n, k = 16, 1024
    _, w = weight(kind, n, k, seed=8)
    x = rand_x(11, k, seed=9).to(DEV)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(10)).to(DEV)
    _, parts = product(x, w, 16, 2, split=split)
    for i in (0, 5, 10):
        assert torch.equal(product(x[i:i + 1], w, 16, 2, split=split)[1], parts[:, i:i + 1])
    y = torch.empty(11, n, device=DEV)
    dp4a.launch(x, w, y, 16, bias, 2, 1)
    assert torch.equal(y[4:5], product(x[4:5], w, 16, 2, bias=bias)[0])


@pytest.mark.parametrize("kind", KINDS, ids=lambda t: t.name)
def test_rows_sharing_a_program_get_the_one_row_programs_sums_bitwise(kind, monkeypatch):
    """11 rows: programs of 8 and 3 against a program a row (jllm.cuda.rows.ROWS_MAX = 1), a prepared x
    shared by both calls."""
    import jllm.cuda.rows as rows

    n, k = 32, 512
    _, w = weight(kind, n, k, seed=11)
    x = rand_x(11, k, seed=12).to(DEV)
    prep = dp4a.prepare(x, [w])
    shared = product(x, w, 32, 1, prep=prep)[0]
    monkeypatch.setattr(rows, "ROWS_MAX", 1)
    assert torch.equal(product(x, w, 32, 1, prep=prep)[0], shared)


# ---- (c) x made ready ------------------------------------------------------------------------------------------

def q4_order(codes: torch.Tensor) -> torch.Tensor:
    """[M, K / 32, 32] codes in x's order -> Q4_K's order: word w = 4h + t of a block, byte i = x[16h + 4i + t]."""
    m, nb, _ = codes.shape
    return codes.view(m, nb, 2, 4, 4).transpose(3, 4).reshape(m, nb * 32)       # [h, i, t] -> [h, t, i]


def q6_order(codes: torch.Tensor) -> torch.Tensor:
    """-> Q6_K's order: group g (16), word w = 2h + t, byte i = x[16g + 8h + 2i + t]."""
    m, nb, _ = codes.shape
    return codes.view(m, nb, 2, 2, 4, 2).transpose(4, 5).reshape(m, nb * 32)    # [g, h, i, t] -> [g, h, t, i]


def test_x_is_made_ready_exactly_as_the_reference_and_the_cpu_quantize_it():
    m, k = 5, 768
    x = rand_x(m, k, seed=13)
    x[1, 40] = 1e30                                    # a block's amax far off its others'
    x[2, :256] *= 1e-6
    x[3, ::5] = -x[3, ::5].abs() * 3
    _, w4 = weight(T.Q4_K, 16, k, seed=1)
    _, w6 = weight(T.Q6_K, 16, k, seed=2)
    prep = dp4a.prepare(x.to(DEV), [w4, w6])
    q, dx, bsx = ref_quantize(x)
    cpu_q, cpu_dx = quantize_activations(x)            # the CPU path's (jllm.model.qlinear)
    assert torch.equal(q.view(m, k).float(), cpu_q) and torch.equal(dx, cpu_dx)
    xq4, s4 = (t.cpu() for t in prep.q4)
    assert torch.equal(xq4.to(torch.int64), q4_order(q))
    assert torch.equal(s4[..., 0], dx) and torch.equal(s4[..., 1], bsx)
    xq6, s6 = (t.cpu() for t in prep.q6)
    assert torch.equal(xq6.to(torch.int64), q6_order(q))
    assert torch.equal(s6[..., 0].view(torch.float32), dx)
    sums = q.view(m, k // 32, 2, 16).sum(dim=3)
    assert torch.equal(s6[..., 1:3].to(torch.int64), dp4a.MAGIC - 32 * sums) and not s6[..., 3].any()
    only4 = dp4a.prepare(x.to(DEV), [w4])
    assert only4.q6 is None and torch.equal(only4.q4[0].cpu(), xq4)
    with pytest.raises(ValueError, match="Q4_K or Q6_K"):
        dp4a.empty(m, k, False, False, DEV)


def test_x_codes_word_by_word_meet_the_weight_words_they_multiply():
    """The orders themselves: Q4_K x word t meets weights 4i + t (low nibbles of word t), word 4 + t weights
    16 + 4i + t; Q6_K x word 2h + t of group g meets weight 16g + 8h + 2i + t."""
    x = torch.arange(32).view(1, 1, 32)
    w4 = q4_order(x).view(8, 4)
    assert w4[1].tolist() == [1, 5, 9, 13] and w4[6].tolist() == [18, 22, 26, 30]
    w6 = q6_order(x).view(8, 4)
    assert w6[1].tolist() == [1, 3, 5, 7] and w6[2].tolist() == [8, 10, 12, 14] and w6[7].tolist() == [25, 27, 29, 31]


# ---- (d) the integer path --------------------------------------------------------------------------------------

def dp4a_reference(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """c + a's unsigned bytes times b's signed bytes, int32 wrapping, in plain numpy."""
    ab = a.view(np.uint8).reshape(-1, 4).astype(np.int64)
    bb = b.view(np.int8).reshape(-1, 4).astype(np.int64)
    return ((c.astype(np.int64) + (ab * bb).sum(1) + 2**31) % 2**32 - 2**31).astype(np.int32)


@triton.jit
def _dp4a_kernel(a_ptr, b_ptr, c_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, dp4a.dp4a(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i), False))


@triton.jit
def _round_kernel(v_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, dp4a._round(tl.load(v_ptr + i), False))


def words(rng, n):
    return rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)


def test_the_interpreters_dp4a_and_the_ptx_are_the_integer_reference():
    if torch.cuda.is_available():
        pytest.skip("the interpreter's path: on a GPU the kernels run the PTX itself")
    rng = np.random.default_rng(0)
    n = 4096
    a, b, c = words(rng, n), words(rng, n), words(rng, n)
    a[:4], b[:4] = 0xFFFFFFFF, (0x80808080, 0x7F7F7F7F, 0xFFFFFFFF, 0)   # the extremes: 255 x -128 ...
    c[:2] = (0x7FFFFFFF, 0x80000000)                                       # and a wrap
    want = dp4a_reference(a, b, c)
    out = torch.empty(n, dtype=torch.int32)
    _dp4a_kernel[(1,)](*(torch.from_numpy(v.view(np.int32)) for v in (a, b, c)), out, N=n)
    assert np.array_equal(out.numpy(), want)
    assert np.array_equal(run(dp4a.DP4A, [a, b, c], 1)[0].view(np.int32), want)
    # the chains: DOT8 (Q4_K) and DOT4 (Q6_K), the pairs in order
    ws, xs = [words(rng, n) for _ in range(8)], [words(rng, n) for _ in range(8)]
    chain = c
    for i in range(8):
        chain = dp4a_reference(ws[i], xs[i], chain.view(np.uint32)).view(np.uint32)
        if i == 3:
            assert np.array_equal(run(dp4a.DOT4, ws[:4] + xs[:4] + [c], 1)[0], chain)
    assert np.array_equal(run(dp4a.DOT8, ws + xs + [c], 1)[0], chain)


def test_the_interpreters_rounding_and_the_ptx_round_to_nearest_even():
    if torch.cuda.is_available():
        pytest.skip("the interpreter's path")
    v = np.concatenate([np.arange(-130, 130, 0.5), np.random.default_rng(1).uniform(-127.5, 127.5, 4096 - 520)])
    v = v.astype(np.float32)
    out = torch.empty(v.size, dtype=torch.int32)
    _round_kernel[(1,)](torch.from_numpy(v), out, N=v.size)
    assert np.array_equal(out.numpy(), np.rint(v).astype(np.int32))            # numpy: ties to even
    assert np.array_equal(run(dp4a.ROUND, [v.view(np.uint32)], 1)[0].view(np.int32), out.numpy())


def test_the_gpus_fma_form_of_a_chains_product_is_the_plain_product():
    """On the GPU a chain's result c = 1.5 * 2^23 + i (as a float) times s = d * scale is one fma,
    fma(s, c, -(s * 1.5 * 2^23)) (dp4a._times); the interpreter subtracts first and multiplies. Both are
    round(s * i): here in float64, where every step is exact (s: 11 + 8 bits, c: 24), then rounded once."""
    rng = np.random.default_rng(3)
    d = (rng.random(100000) * 0.02 + 1e-4).astype(np.float16).astype(np.float32)
    s = (d * rng.integers(-128, 128, d.size)).astype(np.float32)          # Q6_K's; Q4_K's 0..63 are fewer bits
    i = rng.integers(-(2**22) + 1, 2**22, d.size)
    c = (np.float64(12582912.0) + i).astype(np.float32)
    assert np.array_equal(c.astype(np.float64) - 12582912.0, i)            # the chain's float holds i exactly
    nsm = s * np.float32(-12582912.0)
    assert np.array_equal(nsm.astype(np.float64), s.astype(np.float64) * -12582912.0)    # exact in f32
    fma = (s.astype(np.float64) * c.astype(np.float64) + nsm.astype(np.float64)).astype(np.float32)
    assert np.array_equal(fma, (c - np.float32(12582912.0)) * s)


@pytest.mark.parametrize("arch", [80, 90])
def test_the_kernels_compile_to_idp4a(arch):
    """ptxas takes the kernels and their assembly (benchmarks/cuda_sass.py, no GPU needed), and the products
    are IDP.4A instructions in the SASS: the PTX the emulator checks is what runs."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for kernel in ("q4_k_dp4a", "q6_k_dp4a"):
        r = subprocess.run([sys.executable, str(root / "benchmarks" / "cuda_sass.py"), kernel, "--block-n", "64",
                            "--sb", "2", "--rows", "2", "--arch", str(arch)], capture_output=True, text=True,
                           env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"sm_{arch}" in r.stdout and "IDP 128" in r.stdout, r.stdout           # 2 rows x 256 weights / 4
        assert " 0 local loads" in r.stdout, r.stdout


def test_the_setting_and_the_switch():
    assert dp4a._types("1") == (dp4a.Q4KWeight, dp4a.Q6KWeight) and dp4a._types("0") == ()
    assert dp4a._types("Q6_K") == (dp4a.Q6KWeight,)
    with pytest.raises(ValueError, match="JLLM_MATVEC_DP4A"):
        dp4a._types("yes")
    _, w = weight(T.Q4_K, 32, 512, seed=1)
    x = torch.zeros(17, 512, device=DEV)
    assert not dp4a.handles(x, w)                      # off by default, and past 16 rows in any case
    with pytest.raises(ValueError, match="powers of two"):
        dp4a.launch(x[:1], w, torch.empty(1, 32, device=DEV), 16, sb=1)
    for n, k in ((1536, 1536), (256, 1536), (1536, 8960), (151936, 1536)):       # the 1.5B's shapes
        block_n, sb, split = dp4a.setting(_Shape(n, k))
        assert block_n * sb >= 32 and 1 <= split <= max(1, k // 256 // 2)
    assert dp4a.setting(_Shape(151936, 1536))[2] == 1


class _Shape:
    def __init__(self, n, k):
        self.shape = (n, k)
