"""What verify passes cost inside the speculative loop, by row count, against plain decoding's step in the
same run: every `--every`-th corpus prompt decoded plain and then speculatively (as `jllm bench --spec` does),
each target forward pass of up to 12 tokens timed. These are the V(k) to replay the corpus with
(`spec_sim.py sim --V`): they include what the loop does to the target's passes (the draft's steps between
them), which the context-300 passes of `jllm bench` do not. Then where each mode's decode time went: target
passes, draft passes, and the rest (sampling, drafting logic, cache bookkeeping, Python). `-md` names a draft
model or an EAGLE-3 head. On a GPU (`--device cuda --precision blocks`) each timed pass is bracketed by device
synchronisations, so its time is its launch and its kernels, and "rest" the host's work between passes.

    python benchmarks/spec_loop_costs.py [--every 3] [-n 128]
    python benchmarks/spec_loop_costs.py -m MODEL.gguf -md HEAD.gguf --device cuda --precision blocks
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from jllm.engine import Engine
from jllm.sampling import SamplingParams
from jllm.spec.bench import _run
from jllm.spec.corpus import load_corpus
from jllm.spec.config import SpecConfig
from jllm.catalog import resolve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--every", type=int, default=3, help="every N-th corpus prompt")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default=None)
    a = ap.parse_args()
    eng = Engine(str(resolve(a.model)), device=a.device, precision=a.precision, draft_path=str(resolve(a.draft)),
                 spec=SpecConfig())
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    if eng.model.chain is not None:           # plain greedy steps one pass each (the steps' unit), not chained
        eng.model.chain = None
        print("plain decoding one step a pass here (jllm.cuda.chain off): the unit of the verify passes")
    if eng.rounds is not None:                # the host-driven loop's passes: rounds on the device bypass it (a
        eng.rounds = None                     # session-33 run without this timed plain passes only, k = 0)
        print("speculation driven by the host here (jllm.cuda.rounds off): its passes are what this times")
    times = collections.defaultdict(list)         # (mode, rows) -> seconds of target passes
    spent = collections.Counter()                 # (mode, "target" | "draft" | "decode") -> seconds
    mode = ["plain"]

    def timing(model, name):
        forward = model.forward

        def timed(tokens, *args, **kw):
            sync()
            t = time.perf_counter()
            out = forward(tokens, *args, **kw)
            sync()
            if len(tokens) <= 12:                 # decode steps, verify passes, draft steps; not prefills
                dt = time.perf_counter() - t
                spent[mode[0], name] += dt
                if name == "target":
                    times[mode[0], len(tokens)].append(dt)
            return out

        model.forward = timed

    timing(eng.model, "target")
    timing(eng.draft.model if eng.draft is not None else eng.head, "draft")     # a draft model, or a head
    params = SamplingParams(max_tokens=a.n)
    for item in load_corpus()[::a.every]:
        ids = eng.chat_ids(item["messages"])
        for mode[0], cfg in (("plain", None), ("spec", SpecConfig())):
            res, _ = _run(eng, ids, params, cfg)
            spent[mode[0], "decode"] += res.timings.decode_ms / 1000
            spent[mode[0], "tokens"] += len(res.token_ids)
    step = statistics.median(times["plain", 1])
    print(f"plain step: median {step * 1000:.2f} ms over {len(times['plain', 1])} steps")
    print(f"{'drafts k':>8} {'passes':>7} {'median ms':>10} {'steps':>6}")
    passes = []
    for rows in range(1, 13):
        ts = times.get(("spec", rows))
        if ts:
            passes += ts
            print(f"{rows - 1:>8} {len(ts):>7} {statistics.median(ts) * 1000:>10.2f} {statistics.median(ts) / step:>6.2f}")
    print(f"mean verify pass: {statistics.mean(passes) / step:.2f} steps over {len(passes)} passes")
    print(f"\n{'mode':<6} {'tok/s':>7} {'decode s':>9} {'target':>7} {'draft':>7} {'rest':>7}")
    for m in ("plain", "spec"):
        dec = spent[m, "decode"]
        rest = dec - spent[m, "target"] - spent[m, "draft"]
        print(f"{m:<6} {spent[m, 'tokens'] / dec:>7.2f} {dec:>9.2f} {spent[m, 'target'] / dec:>6.1%} "
              f"{spent[m, 'draft'] / dec:>6.1%} {rest / dec:>6.1%}")


if __name__ == "__main__":
    main()
