"""The native kernel (jllm/kernels/qgemm.cpp) and its weight format (jllm/model/qlinear.py): GGUF blocks map
onto (q, s, m) exactly, packing round-trips, the kernel equals a float64 oracle of the same arithmetic, and
every row's result is bitwise independent of the other rows in the call."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants as gq

from jllm.gguf import quants
from jllm.kernels import qgemm
from jllm.model import qlinear as ql

pytestmark = pytest.mark.skipif(qgemm() is None, reason="native kernels unavailable on this machine")

EXACT_TYPES = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q8_0]
REQUANT_TYPES = [T.Q6_K, T.F16, T.BF16, T.F32]


def gguf_bytes(ggml_type, rows, cols, seed=0):
    if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K):        # gguf-py cannot quantize to k-quants: random blocks
        from test_quants import synthetic

        return synthetic(ggml_type, (rows, cols), seed), None
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    if ggml_type == T.F32:
        return w.view(np.uint8).reshape(-1), w
    raw = gq.quantize(w, ggml_type)
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8), None


def linear(matrix: ql.PackedMatrix, bias=None) -> ql.QLinear:
    """The packed matrix as the model's linear layer (the kernel call the model makes)."""
    data, offsets, four = matrix.pack()
    return ql.QLinear(data, offsets, four, matrix.rows, matrix.cols, bias)


def packed(parts, cols, bias=None) -> ql.QLinear:
    m = ql.PackedMatrix(cols)
    for q, s, mn, four in parts:
        m.add(q, s, mn, four)
    return linear(m, bias)


@pytest.mark.parametrize("ggml_type", EXACT_TYPES, ids=lambda t: t.name)
def test_block_codes_reproduce_exact_dequantization(ggml_type):
    rows, cols = 24, 512
    raw, _ = gguf_bytes(ggml_type, rows, cols)
    q, s, m = ql.block_codes(torch.from_numpy(raw), ggml_type, rows, cols)
    assert q.dtype == torch.uint8 and int(q.max()) < (16 if ggml_type in ql.FOUR_BIT else 256)
    qs = (q.view(rows, -1, 32).double() * s[..., None].double()).view(rows, cols)
    mm = m.double().repeat_interleave(32, dim=1)
    exact = quants.dequantize(raw, ggml_type, (rows, cols)).double()
    # equal up to float32 rounding of the two terms (dequantization rounds in float32)
    assert ((qs - mm - exact).abs() <= 1e-6 * (qs.abs() + mm.abs()) + 1e-30).all()


@pytest.mark.parametrize("ggml_type", REQUANT_TYPES, ids=lambda t: t.name)
def test_requantized_types_stay_within_half_a_step(ggml_type):
    rows, cols = 16, 512
    raw, _ = gguf_bytes(ggml_type, rows, cols)
    q, s, m = ql.block_codes(torch.from_numpy(raw), ggml_type, rows, cols)
    value = (q.view(rows, -1, 32).float() * s[..., None] - m[..., None]).view(rows, cols)
    exact = quants.dequantize(raw, ggml_type, (rows, cols))
    step = s.repeat_interleave(32, dim=1)
    assert ((value - exact).abs() <= 0.5 * step * (1 + 1e-5) + 1e-6 * exact.abs()).all()


def random_parts(rng, sizes, cols):
    parts = []
    for rows, four in sizes:
        hi = 16 if four else 256
        q = torch.randint(0, hi, (rows, cols), dtype=torch.uint8, generator=rng)
        s = torch.rand(rows, cols // 32, generator=rng) * 0.01
        m = torch.rand(rows, cols // 32, generator=rng) * 0.05 * (1 if four else 10)
        parts.append((q, s, m, four))
    return parts


@pytest.mark.parametrize("sizes", [[(32, True)], [(40, True), (60, False)], [(16, False), (48, True), (3, True)]])
def test_pack_round_trips_and_sizes_are_planned(sizes):
    rng = torch.Generator().manual_seed(1)
    cols = 96
    parts = random_parts(rng, sizes, cols)
    lin = packed(parts, cols)
    data, offsets, four = lin.data, lin.offsets, lin.four
    n = sum(r for r, _ in sizes)
    assert data.numel() == ql.packed_bytes(sizes, cols) == int(offsets[-1])
    q, s, m = ql.unpack(data, offsets, four, n, cols)
    assert torch.equal(q, torch.cat([p[0] for p in parts]))
    assert torch.equal(s, torch.cat([p[1] for p in parts]).half().float())
    assert torch.equal(m, torch.cat([p[2] for p in parts]).half().float())
    # a tile is 4-bit exactly when all its rows are
    row_four = [f for r, f in sizes for _ in range(r)] + [True] * (-n % 16)
    assert four.tolist() == [all(row_four[i:i + 16]) for i in range(0, len(row_four), 16)]


@pytest.mark.parametrize("m_rows", [1, 2, 5, 9, 10, 11, 17, 40])
def test_kernel_matches_float64_oracle(m_rows):
    rng = torch.Generator().manual_seed(m_rows)
    cols = 320
    parts = random_parts(rng, [(40, True), (24, False), (9, True)], cols)
    n = 73
    bias = torch.randn(n, generator=rng)
    lin = packed(parts, cols, bias)
    q, s, m = ql.unpack(lin.data, lin.offsets, lin.four, n, cols)
    x = torch.randn(m_rows, cols, generator=rng)
    x[:, 7] *= 30                                    # an outlier channel, as LLM activations have
    y = lin(x)
    want = ql.reference_matmul(x, q, s, m, bias)
    assert y.shape == (m_rows, n)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)


def test_rows_are_bitwise_independent_of_the_batch():
    rng = torch.Generator().manual_seed(3)
    cols = 1536
    lin = packed(random_parts(rng, [(256, True), (64, False)], cols), cols)
    x = torch.randn(24, cols, generator=rng)
    full = lin(x)
    for i in range(24):
        assert torch.equal(lin(x[i:i + 1].clone()), full[i:i + 1])
    for lo, hi in ((0, 9), (3, 12), (5, 24)):                # other chunkings of the rows
        assert torch.equal(lin(x[lo:hi].clone()), full[lo:hi])
    other = x.clone()
    other[1:] = torch.randn(23, cols, generator=rng) * 100   # very different neighbours
    assert torch.equal(lin(other)[0], full[0])


def test_kernel_on_real_q4_k_and_q6_k_weights_tracks_float(real_model):
    from jllm.gguf.reader import read_gguf

    g = read_gguf(real_model("qwen2.5-coder-0.5b"))
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        info = g.tensors[name]
        rows, cols = info.shape
        m = ql.PackedMatrix(cols)
        ql.pack_gguf_rows(m, g.raw(name), info.ggml_type, rows)
        w = quants.dequantize(g.raw(name), info.ggml_type, (rows, cols))
        x = torch.randn(3, cols)
        y, want = linear(m)(x), x @ w.T
        rel = ((y - want).norm() / want.norm()).item()
        assert rel < 0.02, f"{name} ({info.ggml_type.name}): relative error {rel:.4f}"


_PLAIN_PATH = """
import sys, torch
sys.path.insert(0, {tests!r})
from jllm import kernels
assert "-DJLLM_GFNI" not in kernels._flags()
from test_qlinear import gfni_case
lin, x = gfni_case()
torch.save(lin(x), {out!r})
"""


def gfni_case():
    rng = torch.Generator().manual_seed(11)
    return packed(random_parts(rng, [(48, True), (16, False)], 640), 640), torch.randn(5, 640, generator=rng)


@pytest.mark.skipif("gfni" not in open("/proc/cpuinfo").read(), reason="this CPU builds only the plain path")
def test_gfni_and_plain_unpacking_give_the_same_bits(tmp_path):
    """Where the CPU has GFNI the kernel unpacks 4-bit weights with it (this process's build), else with
    shift and mask; a build of the plain path (JLLM_NO_GFNI, its own process and build directory: one
    module per process) must give bitwise the same outputs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from jllm import kernels

    assert "-DJLLM_GFNI" in kernels._flags()
    lin, x = gfni_case()
    out = tmp_path / "plain.pt"
    env = {**os.environ, "JLLM_NO_GFNI": "1", "JLLM_KERNELS_DIR": str(tmp_path / "kernels")}
    code = _PLAIN_PATH.format(tests=str(Path(__file__).parent), out=str(out))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert torch.equal(lin(x), torch.load(out))


def test_no_kernels_falls_back_to_int8(tmp_path):
    import subprocess
    import sys

    code = ("from jllm.model.loader import default_precision; import torch; "
            "print(default_precision(torch.device('cpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "JLLM_NO_KERNELS": "1"})
    assert out.stdout.strip() == "int8", out.stderr


@pytest.mark.parametrize("precision", ["native", "native4", "int8"])
def test_converted_cache_gives_the_same_model_and_survives_damage(precision, tmp_path, monkeypatch):
    from synthetic import write_tiny_model

    from jllm.model.loader import load_model

    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "conv"))
    path = tmp_path / "m.gguf"
    write_tiny_model(path, "qwen2")
    ids = torch.tensor([3, 17, 42, 7, 99])

    def logits():
        model = load_model(path, "cpu", precision)
        return model.forward(ids, model.new_cache(16))

    first = logits()                                        # converts and writes the cache
    (cached,) = list((tmp_path / "conv").glob("*.jllmw"))
    assert torch.equal(logits(), first)                     # reads it
    data = cached.read_bytes()
    cached.write_bytes(data[:len(data) // 2])               # truncated: detected, converted again
    assert torch.equal(logits(), first)
    assert cached.stat().st_size == len(data)
