"""The native kernel (jllm/kernels/qgemm.cpp) and its weight format (jllm/model/qlinear.py): GGUF blocks map
onto (q, s, m) exactly, packing round-trips, the kernel equals a float64 oracle of the same arithmetic, and
every row's result is bitwise independent of the other rows in the call."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants as gq

from jllm.gguf import quants
from jllm.model import qlinear as ql

pytestmark = pytest.mark.usefixtures("kernels_required")

EXACT_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]     # Q4_K, Q5_K: test_k_quants_map_exactly_...
REQUANT_TYPES = [T.F16, T.BF16, T.F32]                                 # Q6_K: test_compact_requantization_...


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


E, F, C, S = ql.EIGHT, ql.FOUR, ql.COMPACT, ql.SIX     # tile kinds: 8-bit, 4-bit, compact 4-bit, 6-bit


def linear(matrix: ql.PackedMatrix, bias=None) -> ql.QLinear:
    """The packed matrix as the model's linear layer (the kernel call the model makes)."""
    data, offsets, kinds = matrix.pack()
    return ql.QLinear(data, offsets, kinds, matrix.rows, matrix.cols, bias)


def packed(parts, cols, bias=None) -> ql.QLinear:
    m = ql.PackedMatrix(cols)
    for q, a, b, kind in parts:
        if kind in ql.WITH_UNITS:
            m.add_compact(q, a, b, kind)
        else:
            m.add(q, a, b, kind)
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
    """[(rows, kind)] -> parts (q, s, m, kind), or (q, units, codes, kind) for COMPACT and SIX, with negative
    codes too."""
    parts = []
    nb = cols // 32
    for rows, kind in sizes:
        q = torch.randint(0, ql.LEVELS[kind], (rows, cols), dtype=torch.uint8, generator=rng)
        if kind in ql.WITH_UNITS:
            units = (torch.rand(rows, nb // ql.super_blocks(nb), 2, generator=rng) * 1e-3).half().float()
            codes = torch.randint(-127, 128, (rows, nb, 2), dtype=torch.int8, generator=rng)
            parts.append((q, units, codes, kind))
            continue
        s = torch.rand(rows, nb, generator=rng) * 0.01
        m = torch.rand(rows, nb, generator=rng) * 0.05 * (10 if kind == E else 1)
        parts.append((q, s, m, kind))
    return parts


def part_scales(part):
    q, a, b, kind = part
    return ql.compact_scales(a, b) if kind in ql.WITH_UNITS else (a, b)


@pytest.mark.parametrize("sizes", [[(32, F)], [(40, F), (60, E)], [(16, E), (48, F), (3, F)], [(48, C)],
                                   [(24, C), (24, F), (16, C), (40, E), (5, C)], [(32, S), (8, C), (24, S)],
                                   [(8, S), (16, F), (8, E), (9, S)]])
@pytest.mark.parametrize("cols", [96, 256, 896])
def test_pack_round_trips_and_sizes_are_planned(sizes, cols):
    rng = torch.Generator().manual_seed(1)
    parts = random_parts(rng, sizes, cols)
    lin = packed(parts, cols)
    data, offsets, kinds = lin.data, lin.offsets, lin.kinds
    n = sum(r for r, _ in sizes)
    assert data.numel() == ql.packed_bytes(sizes, cols) == int(offsets[-1])
    # a tile of one kind keeps it; mixed, it takes the narrowest kind that holds all its rows' q and scales
    row_kind = [k for r, k in sizes for _ in range(r)]
    mixed = {frozenset({F, C}): F, frozenset({S, C}): S}
    tile_kind = []
    for i in range(0, n, 16):
        ks = frozenset(row_kind[i:i + 16])
        tile_kind.append(next(iter(ks)) if len(ks) == 1 else mixed.get(ks, E))
    assert kinds.tolist() == tile_kind
    q, s, m = ql.unpack(data, offsets, kinds, n, cols)
    assert torch.equal(q, torch.cat([p[0] for p in parts]))
    # compact tiles keep the exact products of unit and code, the others f16 (s, m)
    exact = torch.tensor([tile_kind[i // 16] in ql.WITH_UNITS for i in range(n)])[:, None]
    want_s, want_m = (torch.cat(x) for x in zip(*map(part_scales, parts)))
    assert torch.equal(s, torch.where(exact, want_s, want_s.half().float()))
    assert torch.equal(m, torch.where(exact, want_m, want_m.half().float()))


def test_packing_refuses_rows_it_cannot_hold():
    m = ql.PackedMatrix(64)
    q = torch.full((16, 64), 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="levels"):
        m.add(q, torch.ones(16, 2), torch.zeros(16, 2), F)                # 20 does not fit 4 bits
    with pytest.raises(ValueError, match="add_compact"):
        m.add(q, torch.ones(16, 2), torch.zeros(16, 2), S)                # 6-bit rows need their codes
    with pytest.raises(ValueError, match="levels"):
        m.add_compact(q + 50, torch.ones(16, 1, 2), torch.ones(16, 2, 2, dtype=torch.int8), S)
    with pytest.raises(ValueError):
        ql.block_codes(torch.zeros(144, dtype=torch.uint8), T.Q4_K, 1, 256)


def test_compact_tiles_read_fewer_bytes():
    nb = 1536 // 32
    assert ql._tile_bytes(1536, C) == nb * 288 + nb // 8 * 64 == 0.925 * ql._tile_bytes(1536, F)
    assert ql._tile_bytes(1536, S) == nb * 416 + nb // 8 * 64 == 53 / 72 * ql._tile_bytes(1536, E)
    assert ql.super_blocks(896 // 32) == 7 and ql.super_blocks(8960 // 32) == 8 and ql.super_blocks(3) == 3


@pytest.mark.parametrize("ggml_type, kind", [(T.Q4_K, C), (T.Q5_K, S)], ids=["Q4_K", "Q5_K"])
def test_k_quants_map_exactly_onto_compact_codes(ggml_type, kind):
    rows, cols = 24, 512
    raw, _ = gguf_bytes(ggml_type, rows, cols)
    assert ql.row_kind(ggml_type) == kind
    q, units, codes = ql.compact_codes(torch.from_numpy(raw), ggml_type, rows, cols, kind)
    assert int(q.max()) < ql.LEVELS[kind]
    s, m = ql.compact_scales(units, codes)
    value = (q.view(rows, -1, 32).float() * s[..., None] - m[..., None]).view(rows, cols)
    assert torch.equal(value, quants.dequantize(raw, ggml_type, (rows, cols)))     # the same float32 ops


def affine_per_block(v, levels):
    """The comparison: v [nb, 32] on `levels` affine levels with its own exact (s, m) per block."""
    lo, hi = v.amin(dim=1), v.amax(dim=1)
    s = (hi - lo) / (levels - 1)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = ((v - lo[:, None]) * inv[:, None]).round_().clamp_(0, levels - 1)
    return q, s, -lo


@pytest.mark.parametrize("ggml_type, kind", [(T.Q5_0, C), (T.Q8_0, C), (T.Q6_K, C), (T.F32, C), (T.Q6_K, S),
                                             (T.Q8_0, S)], ids=lambda x: getattr(x, "name", {C: "4bit", S: "6bit"}.get(x)))
def test_compact_requantization_is_as_close_as_per_block_scales(ggml_type, kind):
    """native4 requantizes wider types onto compact 4-bit, native Q6_K onto 6-bit: the block's (s, m) rounded
    up onto an int8 grid under its super-block's units, q refitted. Every weight stays within half a step,
    and the error stays that of the same levels with exact per-block scales."""
    rows, cols = 32, 1792 if ggml_type == T.Q6_K else 896     # 7 blocks a super-block at 896
    raw, _ = gguf_bytes(ggml_type, rows, cols)
    exact = quants.dequantize(raw, ggml_type, (rows, cols))
    q, units, codes = ql.compact_codes(torch.from_numpy(raw), ggml_type, rows, cols, kind)
    assert int(q.max()) < ql.LEVELS[kind]
    s, m = ql.compact_scales(units, codes)
    value = (q.view(rows, -1, 32).float() * s[..., None] - m[..., None]).view(rows, cols)
    q1, s1, m1 = affine_per_block(exact.view(-1, 32), ql.LEVELS[kind])
    plain = (q1.float() * s1[:, None] - m1[:, None]).view(rows, cols)
    err, err_plain = (value - exact).pow(2).mean().sqrt(), (plain - exact).pow(2).mean().sqrt()
    assert err <= 1.1 * err_plain, (err, err_plain)
    step = s.repeat_interleave(32, dim=1)
    assert ((value - exact).abs() <= 0.5 * step * (1 + 1e-5) + 1e-6 * exact.abs()).all()


@pytest.mark.parametrize("m_rows", [1, 2, 5, 9, 10, 11, 17, 40])
def test_kernel_matches_float64_oracle(m_rows):
    rng = torch.Generator().manual_seed(m_rows)
    cols = 320
    parts = random_parts(rng, [(40, F), (24, E), (32, C), (9, F), (7, C), (32, S)], cols)
    n = 144
    bias = torch.randn(n, generator=rng)
    lin = packed(parts, cols, bias)
    assert set(lin.kinds.tolist()) == {E, F, C, S}
    q, s, m = ql.unpack(lin.data, lin.offsets, lin.kinds, n, cols)
    x = torch.randn(m_rows, cols, generator=rng)
    x[:, 7] *= 30                                    # an outlier channel, as LLM activations have
    y = lin(x)
    want = ql.reference_matmul(x, q, s, m, bias)
    assert y.shape == (m_rows, n)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tail", [(0, C), (12, C), (13, F), (5, C)], ids=["whole", "compact12", "four13", "compact5"])
def test_rows_are_bitwise_independent_of_the_batch(tail):
    # AVX2 computes the 4-bit tiles of up to 4 rows in one pass over both halves, more rows in groups, and a
    # last tile of 8 rows or fewer a half at a time: every row count must give each row the same bits.
    rng = torch.Generator().manual_seed(3)
    cols = 1536
    lin = packed(random_parts(rng, [(256, F), (64, E), (128, C), (64, S)] + [tail] * (tail[0] > 0), cols), cols)
    x = torch.randn(24, cols, generator=rng)
    full = lin(x)
    for i in range(24):
        assert torch.equal(lin(x[i:i + 1].clone()), full[i:i + 1])
    for lo, hi in ((0, 9), (3, 12), (5, 24)):                # other chunkings of the rows
        assert torch.equal(lin(x[lo:hi].clone()), full[lo:hi])
    other = x.clone()
    other[1:] = torch.randn(23, cols, generator=rng) * 100   # very different neighbours
    assert torch.equal(lin(other)[0], full[0])


# native: Q5_0 and Q4_K measured ~0.01, Q6_K on 6-bit tiles 0.021 (0.01 at 8 bits); native4 0.08-0.10
@pytest.mark.parametrize("four_bit, bound", [(False, 0.03), (True, 0.12)], ids=["native", "native4"])
def test_kernel_on_real_weights_tracks_float(real_model, four_bit, bound):
    """Real Q5_0, Q6_K and Q4_K tensors (the 0.5B has all three in its first layers) at their own width, and
    requantized to compact 4-bit as the draft model loads them (native4)."""
    from jllm.gguf.reader import read_gguf

    g = read_gguf(real_model("qwen2.5-coder-0.5b"))
    seen = set()
    rng = torch.Generator().manual_seed(0)         # fixed inputs: over random ones native4's Q5_0 error spreads 0.08-0.123
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.2.ffn_down.weight"):
        info = g.tensors[name]
        seen.add(info.ggml_type)
        rows, cols = info.shape
        m = ql.PackedMatrix(cols)
        ql.pack_gguf_rows(m, g.raw(name), info.ggml_type, rows, four_bit)
        w = quants.dequantize(g.raw(name), info.ggml_type, (rows, cols))
        x = torch.randn(3, cols, generator=rng)
        lin = linear(m)
        y, want = lin(x), x @ w.T
        assert set(lin.kinds.tolist()) == {ql.row_kind(info.ggml_type, four_bit)}
        rel = ((y - want).norm() / want.norm()).item()
        assert rel < bound, f"{name} ({info.ggml_type.name}): relative error {rel:.4f}"
    assert {T.Q5_0, T.Q4_K, T.Q6_K} <= seen


_PLAIN_PATH = """
import sys, torch
sys.path.insert(0, {tests!r})
from jllm import kernels
assert "-DJLLM_GFNI" not in kernels._flags()
from test_qlinear import gfni_case
lin, x = gfni_case()
torch.save((lin(x[:1]), lin(x)), {out!r})
"""


def gfni_case():
    rng = torch.Generator().manual_seed(11)
    return (packed(random_parts(rng, [(48, F), (16, E), (32, C), (32, S)], 640), 640),
            torch.randn(5, 640, generator=rng))


@pytest.mark.skipif("gfni" not in open("/proc/cpuinfo").read(), reason="this CPU builds only the plain path")
def test_gfni_and_plain_unpacking_give_the_same_bits(tmp_path, kernel_variant):
    """Where the CPU has GFNI the kernel unpacks 4-bit weights with it for one row (this process's build),
    else with shift and mask; a build of the plain path (JLLM_NO_GFNI, its own process and build directory:
    one module per process; a slow test: a compile of its own) must give bitwise the same outputs for one row.
    Five rows take shift and mask in both builds; their equality checks only that the builds agree otherwise."""
    import subprocess
    import sys
    from pathlib import Path

    from jllm import kernels

    assert "-DJLLM_GFNI" in kernels._flags()
    lin, x = gfni_case()
    out = tmp_path / "plain.pt"
    env = kernel_variant(JLLM_NO_GFNI="1")
    code = _PLAIN_PATH.format(tests=str(Path(__file__).parent), out=str(out))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    one, five = torch.load(out)
    assert torch.equal(lin(x[:1]), one) and torch.equal(lin(x), five)


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


def test_converting_removes_files_of_older_formats(tmp_path, monkeypatch):
    from synthetic import write_tiny_model

    from jllm.model import converted
    from jllm.model.loader import load_model

    conv = tmp_path / "conv"
    conv.mkdir()
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(conv))
    old = conv / "old.jllmw"
    old.write_bytes(b"JLLMW\x00\x03\x00" + b"\x00" * 64)            # a version-3 file: never read again
    other = conv / "notes.jllmw"
    other.write_bytes(b"something else entirely")                   # not ours: kept
    path = tmp_path / "m.gguf"
    write_tiny_model(path, "qwen2")
    load_model(path, "cpu", "native")
    assert not old.exists() and other.exists()
    (current,) = [p for p in conv.glob("*.jllmw") if p != other]
    assert current.read_bytes()[:8] == converted.MAGIC


def test_converting_removes_files_whose_model_is_gone_or_changed(tmp_path, monkeypatch):
    """A replaced or deleted GGUF leaves no converted copy of its weights behind once jllm converts again."""
    import os

    from synthetic import write_tiny_model

    from jllm.model.loader import load_model

    conv = tmp_path / "conv"
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(conv))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_tiny_model(a, "qwen2")
    write_tiny_model(b, "qwen2")
    load_model(a, "cpu", "native")
    load_model(a, "cpu", "native4")                         # another precision of the same file: both kept
    load_model(b, "cpu", "native")
    assert len(list(conv.glob("*.jllmw"))) == 3
    foreign = conv / "notes.jllmw"
    foreign.write_bytes(b"something else entirely")        # not ours: kept
    b.unlink()                                              # b deleted
    st = a.stat()
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))    # a replaced (a new time): its copies are stale
    load_model(a, "cpu", "native")                          # converts a again, and tidies up
    left = sorted(p for p in conv.glob("*.jllmw") if p != foreign)
    assert len(left) == 1 and foreign.exists()
    from jllm.model.converted import ConvertedReader, cache_key
    assert left[0].stem == cache_key(a, "native") and ConvertedReader(left[0]).source["gguf"] == str(a)
