"""Compare builds of the CPU kernels that differ only in compiler flags (-D macros of qgemm.cpp, such as
JLLM_PREFETCH), in one process: every matrix of a step (or of the draft's step) for M rows, the variants
interleaved round by round so the host's memory phases fall on all of them alike. Rounds are split into
fast and slow memory phases by the first variant's one-row pass (under --fast-ms), and medians are printed
for each phase: a change can help in one phase and not the other.

    python benchmarks/kernel_variants.py [--rows 1,2,3,5] [--draft] [--rounds 60] -- "" "-DJLLM_PREFETCH=2048"

The empty string is the build as configured. Every variant must give bitwise the same result (checked).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from pathlib import Path

import torch
import torch.utils.cpp_extension as ext

import jllm.kernels as kernels
from jllm.model.loader import load_model
from jllm.model.qlinear import GROUP_BYTES
from jllm.catalog import resolve


def load_sources(texts: dict[str, str], flags: list[str], root: Path, prefix: str):
    """A kernel module built from the given sources (file name -> text: the .cpp files and headers of
    jllm/kernels), under a module name of its own, loadable beside jllm's own module and other such builds."""
    key = " ".join(flags) + "".join(texts[n] for n in sorted(texts))
    name = prefix + hashlib.sha1(key.encode()).hexdigest()[:10]
    src = root / name / "src"
    src.mkdir(parents=True, exist_ok=True)
    for n, text in texts.items():
        if n == "layers.cpp":      # two modules may not both register the class Stack globally
            text = text.replace('(m, "Stack")', '(m, "Stack", pybind11::module_local())')
        (src / n).write_text(text)
    kernels.qgemm()                # jllm's own module first: it registers Stack globally
    return ext.load(name=name, sources=[str(src / s.name) for s in kernels._SOURCES], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], build_directory=str(root / name), verbose=False)


def build(flags: list[str], root: Path):
    """The working tree's kernels compiled with extra flags."""
    texts = {f.name: f.read_text() for f in kernels._SOURCES + kernels._HEADERS}
    return load_sources(texts, flags, root, "jllm_variant_")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="extra compiler flags of each build, one string each")
    ap.add_argument("--rows", default="1,2,3,5")
    ap.add_argument("--draft", action="store_true", help="the draft's matrices as the engine runs them (0.5B, native4, FR-Spec output rows)")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--fast-ms", type=float, default=24.0, help="a round is fast when variant 1, M = 1 is under")
    ap.add_argument("--build-dir", default="/tmp/jllm-kernel-variants")
    a = ap.parse_args()
    if not kernels.native_possible():
        raise SystemExit("native kernels unavailable on this machine")
    Ms = [int(x) for x in a.rows.split(",")]
    mods = [build(kernels._flags() + v.split(), Path(a.build_dir)) for v in a.variants]
    if a.draft:
        from jllm.spec import DRAFT_VOCAB
        model = load_model(resolve("qwen2.5-coder-0.5b"), "cpu", "native4", output_rows=DRAFT_VOCAB)
    else:
        model = load_model(resolve("qwen2.5-coder-1.5b"), "cpu", None)
    mats = model.w.matrices()
    xs = {(M, m.in_features): torch.randn(M, m.in_features) for M in Ms for m in mats}

    def run(mod, M: int) -> float:
        t = time.perf_counter()
        for m in mats:
            mod.qmatmul(xs[M, m.in_features], m.data, m.offsets, m.kinds, m.out_features, m.bias, GROUP_BYTES)
        return time.perf_counter() - t

    m0, x0 = mats[0], xs[Ms[-1], mats[0].in_features]
    outs = [mod.qmatmul(x0, m0.data, m0.offsets, m0.kinds, m0.out_features, m0.bias, GROUP_BYTES) for mod in mods]
    if not all(torch.equal(outs[0], o) for o in outs):
        raise SystemExit("the variants' results differ")
    times = {(i, M): [] for i in range(len(mods)) for M in Ms}
    fast = []
    for _ in range(a.rounds):
        for i, mod in enumerate(mods):
            for M in Ms:
                times[i, M].append(run(mod, M))
        fast.append(times[0, Ms[0]][-1] * 1000 < a.fast_ms)
    print(f"{'draft' if a.draft else 'target'} matrices, {sum(m.nbytes() for m in mats) / 1e6:.0f} MB; "
          f"ms a pass, medians")
    for label, want in (("fast", True), ("slow", False)):
        rounds = [r for r, f in enumerate(fast) if f == want]
        print(f"{label} phase: {len(rounds)} rounds")
        if not rounds:
            continue
        print(f"  {'variant':<44}" + "".join(f"{f'M = {M}':>9}" for M in Ms))
        for i, v in enumerate(a.variants):
            row = "".join(f"{statistics.median([times[i, M][r] for r in rounds]) * 1000:>9.2f}" for M in Ms)
            print(f"  {v or '(as built)':<44}{row}")


if __name__ == "__main__":
    main()
