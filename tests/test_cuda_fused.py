"""The GPU layer's fused kernels (jllm.cuda.fused) against the torch operations they replace: RMS norm with and
without the residual add, RoPE (both pair layouts) with the cache writes, the gated activations. Triton's
interpreter runs them on a machine without CUDA; without triton the tests skip."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")          # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (it comes with torch's CUDA builds)")

from jllm.cuda import fused  # noqa: E402
from jllm.model.transformer import apply_rope, rms_norm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_norms_and_the_residual_add():
    g = torch.Generator().manual_seed(0)
    x, a, w = torch.randn(3, 96, generator=g), torch.randn(3, 96, generator=g), torch.randn(96, generator=g)
    h = fused.rms_norm(x.to(DEV), w.to(DEV), 1e-6).cpu()
    assert torch.allclose(h, rms_norm(x, w, 1e-6), atol=1e-5)
    xo, h2 = (t.cpu() for t in fused.add_rms_norm(x.to(DEV), a.to(DEV), w.to(DEV), 1e-6))
    assert torch.equal(xo, x + a) and torch.allclose(h2, rms_norm(x + a, w, 1e-6), atol=1e-5)


@pytest.mark.parametrize("neox,rope_dim", [(True, 16), (False, 16), (True, 8)])
def test_rope_store_rotates_q_and_k_and_writes_the_cache_at_the_positions(neox, rope_dim):
    g = torch.Generator().manual_seed(rope_dim)
    T, H, Hk, hd, max_t = 3, 4, 2, 16, 40
    qkv = torch.randn(T, (H + 2 * Hk) * hd, generator=g)
    ang = torch.rand(max_t, rope_dim // 2, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    pos = torch.tensor([7, 8, 30])
    kc = torch.full((Hk, max_t, hd), float("nan"), dtype=torch.float16)
    vc = kc.clone()
    qk, v = qkv[:, :(H + Hk) * hd].view(T, H + Hk, hd), qkv[:, (H + Hk) * hd:].view(T, Hk, hd)
    kc_d, vc_d = kc.to(DEV), vc.to(DEV)
    q = fused.rope_store(qk.to(DEV), v.to(DEV), pos.to(DEV), cos.to(DEV), sin.to(DEV), neox, rope_dim, kc_d,
                         vc_d).cpu()
    want = apply_rope(qk, cos[pos], sin[pos], neox, rope_dim)
    assert torch.allclose(q, want[:, :H], atol=1e-5)
    kc_d, vc_d = kc_d.cpu(), vc_d.cpu()
    assert torch.allclose(kc_d[:, pos].float(), want[:, H:].transpose(0, 1), atol=1e-2)
    assert torch.equal(vc_d[:, pos], v.transpose(0, 1).half())
    others = torch.ones(max_t, dtype=torch.bool)
    others[pos] = False
    assert kc_d[:, others].isnan().all() and vc_d[:, others].isnan().all()     # nothing else written


@pytest.mark.parametrize("gelu", [False, True])
def test_glu(gelu):
    gu = torch.randn(2, 2 * 1500, generator=torch.Generator().manual_seed(3)) * 3
    got = fused.glu(gu.to(DEV), gelu).cpu()
    g, u = gu[:, :1500], gu[:, 1500:]
    act = F.gelu(g, approximate="tanh") if gelu else F.silu(g)
    assert torch.allclose(got, act * u, atol=1e-5, rtol=1e-5)


def _ready_parts(monkeypatch, family, k):
    """A Q4_K and a Q6_K weight over k inputs with `family`'s kernels on for both (tests/test_cuda_matvec.py)."""
    from gguf import GGMLQuantizationType as T

    from test_cuda_matvec import TYPES, kernels_on, random_blocks

    kernels_on(monkeypatch, family, "1")
    return [TYPES[kind][0](random_blocks(kind, 16, k, seed=i), (16, k), DEV) for i, kind in enumerate((T.Q4_K, T.Q6_K))]


def _tensors(ready):
    """Every tensor of a jllm.cuda.ready.Ready, in a fixed order (None where a family or a type is not there)."""
    out = []
    for fam in (ready.mma, ready.dp4a):
        for v in (vars(fam).values() if fam is not None else ()):
            out += list(v) if isinstance(v, tuple) else [v]
    return out


def _same_ready(got, want):
    a, b = _tensors(got), _tensors(want)
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu())


@pytest.mark.parametrize("family", ["mma", "dp4a"])
@pytest.mark.parametrize("add", [False, True])
def test_the_norms_fill_prep_a_program_a_super_block_with_h_bitwise_the_norms_without(family, add, monkeypatch):
    """With prep, the norm runs a program a (row, super-block): h and x + a bitwise those of the one program a
    row without prep, and prep bitwise what a launch of its own (jllm.cuda.ready.prepare) makes of that h.
    768 values a row: three super-blocks, in a block of 1024 (a masked tail)."""
    import jllm.cuda.ready as ready

    D = 768
    parts = _ready_parts(monkeypatch, family, D)
    g = torch.Generator().manual_seed(7)
    x, a, w = (torch.randn(3, D, generator=g) * 3).to(DEV), torch.randn(3, D, generator=g).to(DEV), \
        torch.randn(D, generator=g).to(DEV)
    prep = ready.empty(x, D, parts)
    assert (prep.mma is not None) == (family == "mma") and (prep.dp4a is not None) == (family == "dp4a")
    if add:
        xo, h = fused.add_rms_norm(x, a, w, 1e-6, prep)
        xo0, h0 = fused.add_rms_norm(x, a, w, 1e-6)
        assert torch.equal(xo.cpu(), xo0.cpu())
    else:
        h, h0 = fused.rms_norm(x, w, 1e-6, prep), fused.rms_norm(x, w, 1e-6)
    assert torch.equal(h.cpu(), h0.cpu())
    _same_ready(prep, ready.prepare(h0, parts))
    with pytest.raises(ValueError, match="super-blocks"):
        fused.rms_norm(x[:, :300].contiguous(), w[:300], 1e-6, ready.empty(x, D, parts))


@pytest.mark.parametrize("family", ["mma", "dp4a"])
@pytest.mark.parametrize("block", [None, 512])
def test_the_glu_fills_prep_a_super_block_a_program_with_its_output_bitwise_the_glus_without(family, block,
                                                                                              monkeypatch):
    """With prep, the GLU runs blocks of 256 (a program a super-block) unless told otherwise (512: two a program,
    the last program one): its output bitwise the default blocks' without prep, prep bitwise a launch of its
    own's. 1280 values a row: five super-blocks."""
    import jllm.cuda.ready as ready

    f = 1280
    parts = _ready_parts(monkeypatch, family, f)
    gu = (torch.randn(3, 2 * f, generator=torch.Generator().manual_seed(9)) * 3).to(DEV)
    for gelu in (False, True):
        prep = ready.empty(gu[:, :f], f, parts)
        out = fused.glu(gu, gelu, block, prep) if block else fused.glu(gu, gelu, prep=prep)
        want = fused.glu(gu, gelu)
        assert torch.equal(out.cpu(), want.cpu())
        _same_ready(prep, ready.prepare(want, parts))
    with pytest.raises(ValueError, match="multiple of 256"):
        fused.glu(gu, False, 384, ready.empty(gu[:, :f], f, parts))
