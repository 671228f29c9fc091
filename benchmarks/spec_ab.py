"""Paired comparison of two speculative configurations on the corpus: every prompt is decoded plain, with
configuration A and with configuration B, back to back in one process (A and B swap order from prompt to
prompt), so the host's minute-to-minute speed swings fall on all three alike. Separate `jllm bench --spec`
runs differ by ±0.05x from that noise alone.

    python benchmarks/spec_ab.py --a p_min=0.7 --b p_min=0.6 [--limit N]

Keys are SpecConfig fields; values are parsed as int, float or str.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from dataclasses import replace

from jllm.engine import Engine
from jllm.sampling import SamplingParams
from jllm.spec.bench import _run
from jllm.spec.corpus import load_corpus
from jllm.spec.config import SpecConfig
from jllm.catalog import resolve


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--a", default="", help="configuration A: SpecConfig overrides, key=value,...")
    ap.add_argument("--b", default="", help="configuration B")
    ap.add_argument("--limit", type=int, default=None)
    a = ap.parse_args()
    base = SpecConfig()
    cfgs = {"A": replace(base, **_config(a.a)), "B": replace(base, **_config(a.b))}
    eng = Engine(str(resolve(a.model)), draft_path=str(resolve(a.draft)), spec=base)
    params = SamplingParams(max_tokens=a.n)
    sums = defaultdict(lambda: defaultdict(float))         # category -> plain/A/B -> seconds; tokens
    t0 = time.perf_counter()
    for i, item in enumerate(load_corpus()[:a.limit] if a.limit else load_corpus()):
        ids = eng.chat_ids(item["messages"])
        plain, _ = _run(eng, ids, params, None)
        res = {}
        for name in ("AB" if i % 2 == 0 else "BA"):
            out, _ = _run(eng, ids, params, cfgs[name])
            assert out.token_ids == plain.token_ids, f"{item['id']}: configuration {name} changed the output"
            res[name] = out.timings.decode_ms / 1000
        for cat in (item["category"], "ALL"):
            s = sums[cat]
            s["tokens"] += len(plain.token_ids)
            s["plain"] += plain.timings.decode_ms / 1000
            s["A"] += res["A"]
            s["B"] += res["B"]
        p = plain.timings.decode_ms / 1000
        print(f"{item['id']:<32} A {p / res['A']:5.2f}x  B {p / res['B']:5.2f}x", flush=True)
    print(f"\nA: {a.a or 'defaults'}    B: {a.b or 'defaults'}    ({time.perf_counter() - t0:.0f} s)")
    print(f"{'category':<14} {'plain tok/s':>12} {'A speedup':>10} {'B speedup':>10}")
    for cat in sorted(sums, key=lambda c: c == "ALL"):
        s = sums[cat]
        print(f"{cat:<14} {s['tokens'] / s['plain']:>12.2f} {s['plain'] / s['A']:>9.2f}x {s['plain'] / s['B']:>9.2f}x")


if __name__ == "__main__":
    main()
