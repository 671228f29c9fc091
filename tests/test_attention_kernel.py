"""The CPU attention kernel (jllm/kernels/attention.cpp): equal to torch's SDPA within float rounding, with
GQA and sliding windows, for every head size; and each query's output bitwise independent of the other
queries in the call."""

import pytest
import torch
import torch.nn.functional as F

from jllm.kernels import qgemm

pytestmark = pytest.mark.skipif(qgemm() is None, reason="native kernels unavailable on this machine")


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
def test_each_query_is_independent_of_the_others(D):
    g = torch.Generator().manual_seed(D)
    H, Hk, L, start, T = 8, 2, 300, 200, 10
    k, v = torch.randn(Hk, L, D, generator=g), torch.randn(Hk, L, D, generator=g)
    q = torch.randn(T, H, D, generator=g)
    together = qgemm().attention(q, k, v, start, 0, 0.1)
    for t in range(T):
        alone = qgemm().attention(q[t:t + 1].clone(), k, v, start + t, 0, 0.1)
        assert torch.equal(alone[0], together[t])


def test_first_position_attends_to_itself_only():
    k, v = torch.randn(1, 8, 64), torch.randn(1, 8, 64)
    out = qgemm().attention(torch.randn(1, 2, 64), k, v, 0, 0, 0.125)
    torch.testing.assert_close(out.view(2, 64), v[0, :1].expand(2, 64), rtol=1e-6, atol=1e-6)
