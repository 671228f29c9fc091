"""The native kernels of an earlier commit against the working tree's, in one process, interleaved, with a
check that both give the same bits.

    python benchmarks/kernels_ab.py REV forward {draft|target} [--tokens 1,5] [--rounds 40]
    python benchmarks/kernels_ab.py REV attention [--rounds 200]

`forward`: a model's whole forward pass after a 300-token context, once through REV's layer stack (its final
norm and output layer then run from Python, as they did before the stack took them) and once through the
working tree's. The draft is the 0.5B as the engine runs it (native4, FR-Spec output rows).
`attention`: the attention kernel alone, cache in L2, on the target's and the draft's head shapes.
REV must have the pointer-free stack API of session 8 or later (`Stack.add_layer`, `Stack.forward(x, k, v,
start)`; from session 9 also `Stack.set_head`). Building REV's kernels takes about a minute.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from jllm import kernels
from kernel_variants import load_sources


def build_rev(rev: str):
    """REV's kernel module, loadable beside the working tree's (kernel_variants.load_sources)."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True, capture_output=True,
                               text=True).stdout.strip())
    texts = {f.name: subprocess.run(["git", "show", f"{rev}:{Path(f).resolve().relative_to(root)}"], check=True,
                                    capture_output=True, text=True).stdout for f in kernels._SOURCES + kernels._HEADERS}
    return load_sources(texts, kernels._flags(), Path(tempfile.gettempdir()) / "jllm-kernels-rev", "jllm_rev_")


def forward_ab(old, which: str, tokens: list[int], rounds: int) -> None:
    from jllm.model.loader import load_model
    from jllm.spec import DRAFT_VOCAB
    from jllm.catalog import resolve

    if which == "draft":
        model = load_model(resolve("qwen2.5-coder-0.5b"), "cpu", "native4", output_rows=DRAFT_VOCAB)
    else:
        model = load_model(resolve("qwen2.5-coder-1.5b"), "cpu", None)
    new_stack, new_kernels = model.stack, model.kernels

    headed = hasattr(old.Stack, "set_head")     # session 9 on: the stack runs the final norm and output too

    class RevStack:                      # REV's stack (the layers) behind the working tree's interface
        def __init__(self, *a):
            self.s = old.Stack(*a)

        def add_layer(self, *a):
            self.s.add_layer(*a)

        def set_head(self, *a):
            if headed:
                self.s.set_head(*a)

        def forward(self, x, k, v, start, last_only=False, tree=()):   # before: the final norm and output from Python
            assert not tree, "trees and side leaves are not compared"
            if headed:
                return self.s.forward(x, k, v, start, last_only)
            h = self.s.forward(x, k, v, start)
            h = h[-1:] if last_only else h
            return model.w.output(old.rms_norm(h, model.w.output_norm, model.cfg.rms_eps))

    class RevKernels:
        Stack = RevStack

        def __getattr__(self, name):
            return getattr(old, name)

    model.kernels = RevKernels()
    old_stack, old_kernels = model._native_stack(), model.kernels
    model.kernels = new_kernels
    cache = model.new_cache(2048)
    model.forward(torch.randint(0, 1000, (300,)), cache)
    base = cache.length
    ids = {T: torch.randint(0, 1000, (T,)) for T in tokens}
    times = {(v, T): [] for v in ("rev", "new") for T in tokens}
    outs = {}
    for _ in range(rounds):
        for T in tokens:
            for v in ("rev", "new"):
                model.stack, model.kernels = (old_stack, old_kernels) if v == "rev" else (new_stack, new_kernels)
                cache.truncate(base)
                t = time.perf_counter()
                outs[v, T] = model.forward(ids[T], cache, last_only=T == 1)
                times[v, T].append(time.perf_counter() - t)
    model.stack, model.kernels = new_stack, new_kernels
    print(f"{which}: forward pass at context 300, ms, medians of {rounds} interleaved rounds")
    for T in tokens:
        same = "same bits" if torch.equal(outs["rev", T], outs["new", T]) else "RESULTS DIFFER"
        r, n = (statistics.median(times[v, T]) * 1000 for v in ("rev", "new"))
        print(f"  {T:>2} tokens: rev {r:7.2f}  new {n:7.2f}  ({n - r:+.2f})  {same}")


def attention_ab(old, rounds: int) -> None:
    new = kernels.qgemm()
    print(f"attention, f16 cache, us a call, medians of {rounds} interleaved calls")
    for H, Hk, D, T, ctx in ((12, 2, 128, 1, 300), (12, 2, 128, 5, 300), (12, 2, 128, 5, 2000),
                             (14, 2, 64, 1, 300), (14, 2, 64, 2, 300), (12, 2, 128, 256, 300)):
        L = ctx + T
        k, v = torch.randn(Hk, L, D).half(), torch.randn(Hk, L, D).half()
        q = torch.randn(T, H, D)
        times = {"rev": [], "new": []}
        n = rounds if T < 100 else max(5, rounds // 10)
        for _ in range(n):
            for name, mod in (("rev", old), ("new", new)):
                t = time.perf_counter()
                mod.attention(q, k, v, ctx, 0, D ** -0.5)
                times[name].append(time.perf_counter() - t)
        same = torch.equal(old.attention(q, k, v, ctx, 0, D ** -0.5), new.attention(q, k, v, ctx, 0, D ** -0.5))
        r, w = (statistics.median(times[x]) * 1e6 for x in ("rev", "new"))
        print(f"  heads {H}/{Hk} x {D}, {T:>3} queries, context {ctx:>4}: rev {r:8.1f}  new {w:8.1f}  "
              f"{'same bits' if same else 'RESULTS DIFFER'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev")
    ap.add_argument("what", choices=("forward", "attention"))
    ap.add_argument("model", nargs="?", choices=("draft", "target"), default="draft")
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--rounds", type=int, default=None)
    a = ap.parse_args()
    if not kernels.native_possible():
        raise SystemExit("native kernels unavailable on this machine")
    old = build_rev(a.rev)
    if a.what == "forward":
        forward_ab(old, a.model, [int(t) for t in a.tokens.split(",")], a.rounds or 40)
    else:
        attention_ab(old, a.rounds or 200)


if __name__ == "__main__":
    main()
