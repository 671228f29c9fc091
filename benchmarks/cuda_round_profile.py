"""Where a speculative round on the GPU (jllm.cuda.rounds) spends its time: one round's graph replay against a
decode step's and a verify pass's, the head's passes timed alone, and an eager round's kernels by GPU time,
split into its parts (the head's drafts, the verify pass, the head over the verified rows, the bookkeeping).
Session 33 measured rounds of 3 drafts at ~3.4-4.3 ms for ~2.2 tokens against a 1.6-1.8 ms decode step, ~0.8-1
ms more than their verify pass alone (BENCHMARKS.md, "Session 33 on the GPU"): this says where that goes.

    python benchmarks/cuda_round_profile.py TARGET.gguf HEAD.gguf [-k 3] [--top 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cuda_profile import cuda_events, kernel_table
from jllm.engine import Engine
from jllm.sampling import SamplingParams
from jllm.spec.config import SpecConfig

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests."


def timed(run, reset, reps: int = 50) -> float:
    """Median ms of run() after reset(), each waited for."""
    times = []
    for _ in range(reps):
        reset()
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("head")
    ap.add_argument("-k", type=int, default=3, help="drafts a round (JLLM_CUDA_ROUNDS)")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    os.environ["JLLM_CUDA_ROUNDS"] = str(a.k)
    os.environ["JLLM_CUDA_ROUND_GATE"] = "0"                  # rounds always: their graph is captured below
    eng = Engine(a.model, device="cuda", precision="blocks", draft_path=a.head, spec=SpecConfig())
    if eng.rounds is None:
        raise SystemExit("no rounds for this pair (a GPU, the blocks precision, an EAGLE-3 head)")
    eng.generate(PROMPT, SamplingParams(max_tokens=48))      # compiles, captures the round's graph
    r, seq, head, m = eng.rounds, eng.target, eng.head, eng.model
    b = next(b for per in r._buffers.values() for b in per.values() if b.graph is not None)
    pos = len(seq.ids)
    token = seq.ids[-1]
    first = eng.draft_proposer.catch_up(seq.ids + [token])
    k, n0, h0 = a.k, seq.cache.length, head.cache.length
    room = pos + 4 * (k + 1)
    seq.cache.length = max(n0, room)
    head.cache.length = max(h0, room)

    def start():
        r._start(b, token=token, position=pos, logits=first.logits, hidden=first.state)

    ids1 = torch.tensor([token], device="cuda")
    idsk = torch.full((k + 1,), token, device="cuda")
    host1, hostk = ids1.cpu(), idsk.cpu()                 # the head's tokens, as its step takes them
    g1 = first.state.reshape(1, -1)
    gk = g1.expand(k + 1, -1).contiguous()
    cut = lambda: (seq.cache.truncate(pos), head.cache.truncate(pos))          # noqa: E731
    rows = [("a round (graph replay)", lambda: b.graph.replay(), start),
            ("a decode step (graph)", lambda: m.forward(ids1, seq.cache, capture=seq.capture), cut),
            (f"a verify pass of {k + 1} rows (graph)", lambda: m.forward(idsk, seq.cache, capture=seq.capture), cut),
            ("the head, one row (graph)", lambda: head.forward(host1, g1), cut),
            (f"the head, {k + 1} rows (graph)", lambda: head.forward(hostk, gk), cut)]
    print(f"k = {k}, context {pos}")
    for label, run, reset in rows:
        print(f"{label:<40} {timed(run, reset):8.3f} ms")
    cut()
    seq.cache.length, head.cache.length = max(n0, room), max(h0, room)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            start()
            r._round(b, seq.cache, seq.features, seq.capture)
        torch.cuda.synchronize()
    kernel_table(prof, 5, a.top, "one eager round")
    parts = [e for e in prof.key_averages() if e.key.startswith("round: ")       # the labels' CPU side: the GPU
             and e.device_type == torch.autograd.DeviceType.CPU]                  # time of what each launched
    total = sum(e.self_device_time_total for e in cuda_events(prof)) / 5
    print(f"\nby part of the round (GPU time of the kernels each launches; all {total / 1e3:.3f} ms)")
    for e in parts:
        print(f"  {e.key:<28} {e.device_time_total / 5 / 1e3:8.3f} ms")
    seq.cache.length, head.cache.length = n0, h0


if __name__ == "__main__":
    main()
