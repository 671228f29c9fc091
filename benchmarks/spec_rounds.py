"""What a speculative round costs inside the engine's own loop, and whether the trace replay
(spec_sim.py) predicts the measured speedup from those costs.

Each chosen corpus prompt is decoded plain and then speculatively (greedy, as `jllm bench --spec`), while
every target and draft forward pass is timed by its width (a side leaf counts as a row). Each pass is counted in plain steps of its own
prompt (the median of that prompt's plain one-token steps, measured seconds before), so a change of the
host's memory phase between prompts moves both sides. Printed: the verify pass over k drafts, the draft's
one- and two-token steps, the measured plain/speculative ratio, and the replay of the engine's policy over
the recorded traces of the same prompts with these measured costs.

    python benchmarks/spec_rounds.py [--per-category 2] [--categories coding,math]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from spec_sim import TRACES, replay  # noqa: E402

from jllm.engine import Engine  # noqa: E402
from jllm.sampling import SamplingParams  # noqa: E402
from jllm.spec.bench import _run  # noqa: E402
from jllm.spec.corpus import load_corpus  # noqa: E402
from jllm.spec.config import SpecConfig  # noqa: E402
from jllm.spec.policy import DraftGate  # noqa: E402
from jllm.catalog import resolve  # noqa: E402


def timed(model, log: list, tag: str) -> None:
    """Record (tag, tokens, seconds) for every forward pass of `model`."""
    inner = model.forward

    def forward(ids, cache, *a, **k):
        t = time.perf_counter()
        out = inner(ids, cache, *a, **k)
        log.append((tag, len(ids), time.perf_counter() - t))
        return out

    model.forward = forward


def pct(xs: list[float], f: float) -> float:
    return sorted(xs)[int(f * (len(xs) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--categories", default="", help="comma-separated (default: all)")
    ap.add_argument("-n", type=int, default=128)
    a = ap.parse_args()
    eng = Engine(str(resolve(a.model)), draft_path=str(resolve(a.draft)), spec=SpecConfig())
    log: list = []
    timed(eng.model, log, "target")
    timed(eng.draft.model, log, "draft")
    items = load_corpus()
    cats = a.categories.split(",") if a.categories else sorted({i["category"] for i in items})
    chosen = [i for c in cats for i in [x for x in items if x["category"] == c][:a.per_category]]
    params = SamplingParams(max_tokens=a.n)
    plain_steps, verify, draft = [], defaultdict(list), defaultdict(list)     # in steps of the prompt
    plain_s = spec_s = 0.0
    for item in chosen:
        ids = eng.chat_ids(item["messages"])
        log.clear()
        res, _ = _run(eng, ids, params, None)
        plain_s += res.timings.decode_ms / 1000
        steps = [t for tag, n, t in log if tag == "target" and n == 1][1:]     # the first is the prefill's
        plain_steps += steps
        step = statistics.median(steps)
        log.clear()
        res, _ = _run(eng, ids, params, SpecConfig())
        spec_s += res.timings.decode_ms / 1000
        decode = log[next(j for j, x in enumerate(log) if x[0] == "target") + 1:]   # after the target's prefill
        for tag, n, t in decode:
            (verify if tag == "target" else draft)[n].append(t / step)
        print(f"{item['id']:<28} done", flush=True)
    print(f"\nplain one-token step: median {statistics.median(plain_steps) * 1e3:.2f} ms, p10 "
          f"{pct(plain_steps, .1) * 1e3:.2f}, p90 {pct(plain_steps, .9) * 1e3:.2f} ({len(plain_steps)} steps)")
    print(f"{'pass, in steps':<16} {'n':>5} {'median':>7} {'mean':>6} {'p90':>6}")
    V = []
    for k in range(9):
        ts = verify.get(k + 1, [])
        V.append(statistics.median(ts) if ts else (V[-1] if V else 1.0))
        if ts:
            print(f"verify k = {k:<5} {len(ts):>5} {V[-1]:>7.3f} {statistics.mean(ts):>6.3f} {pct(ts, .9):>6.3f}")
    for n in (1, 2):
        ts = draft.get(n, [])
        if len(ts) > 2:
            print(f"draft {n} token{'s' if n > 1 else ' '}  {len(ts):>5} {statistics.median(ts):>7.3f} "
                  f"{statistics.mean(ts):>6.3f} {pct(ts, .9):>6.3f}")
    d = statistics.median(draft[1])
    rows = [r for r in json.loads(Path(TRACES).read_text())["rows"] if r["id"] in {i["id"] for i in chosen}]
    cfg = SpecConfig()                 # the engine's defaults, side leaves included
    policy = {"kmax": cfg.draft_max, "p_min": cfg.p_min, "grow": 2, "leaf_p": cfg.leaf_p}
    cost = tokens = 0.0
    for r in rows:
        c, t, _, _ = replay(r, policy, d, lambda k: V[min(k, 8)], DraftGate())
        cost, tokens = cost + c, tokens + t
    print(f"\nmeasured plain / speculative decode time: {plain_s / spec_s:.3f}x ({plain_s:.1f} s / {spec_s:.1f} s)")
    print(f"replay of the same prompts' traces with these costs (d = {d:.3f}): {tokens / cost:.3f}x")


if __name__ == "__main__":
    main()
