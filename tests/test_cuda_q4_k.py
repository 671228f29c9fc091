"""Q4_K on the GPU (jllm.cuda.q4_k): the device layout and the Triton matvec against the CPU's own
dequantization, and each output row independent of the other rows of its call, bit for bit. On a machine
without CUDA the kernel runs in Triton's interpreter; without triton (CI's CPU torch) the tests skip."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")          # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (it comes with torch's CUDA builds)")

from gguf import GGMLQuantizationType as T  # noqa: E402

from jllm.cuda.q4_k import Q4KWeight, matvec  # noqa: E402
from jllm.gguf.quants import dequantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def random_q4_k(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random Q4_K bytes [n * k / 256 * 144]: random codes, scale and min bytes, small finite d and dmin."""
    g = torch.Generator().manual_seed(seed)
    nb = n * k // 256
    b = torch.randint(0, 256, (nb, 144), generator=g, dtype=torch.uint8)
    half = (torch.rand(nb, 2, generator=g) * 0.02 + 0.001).to(torch.float16)
    b[:, 0:4] = half.view(torch.uint8).view(nb, 4)
    return b.reshape(-1)


def test_layout_keeps_the_blocks_and_is_near_their_size():
    n, k = 8, 512
    raw = random_q4_k(n, k)
    w = Q4KWeight.from_gguf(raw, (n, k))
    assert w.shape == (n, k)
    assert w.nbytes() == n * (k // 256) * 148                        # 144 + 4: the header unpacked once
    assert w.nbytes() / raw.numel() < 1.03
    with pytest.raises(ValueError, match="multiple of 256"):
        Q4KWeight.from_gguf(raw, (n, k + 128))
    with pytest.raises(ValueError, match="bytes"):
        Q4KWeight.from_gguf(raw[:-1], (n, k))


@pytest.mark.parametrize("n,k", [(40, 512), (16, 256)])
def test_matvec_matches_the_cpu_dequantization(n, k):
    raw = random_q4_k(n, k, seed=n)
    ref_w = dequantize(raw.numpy(), T.Q4_K, (n, k)).double()
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    y = matvec(x.to(DEV), Q4KWeight.from_gguf(raw, (n, k), DEV), block_n=16).cpu()
    want = x.double() @ ref_w.T
    assert y.shape == (3, n) and y.dtype == torch.float32
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


def test_each_row_is_its_own_bitwise_whatever_the_rows_beside_it():
    n, k = 24, 512
    w = Q4KWeight.from_gguf(random_q4_k(n, k, seed=3), (n, k), DEV)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2)).to(DEV)
    together = matvec(x, w)
    for i in range(5):
        assert torch.equal(matvec(x[i:i + 1], w), together[i:i + 1])
    assert torch.equal(matvec(x[1:4], w), together[1:4])
    with pytest.raises(ValueError, match="must be"):
        matvec(x[:, :256], w)
