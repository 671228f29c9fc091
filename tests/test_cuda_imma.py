"""jllm.cuda.imma: the dp4a kernels' products for passes of 2..16 rows on the int8 tensor cores. Their outputs
must be the dp4a kernel's bit for bit (a verify pass's rows on one, a decode step on the other, and speculative
greedy output still plain decoding's): against dp4a.launch at the settings a sweep may pick (ragged outputs,
one and two super-blocks a step, shares of a row, a bias), and through matvec, which sends dp4a's passes of
several rows there. Without a GPU the kernels run in Triton's interpreter; without triton the tests skip."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")          # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (it comes with torch's CUDA builds)")

from gguf import GGMLQuantizationType as T  # noqa: E402

from jllm.cuda import dp4a, imma  # noqa: E402
from jllm.cuda import matvec as mv  # noqa: E402
from jllm.cuda.q4_k import Q4KWeight  # noqa: E402
from jllm.cuda.q6_k import Q6KWeight  # noqa: E402
from test_cuda_dp4a import DEV, rand_x, weight  # noqa: E402

KINDS = [T.Q4_K, T.Q6_K]


@pytest.mark.parametrize("kind", KINDS, ids=lambda t: t.name)
@pytest.mark.parametrize("n, k, block_n, sb, split, m", [
    (64, 512, 32, 2, 1, 5),         # even tiles, bias
    (40, 768, 16, 2, 1, 3),         # ragged outputs and super-blocks (an odd count at sb 2)
    (48, 512, 32, 1, 1, 16),        # a full pass of 16 rows, one super-block a step
    (64, 1536, 32, 2, 3, 9),        # a row in three shares
])
def test_the_products_are_the_dp4a_kernels_bit_for_bit(kind, n, k, block_n, sb, split, m):
    _, w = weight(kind, n, k, seed=n + k)
    x = rand_x(m, k, seed=m).to(DEV)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DEV) if split == 1 else None
    shape = (split, m, n) if split > 1 else (m, n)
    want = torch.full(shape, float("nan"), device=DEV)
    got = torch.full(shape, float("nan"), device=DEV)
    dp4a.launch(x, w, want, block_n, bias, sb, split)
    imma.launch(x, w, got, block_n, bias, sb, split)
    assert not want.isnan().any()
    assert torch.equal(got, want)
    assert torch.equal(got.view(-1).view(torch.int32), want.view(-1).view(torch.int32))     # -0.0 too


@pytest.mark.parametrize("kind", KINDS, ids=lambda t: t.name)
def test_matvec_sends_dp4a_passes_of_several_rows_here_and_each_row_is_its_decode_steps(kind, monkeypatch):
    monkeypatch.setattr(dp4a, "TYPES", (Q4KWeight, Q6KWeight))
    monkeypatch.setenv("JLLM_MATVEC_IMMA", "1")
    calls = []
    real = imma.launch
    monkeypatch.setattr(imma, "launch", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    _, w = weight(kind, 96, 768, seed=5)
    x = rand_x(4, 768, seed=9).to(DEV)
    together = mv.matvec(x, w, block_n=32, sb=2, split=2)
    assert calls == [4]
    for r in range(4):
        alone = mv.matvec(x[r:r + 1], w, block_n=32, sb=2, split=2)                      # dp4a's own kernel
        assert torch.equal(together[r:r + 1], alone)
    assert calls == [4]


def test_which_passes_it_takes(monkeypatch):
    monkeypatch.delenv("JLLM_MATVEC_IMMA", raising=False)
    assert not imma.takes(4, 64, 2)                 # off by default (the module's note)
    monkeypatch.setenv("JLLM_MATVEC_IMMA", "1")
    assert imma.takes(2, 64, 2) and imma.takes(16, 32, 1)
    assert not imma.takes(1, 64, 2)                 # a decode step stays on dp4a's kernel
    assert not imma.takes(17, 64, 2)                # beyond a pass of 16 rows
    assert not imma.takes(4, 8, 2)                  # below tl.dot's 16 outputs
    assert not imma.takes(4, 32, 4)                 # four lanes: dp4a's sum of them is the compiler's order
    assert not imma.takes(4, 16, 1)                 # a setting dp4a's kernel refuses (block_n x sb < 32)
    monkeypatch.setenv("JLLM_MATVEC_IMMA", "0")
    assert not imma.takes(4, 64, 2)
    monkeypatch.setenv("JLLM_MATVEC_IMMA", "yes")
    with pytest.raises(ValueError, match="JLLM_MATVEC_IMMA"):
        imma.takes(4, 64, 2)
    monkeypatch.setenv("JLLM_MATVEC_IMMA", "1")
    _, w = weight(T.Q4_K, 32, 256, seed=1)
    with pytest.raises(ValueError, match="not a pass for the int8 tensor cores"):
        imma.launch(torch.zeros(1, 256, device=DEV), w, torch.zeros(1, 32, device=DEV), 32)
