"""The GPU attention (jllm.cuda.attention): each (query, head) over exactly its keys, as the per-query
reference computes it, and bitwise the same whatever other queries share the call. Triton's interpreter runs it
on a machine without CUDA; without triton the tests skip."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")          # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (it comes with torch's CUDA builds)")

from jllm.cuda.attention import attention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, k, v, start, window, scale):
    """One query at a time over its keys lo..p, torch's SDPA in float64."""
    T, H, hd = q.shape
    out = torch.empty(T, H, hd, dtype=torch.float64)
    for t in range(T):
        p = start + t
        lo = max(0, p - window + 1) if window else 0
        o = F.scaled_dot_product_attention(q[t].double().view(1, H, 1, hd), k[None, :, lo:p + 1].double(),
                                           v[None, :, lo:p + 1].double(), scale=scale,
                                           enable_gqa=H != k.shape[0])
        out[t] = o[0, :, 0]
    return out.view(T, H * hd)


@pytest.mark.parametrize("window", [0, 5])
def test_attention_matches_the_per_query_reference(window):
    g = torch.Generator().manual_seed(window)
    T, H, Hk, hd, max_t, start = 4, 6, 2, 32, 160, 70                 # keys cross blocks of 64
    q = torch.randn(T, H, hd, generator=g)
    k, v = torch.randn(Hk, max_t, hd, generator=g), torch.randn(Hk, max_t, hd, generator=g)
    got = attention(q.to(DEV), k.to(DEV), v.to(DEV), start, window, hd ** -0.5).cpu()
    assert torch.allclose(got.double(), reference(q, k, v, start, window, hd ** -0.5), atol=1e-5)


def test_each_query_is_its_own_bitwise():
    g = torch.Generator().manual_seed(9)
    T, H, Hk, hd, max_t, start = 5, 4, 1, 16, 96, 40
    q = torch.randn(T, H, hd, generator=g).to(DEV)
    k, v = torch.randn(Hk, max_t, hd, generator=g).to(DEV), torch.randn(Hk, max_t, hd, generator=g).to(DEV)
    together = attention(q, k, v, start, 0, 0.25)
    for t in range(T):
        assert torch.equal(attention(q[t:t + 1], k, v, start + t, 0, 0.25), together[t:t + 1])
    with pytest.raises(ValueError, match="power of two"):
        attention(q[:, :, :12], k[:, :, :12], v[:, :, :12], start, 0, 0.25)
    with pytest.raises(ValueError, match="cache of 96"):
        attention(q, k, v, 93, 0, 0.25)


@pytest.mark.parametrize("window", [0, 300])
def test_a_long_cache_is_split_in_wider_chunks_and_merged_exactly(window):
    from jllm.cuda.attention import chunk_size

    assert chunk_size(4096) == 64 and chunk_size(4500) == 128 and chunk_size(32768) == 512
    g = torch.Generator().manual_seed(11 + window)
    T, H, Hk, hd, max_t, start = 2, 2, 1, 16, 4500, 4380            # 36 chunks of 128; the last ones unused
    q = torch.randn(T, H, hd, generator=g)
    k, v = torch.randn(Hk, max_t, hd, generator=g), torch.randn(Hk, max_t, hd, generator=g)
    got = attention(q.to(DEV), k.to(DEV), v.to(DEV), start, window, 0.3).cpu()
    assert torch.allclose(got.double(), reference(q, k, v, start, window, 0.3), atol=1e-5)
    pos = torch.tensor([start + 1], device=DEV)                      # positions as a device tensor
    assert torch.equal(attention(q[1:].to(DEV), k.to(DEV), v.to(DEV), pos, window, 0.3).cpu(), got[1:])


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("window", [0, 7])
def test_a_prefill_sized_call_takes_all_keys_in_one_chunk_and_keeps_each_row_its_own(window, tiled, monkeypatch):
    from jllm.cuda import attention as mod
    from jllm.cuda.layout import QUERIES

    monkeypatch.setattr(mod, "TILED", tiled)
    g = torch.Generator().manual_seed(21 + window)
    T, H, Hk, hd, max_t, start = QUERIES + 4, 4, 2, 16, 200, 60      # keys cross blocks of 64
    q = torch.randn(T, H, hd, generator=g)
    k, v = torch.randn(Hk, max_t, hd, generator=g), torch.randn(Hk, max_t, hd, generator=g)
    got = attention(q.to(DEV), k.to(DEV), v.to(DEV), start, window, 0.3).cpu()
    assert torch.allclose(got.double(), reference(q, k, v, start, window, 0.3), atol=1e-5)
    later = attention(q[3:].to(DEV), k.to(DEV), v.to(DEV), start + 3, window, 0.3).cpu()    # another such call
    if tiled:                                          # a row's place in its tile may move its last bits
        assert torch.allclose(later, got[3:], atol=1e-6, rtol=0)
    else:
        assert torch.equal(later, got[3:])


@pytest.mark.parametrize("window", [0, 40])
def test_tiles_of_queries_span_calls_of_any_length_and_a_float16_cache(window, monkeypatch):
    """Several tiles of queries (and a last one part full), each row over its own keys whatever tile it falls
    in: a call shifted by 5 rows gives the same rows to float32 rounding (the products' summing order may
    move with a row's place in its tile). The cache is float16 as on the blocks path, and its slots past the
    call's last position hold NaN: no tile may read them."""
    from jllm.cuda import attention as mod

    monkeypatch.setattr(mod, "TILED", True)
    g = torch.Generator().manual_seed(31 + window)
    T, H, Hk, hd, max_t, start = 2 * mod.BLOCK_M + 7, 4, 2, 32, 256, 90
    q = torch.randn(T, H, hd, generator=g)
    k = torch.randn(Hk, max_t, hd, generator=g).half()
    v = torch.randn(Hk, max_t, hd, generator=g).half()
    k[:, start + T:], v[:, start + T:] = float("nan"), float("nan")
    got = attention(q.to(DEV), k.to(DEV), v.to(DEV), start, window, 0.2).cpu()
    assert torch.allclose(got.double(), reference(q, k.float(), v.float(), start, window, 0.2), atol=1e-5)
    later = attention(q[5:].to(DEV), k.to(DEV), v.to(DEV), start + 5, window, 0.2).cpu()
    assert torch.allclose(later, got[5:], atol=1e-6, rtol=0) and not later.isnan().any()
