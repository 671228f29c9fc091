"""Paired comparison of two speculative configurations on the corpus: every prompt is decoded plain, with
configuration A and with configuration B, back to back in one process (A and B swap order from prompt to
prompt), so the host's minute-to-minute speed swings fall on all three alike. Separate `jllm bench --spec`
runs differ by ±0.05x from that noise alone.

    python benchmarks/spec_ab.py --a p_min=0.7 --b p_min=0.6 [--limit N]
    python benchmarks/spec_ab.py -md qwen2.5-coder-1.5b-eagle3 --b gate.off_below=0.85
    python benchmarks/spec_ab.py -md qwen2.5-coder-1.5b-eagle3 --temp 1.0 --b p_min=0.5     # sampled
    python benchmarks/spec_ab.py -md qwen2.5-coder-1.5b-eagle3 --b-draft qwen2.5-coder-0.5b  # two proposers

Keys are SpecConfig fields, or `gate.` and a DraftGate argument (jllm.spec.policy); values are parsed as
int, float or str. Besides time, each configuration's target passes are counted (tokens - accepted: verify
passes and the plain steps of gated-off stretches), which the host's speed does not move. With --temp the
three runs sample (same seed): their outputs differ, so speedups are of tok/s, and target passes are counted
per token emitted.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict
from dataclasses import replace

import jllm.engine
from jllm.engine import Engine
from jllm.sampling import SamplingParams
from jllm.spec.bench import _run
from jllm.spec.corpus import load_corpus
from jllm.spec.config import SpecConfig
from jllm.catalog import resolve
from jllm.spec.policy import DraftGate


def _config(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        for cast in (int, float, str):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                pass
    return out


def _split(overrides: dict) -> tuple[dict, dict]:
    """-> (SpecConfig overrides, DraftGate arguments); an unknown gate argument fails here, before any model
    loads."""
    spec = {k: v for k, v in overrides.items() if not k.startswith("gate.")}
    gate = {k[len("gate."):]: v for k, v in overrides.items() if k.startswith("gate.")}
    try:
        DraftGate(**gate)
        replace(SpecConfig(), **spec)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"spec_ab: {e}")
    return spec, gate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--a", default="", help="configuration A: SpecConfig overrides, key=value,...")
    ap.add_argument("--b", default="", help="configuration B")
    ap.add_argument("--b-draft", default=None, help="configuration B drafts with this model or head instead "
                    "(a second engine over the same target)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--json", default=None, help="write every prompt's figures here")
    ap.add_argument("--temp", type=float, default=0.0, help="sample at this temperature (0: greedy, the default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    base = SpecConfig()
    split = {"A": _split(_config(a.a)), "B": _split(_config(a.b))}
    cfgs = {name: replace(base, **spec) for name, (spec, _) in split.items()}
    rows = []
    eng = Engine(str(resolve(a.model)), draft_path=str(resolve(a.draft)), spec=base)
    engines = {"A": eng, "B": Engine(str(resolve(a.model)), draft_path=str(resolve(a.b_draft)), spec=base)
               if a.b_draft else eng}
    params = SamplingParams(max_tokens=a.n, temperature=a.temp, top_p=a.top_p, seed=a.seed)
    sums = defaultdict(lambda: defaultdict(float))         # category -> plain/A/B -> seconds; tokens
    t0 = time.perf_counter()
    for i, item in enumerate(load_corpus()[:a.limit] if a.limit else load_corpus()):
        ids = eng.chat_ids(item["messages"])
        plain, _ = _run(eng, ids, params, None)
        res, passes = {}, {}
        for name in ("AB" if i % 2 == 0 else "BA"):
            jllm.engine.DraftGate = functools.partial(DraftGate, **split[name][1])
            try:
                out, st = _run(engines[name], ids, params, cfgs[name])
            finally:
                jllm.engine.DraftGate = DraftGate
            if params.greedy:
                assert out.token_ids == plain.token_ids, f"{item['id']}: configuration {name} changed the output"
            # seconds for the plain run's token count (sampled runs may stop elsewhere); passes likewise
            scale = len(plain.token_ids) / max(1, len(out.token_ids))
            res[name] = out.timings.decode_ms / 1000 * scale
            passes[name] = (len(out.token_ids) - st["accepted"]) * scale
        rows.append({"id": item["id"], "category": item["category"], "tokens": len(plain.token_ids),
                     "plain_s": plain.timings.decode_ms / 1000, "s": res, "target_passes": passes})
        for cat in (item["category"], "ALL"):
            s = sums[cat]
            s["tokens"] += len(plain.token_ids)
            s["plain"] += plain.timings.decode_ms / 1000
            for name in "AB":
                s[name] += res[name]
                s["passes " + name] += passes[name]
        p = plain.timings.decode_ms / 1000
        print(f"{item['id']:<32} A {p / res['A']:5.2f}x  B {p / res['B']:5.2f}x", flush=True)
    print(f"\nA: {a.draft} {a.a or 'defaults'}    B: {a.b_draft or a.draft} {a.b or 'defaults'}    "
          f"({time.perf_counter() - t0:.0f} s)")
    print(f"{'category':<14} {'plain tok/s':>12} {'A speedup':>10} {'B speedup':>10} {'passes A':>9} {'passes B':>9}")
    for cat in sorted(sums, key=lambda c: c == "ALL"):
        s = sums[cat]
        print(f"{cat:<14} {s['tokens'] / s['plain']:>12.2f} {s['plain'] / s['A']:>9.2f}x {s['plain'] / s['B']:>9.2f}x "
              f"{s['passes A']:>9.0f} {s['passes B']:>9.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "draft": a.draft, "b_draft": a.b_draft, "a": a.a, "b": a.b, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
