"""The CPU attention kernel (jllm/kernels/attention.cpp): equal to torch's SDPA within float rounding, with
GQA and sliding windows, for every head size; each query's output bitwise independent of the other
queries in the call; an f16 cache read exactly as the same values in f32."""

import pytest
import torch
import torch.nn.functional as F

from jllm.kernels import qgemm

pytestmark = pytest.mark.usefixtures("kernels_required")


def sdpa(q, k, v, start, window, scale):
    T, H, D = q.shape
    out = torch.empty(T, H, D)
    for t in range(T):
        p = start + t
        lo = max(0, p - window + 1) if window else 0
        out[t] = F.scaled_dot_product_attention(q[t].view(1, H, 1, D), k[None, :, lo:p + 1], v[None, :, lo:p + 1],
                                                scale=scale, enable_gqa=H != k.shape[0])[0, :, 0]
    return out.view(T, H * D)


@pytest.mark.parametrize("H,Hk,D", [(12, 2, 128), (14, 2, 64), (4, 1, 256), (6, 3, 24), (2, 2, 16)])
@pytest.mark.parametrize("window", [0, 5, 64])
def test_matches_sdpa(H, Hk, D, window):
    g = torch.Generator().manual_seed(H * D + window)
    L, start, T = 160, 97, 9
    k, v = torch.randn(Hk, L, D, generator=g), torch.randn(Hk, L, D, generator=g)
    q = torch.randn(T, H, D, generator=g) * 3
    got = qgemm().attention(q, k, v, start, window, D ** -0.5)
    torch.testing.assert_close(got, sdpa(q, k, v, start, window, D ** -0.5), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("D", [64, 128, 24])
@pytest.mark.parametrize("T,window", [(10, 0), (40, 0), (40, 21)])
def test_each_query_is_independent_of_the_others(D, T, window):
    """A query's output is bitwise the same alone, with a verify pass's few others, or in a prefill chunk
    that spans several work items (16 queries each) — also under a sliding window, where the queries of one
    item see different first keys and the key blocks they share start before some of them."""
    g = torch.Generator().manual_seed(D + T + window)
    H, Hk, L, start = 8, 2, 300, 200
    k, v = torch.randn(Hk, L, D, generator=g), torch.randn(Hk, L, D, generator=g)
    q = torch.randn(T, H, D, generator=g)
    together = qgemm().attention(q, k, v, start, window, 0.1)
    for t in range(T):
        alone = qgemm().attention(q[t:t + 1].clone(), k, v, start + t, window, 0.1)
        assert torch.equal(alone[0], together[t])
    torch.testing.assert_close(together, sdpa(q, k, v, start, window, 0.1), rtol=2e-5, atol=2e-5)


def test_first_position_attends_to_itself_only():
    k, v = torch.randn(1, 8, 64), torch.randn(1, 8, 64)
    out = qgemm().attention(torch.randn(1, 2, 64), k, v, 0, 0, 0.125)
    torch.testing.assert_close(out.view(2, 64), v[0, :1].expand(2, 64), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ row-wise kernels (jllm/kernels/rowwise.cpp)


def test_rms_norm_and_glu_match_torch():
    k = qgemm()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 200, generator=g) * 3, torch.randn(200, generator=g)
    torch.testing.assert_close(k.rms_norm(x, w, 1e-6), F.rms_norm(x, (200,), w, 1e-6), rtol=1e-5, atol=1e-5)
    heads = torch.randn(3, 5, 24, generator=g)[:, 1:]          # a non-contiguous view, as q/k norms get
    wh = torch.randn(24, generator=g)
    torch.testing.assert_close(k.rms_norm(heads, wh, 1e-6), F.rms_norm(heads, (24,), wh, 1e-6), rtol=1e-5, atol=1e-5)
    gu = torch.randn(4, 2 * 70, generator=g) * 4
    gate, up = gu[:, :70], gu[:, 70:]
    torch.testing.assert_close(k.glu(gu, False), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.glu(gu, True), F.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("neox,rope_dim", [(True, 64), (False, 64), (True, 32)])
def test_rope_store_matches_the_torch_path(neox, rope_dim):
    from types import SimpleNamespace

    from jllm.model.transformer import apply_rope, rope_table

    g = torch.Generator().manual_seed(rope_dim)
    T, H, Hk, D, L, start = 5, 4, 2, 64, 32, 7
    qkv = torch.randn(T, (H + 2 * Hk) * D, generator=g)
    qk = qkv[:, :(H + Hk) * D].view(T, H + Hk, D)
    v = qkv[:, (H + Hk) * D:].view(T, Hk, D)
    cos, sin = rope_table(SimpleNamespace(rope_dim=rope_dim), 10000.0, 1.0, L, "cpu")
    kc, vc = torch.zeros(Hk, L, D), torch.zeros(Hk, L, D)
    q = qgemm().rope_store(qk[:, :H], qk[:, H:], v, cos[start:start + T], sin[start:start + T], neox, rope_dim,
                           kc, vc, start)
    want = apply_rope(qk, cos[start:start + T], sin[start:start + T], neox, rope_dim)
    torch.testing.assert_close(q, want[:, :H], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc[:, start:start + T], want[:, H:].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(vc[:, start:start + T], v.transpose(0, 1))
    assert not kc[:, :start].any() and not kc[:, start + T:].any()


# ------------------------------------------------------------------ f16 cache (the engine's default on this path)


@pytest.mark.parametrize("H,Hk,D", [(12, 2, 128), (14, 2, 64), (6, 3, 24)])
def test_an_f16_cache_gives_the_bits_of_its_values_in_f32(H, Hk, D):
    """f16 keys and values are converted exactly on load: the result equals, bit for bit, that of an f32
    cache holding the same values, for several queries and for one (a verify pass and a decode step)."""
    g = torch.Generator().manual_seed(D)
    L, start, T = 200, 150, 6
    k16, v16 = torch.randn(Hk, L, D, generator=g).half(), torch.randn(Hk, L, D, generator=g).half()
    q = torch.randn(T, H, D, generator=g)
    for window in (0, 40):
        got = qgemm().attention(q, k16, v16, start, window, D ** -0.5)
        assert torch.equal(got, qgemm().attention(q, k16.float(), v16.float(), start, window, D ** -0.5))
        one = qgemm().attention(q[:1].clone(), k16, v16, start, window, D ** -0.5)
        assert torch.equal(one[0], got[0])


@pytest.mark.parametrize("D", [64, 24])            # 24: a vector of 16, then 8 one at a time
def test_rope_store_rounds_into_an_f16_cache(D):
    from types import SimpleNamespace

    from jllm.model.transformer import rope_table

    g = torch.Generator().manual_seed(5)
    T, H, Hk, L, start = 4, 4, 2, 16, 3
    qk = torch.randn(T, H + Hk, D, generator=g)
    v = torch.randn(T, Hk, D, generator=g)
    cos, sin = rope_table(SimpleNamespace(rope_dim=D), 10000.0, 1.0, L, "cpu")
    args = (qk[:, :H], qk[:, H:], v, cos[start:start + T], sin[start:start + T], True, D)
    kc, vc = torch.zeros(Hk, L, D), torch.zeros(Hk, L, D)
    kh, vh = torch.zeros(Hk, L, D, dtype=torch.float16), torch.zeros(Hk, L, D, dtype=torch.float16)
    q32 = qgemm().rope_store(*args, kc, vc, start)
    q16 = qgemm().rope_store(*args, kh, vh, start)
    assert torch.equal(q16, q32)                       # q is returned in f32 either way
    assert torch.equal(kh, kc.half()) and torch.equal(vh, vc.half())


def test_a_bad_cache_dtype_is_refused():
    k = torch.zeros(1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        qgemm().attention(torch.randn(1, 2, 64), k, k, 0, 0, 0.125)


@pytest.mark.parametrize("V", [1, 17, 65536, 151936])
def test_top_prob_is_argmax_and_its_softmax_probability(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(V, generator=g) * 4
    if V > 20:
        x[V // 3] = x[V // 2] = x.max() + 1            # a tie: the first index wins, as torch.argmax
    tok, p = qgemm().top_prob(x)
    assert tok == int(torch.argmax(x))
    assert p == pytest.approx(torch.softmax(x.double(), -1).max().item(), rel=1e-4)   # f32 sums of ~10^4 a lane
