"""Two settings of the draft gate (jllm.spec.policy.DraftGate) against each other on the corpus, interleaved
prompt by prompt in one process (A B, then B A on the next prompt), so that the host's memory phases fall on
both alike. Prints per category the speculative tok/s of each and B's ratio to A, with plain decoding of the
same prompts beside them, and checks that both outputs equal plain greedy decoding.

    python benchmarks/gate_ab.py -md qwen2.5-coder-1.5b-eagle3 --a off_below=0.95 --b off_below=0.85
"""

from __future__ import annotations

import argparse
import functools
import json
from collections import defaultdict

import jllm.engine
from jllm.catalog import resolve
from jllm.engine import Engine
from jllm.sampling import SamplingParams
from jllm.spec.bench import _run
from jllm.spec.config import SpecConfig
from jllm.spec.corpus import load_corpus
from jllm.spec.policy import DraftGate


def settings(text: str) -> dict:
    """'off_below=0.85,row_cost=0.05' -> {'off_below': 0.85, 'row_cost': 0.05} (DraftGate's arguments)."""
    out = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        out[key.strip()] = float(value)
    DraftGate(**out)                                     # an unknown name fails here, before any model loads
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--draft", default="qwen2.5-coder-1.5b-eagle3")
    ap.add_argument("--a", default="", help="DraftGate arguments of A (default: its defaults)")
    ap.add_argument("--b", required=True, help="DraftGate arguments of B, e.g. off_below=0.85")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    gates = {"A": settings(a.a), "B": settings(a.b)}
    cfg = SpecConfig()
    eng = Engine(str(resolve(a.model)), draft_path=str(resolve(a.draft)), spec=cfg)
    params = SamplingParams(max_tokens=a.n)
    items = load_corpus()[:a.limit] if a.limit else load_corpus()
    rows = []
    for i, item in enumerate(items):
        ids = eng.chat_ids(item["messages"])
        plain, _ = _run(eng, ids, params, None)
        row = {"id": item["id"], "category": item["category"], "tokens": len(plain.token_ids),
               "plain_s": plain.timings.decode_ms / 1000}
        for name in ("AB" if i % 2 == 0 else "BA"):
            jllm.engine.DraftGate = functools.partial(DraftGate, **gates[name])
            res, st = _run(eng, ids, params, cfg)
            row[name] = {"s": res.timings.decode_ms / 1000, "tokens": len(res.token_ids),
                         "identical": res.token_ids == plain.token_ids, "rounds": st["rounds"],
                         "accepted": st["accepted"]}
        jllm.engine.DraftGate = DraftGate
        rows.append(row)
        print(f"{item['id']:<30} plain {row['tokens'] / row['plain_s']:6.2f}  A {row['A']['tokens'] / row['A']['s']:6.2f}"
              f"  B {row['B']['tokens'] / row['B']['s']:6.2f} tok/s", flush=True)
    cats = defaultdict(list)
    for r in rows:
        cats[r["category"]].append(r)
        cats["ALL"].append(r)
    print(f"\nA: {gates['A'] or 'defaults'}   B: {gates['B']}")
    print(f"{'category':<12} {'plain':>7} {'A':>7} {'B':>7} {'A/plain':>8} {'B/plain':>8} {'B/A':>6}  identical A, B")
    for c, rs in cats.items():
        tok = sum(r["tokens"] for r in rs)
        p, ta, tb = (tok / sum(r["plain_s"] for r in rs), sum(r["A"]["tokens"] for r in rs) / sum(r["A"]["s"] for r in rs),
                     sum(r["B"]["tokens"] for r in rs) / sum(r["B"]["s"] for r in rs))
        ia, ib = sum(r["A"]["identical"] for r in rs), sum(r["B"]["identical"] for r in rs)
        print(f"{c:<12} {p:7.2f} {ta:7.2f} {tb:7.2f} {ta / p:7.2f}x {tb / p:7.2f}x {tb / ta:6.3f}  {ia}/{len(rs)}, {ib}/{len(rs)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "draft": a.draft, "gates": gates, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
