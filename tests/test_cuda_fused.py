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
