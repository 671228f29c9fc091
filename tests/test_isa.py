"""The kernels' two instruction sets (jllm/kernels/vecmath.h, qgemm.cpp): the AVX2 build computes the same
integer sums and the same float operations lane by lane, with the same reduction trees, as the AVX-512 build.
Where the CPU has AVX-512, a build of the AVX2 path (JLLM_ISA=avx2, in its own process and build directory:
one module per process) must give bitwise this process's results for every kernel. On an AVX2 CPU, the build
without the one-pass tiles (JLLM_TWO_PASS=1) must give this build's bits. Those two are slow tests: each is a
compile of its own (kept in the kernel cache, so only the first run pays)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jllm import kernels

pytestmark = pytest.mark.usefixtures("kernels_required")


def outputs() -> dict[str, torch.Tensor]:
    """Every kernel on fixed inputs: matrices of all four tile kinds with partial tiles, 1 to 11 rows;
    attention over f32 and f16 caches for three head sizes, with and without a window; the row-wise ops."""
    from test_qlinear import C, E, F, S, packed, random_parts

    m = kernels.qgemm()
    g = torch.Generator().manual_seed(5)
    out = {}
    lin = packed(random_parts(g, [(40, F), (24, E), (32, C), (9, F), (7, C), (32, S)], 320), 320,
                 torch.randn(144, generator=g))
    x = torch.randn(11, 320, generator=g)
    x[:, 7] *= 30
    for rows in (1, 2, 3, 4, 5, 8, 11):             # one-pass groups on AVX2 (up to 4 rows), chunks of 8
        out[f"qmatmul{rows}"] = lin(x[:rows])
    for D in (64, 128, 24):
        H, Hk, L, start, T = 8, 2, 100, 60, 7
        k, v = torch.randn(Hk, L, D, generator=g), torch.randn(Hk, L, D, generator=g)
        q = torch.randn(T, H, D, generator=g) * 2
        for window in (0, 21):
            out[f"attention{D}w{window}"] = m.attention(q, k, v, start, window, D ** -0.5)
            out[f"attention{D}w{window}h"] = m.attention(q, k.half(), v.half(), start, window, D ** -0.5)
        cos, sin = torch.randn(T, D // 2, generator=g), torch.randn(T, D // 2, generator=g)
        kc, vc = torch.zeros(Hk, L, D).half(), torch.zeros(Hk, L, D).half()
        kk, vv = torch.randn(T, Hk, D, generator=g), torch.randn(T, Hk, D, generator=g)
        out[f"rope{D}"] = m.rope_store(q, kk, vv, cos, sin, True, D, kc, vc, start)
        out[f"rope{D}cache"] = torch.cat([kc.float(), vc.float()])
    rows = torch.randn(6, 200, generator=g) * 4
    out["rms_norm"] = m.rms_norm(rows, torch.randn(200, generator=g), 1e-6)
    out["silu"] = m.glu(rows, False)
    out["gelu"] = m.glu(rows, True)
    logits = torch.randn(3, 70001, generator=g) * 5
    out["argmax"] = torch.tensor(m.argmax_rows(logits))
    out["top_prob"] = torch.tensor([m.top_prob(logits[1])[1]], dtype=torch.float64)
    return out


def test_build_isa_is_the_cpus():
    assert kernels.qgemm().isa == kernels.isa()


_OTHER_BUILD = """
import sys, torch
sys.path.insert(0, {tests!r})
from jllm import kernels
assert kernels.qgemm().isa == "avx2", kernels.why_unavailable()
from test_isa import outputs
torch.save(outputs(), {out!r})
"""


def same_bits_as_build(tmp_path, env: dict):
    """outputs() of a build made with this environment, in its own process and build directory, must equal
    this process's."""
    out = tmp_path / "other.pt"
    code = _OTHER_BUILD.format(tests=str(Path(__file__).parent), out=str(out))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs, ours = torch.load(out), outputs()
    assert theirs.keys() == ours.keys()
    for name in ours:
        assert torch.equal(theirs[name], ours[name]), name


@pytest.mark.skipif(kernels.isa() != "avx512", reason="this CPU builds only the AVX2 path")
def test_avx2_build_gives_the_avx512_bits(tmp_path, kernel_variant):
    same_bits_as_build(tmp_path, kernel_variant(JLLM_ISA="avx2"))


@pytest.mark.skipif(kernels.isa() != "avx2", reason="the one-pass tiles are AVX2's")
def test_one_pass_tiles_give_the_two_pass_bits(tmp_path, kernel_variant):
    assert "-DJLLM_BOTH_ROWS=0" not in kernels._flags()
    same_bits_as_build(tmp_path, kernel_variant(JLLM_TWO_PASS="1"))
