"""What speculative decoding can reach on the corpus, before building it: record, once, the target's greedy
output and the draft's prediction at every position of it; then replay drafting policies over those traces
with a cost model (draft step d, verify pass V(k), in units of one target decode step).

Replaying is exact for greedy decoding: the draft always drafts from an accepted prefix, which is the
target's own output, so "the draft's token at position i given the target's prefix" is all a policy sees.

    python benchmarks/spec_sim.py trace [--out F]        # ~5 min: target output + draft predictions
    python benchmarks/spec_sim.py costs                   # measured d and V(k) on this machine
    python benchmarks/spec_sim.py sim [--traces F]        # policies x costs -> predicted speedup
    python benchmarks/spec_sim.py bound [--d ...] [--V ...]  # how well the draft's confidence predicts
                                                          # acceptance, and what foresight would reach
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from jllm.spec import DRAFT_VOCAB
from jllm.spec.config import SpecConfig
from jllm.spec.ngram import find_ngram
from jllm.spec.policy import DraftGate, draft_goes_on, leaf_position, next_length, ngram_keep

V_MEASURED = [1, 1.09, 1.15, 1.25, 1.45, 1.6, 1.75, 1.9, 2.05]   # V(0..8), from `costs` (slow memory phase)
RESULTS = Path(__file__).with_name("results")
TRACES = RESULTS / "spec_traces.json"


def trace(a) -> None:
    from jllm.engine import Engine
    from jllm.sampling import SamplingParams
    from jllm.spec.corpus import load_corpus
    from jllm.catalog import resolve

    eng = Engine(str(resolve(a.model)), draft_path=str(resolve(a.draft)), spec=SpecConfig())
    if eng.head is not None:
        return trace_head(a, eng)
    draft = eng.draft.model
    rows = []
    for item in load_corpus():
        ids = eng.chat_ids(item["messages"])
        eng.reset()
        out = eng.generate(ids, SamplingParams(max_tokens=a.n)).token_ids
        cache = draft.new_cache(len(ids) + len(out) + 8)
        with torch.inference_mode():
            logits = draft.forward(torch.tensor(ids + out[:-1]), cache)[len(ids) - 1:]   # predicts out[i]
            p = torch.softmax(logits.float(), -1)
            top2 = p.topk(2, -1)
        rows.append({"id": item["id"], "category": item["category"], "prompt": ids, "out": out,
                     "draft": top2.indices[:, 0].tolist(), "draft_p": [round(x, 4) for x in top2.values[:, 0].tolist()],
                     "draft2": top2.indices[:, 1].tolist(), "draft2_p": [round(x, 4) for x in top2.values[:, 1].tolist()]})
        hit = sum(x == y for x, y in zip(rows[-1]["draft"], out)) / len(out)
        print(f"{item['id']:<28} {len(out):>4} tokens, draft top-1 agrees {hit:.2f}", flush=True)
    Path(a.out).write_text(json.dumps({"model": a.model, "draft": a.draft, "rows": rows}))


def trace_head(a, eng, depth: int = 8) -> None:
    """An EAGLE-3 head's trace. A head's prediction depends on where its chain began (the first draft reads
    the target's states, later ones its own), so for each start i of the target's output it records the
    chain the head drafts from the accepted context prompt + out[:i]: `head[i]` = [token, its probability,
    the second choice] for depths 0 .. depth - 1 (predicting out[i + j]). Replay reads a depth only when the
    drafts before it were the target's own tokens, so feeding the head its own tokens is exact."""
    from jllm.sampling import SamplingParams
    from jllm.spec.corpus import load_corpus

    prop, head = eng.draft_proposer, eng.head
    greedy = SamplingParams()
    rows = []
    for item in load_corpus():
        ids = eng.chat_ids(item["messages"])
        eng.reset()
        out = eng.generate(ids, SamplingParams(max_tokens=a.n)).token_ids
        eng.reset()
        with torch.inference_mode():
            eng.target.sync(ids + out)                     # the target's states over the whole text
            chains = [None]
            for i in range(1, len(out)):
                ctx = ids + out[:i]
                first = prop.catch_up(ctx)
                rows_before, logits, state, chain = head.length, first.logits, first.state, []
                for j in range(min(depth, len(out) - i)):
                    tok, p, _ = prop.choose(logits, greedy, None, ctx + [c[0] for c in chain])
                    chain.append([tok, round(float(p), 4), prop.choose.second(logits, tok)])
                    if j + 1 < min(depth, len(out) - i):
                        s = head.step(tok, state)
                        logits, state = s.logits, s.state
                head.truncate(rows_before)
                chains.append(chain)
        rows.append({"id": item["id"], "category": item["category"], "prompt": ids, "out": out, "head": chains})
        hit = sum(c[0][0] == out[i] for i, c in enumerate(chains) if c) / max(1, len(out) - 1)
        print(f"{item['id']:<28} {len(out):>4} tokens, head top-1 agrees {hit:.2f}", flush=True)
    Path(a.out).write_text(json.dumps({"model": a.model, "draft": a.draft, "head": True, "rows": rows}))


def costs(a) -> None:
    """Target step, target verify pass over k + 1 tokens and draft step, after a context of --ctx tokens:
    k in random order per round, two draft steps before each target pass (as in decoding); medians."""
    import random

    from jllm.model.loader import load_model
    from jllm.catalog import resolve

    tgt = load_model(resolve(a.model), "cpu", None)
    dr = load_model(resolve(a.draft), "cpu", "native4", output_rows=DRAFT_VOCAB)
    tc, dc = tgt.new_cache(a.ctx + 16), dr.new_cache(a.ctx + 16)
    ids = torch.randint(0, 1000, (a.ctx,))
    tgt.forward(ids, tc), dr.forward(ids, dc)
    times, dtimes = {k: [] for k in range(9)}, []
    for _ in range(a.repeat):
        ks = list(times)
        random.shuffle(ks)
        for k in ks:
            for _ in range(2):
                t = time.perf_counter()
                dr.forward(ids[:1], dc)
                dtimes.append(time.perf_counter() - t)
            dc.truncate(a.ctx)
            t = time.perf_counter()
            tgt.forward(ids[:k + 1], tc)
            times[k].append(time.perf_counter() - t)
            tc.truncate(a.ctx)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    step = med(times[0])
    print(f"context {a.ctx}: target step {step * 1000:.1f} ms, draft step {med(dtimes) * 1000:.1f} ms "
          f"(d = {med(dtimes) / step:.3f})")
    print("V(k):", " ".join(f"{k}:{med(times[k]) / step:.2f}" for k in times))


# ---------------------------------------------------------------- replay

def ngram_lookup(ctx: list[int], k: int, max_n: int = 4) -> tuple[list[int], int]:
    return find_ngram(ctx, k, max_n, 1)


# The engine's own policy with its defaults (SpecConfig): what `jllm` runs, replayed.
JLLM = {"kmax": SpecConfig.draft_max, "p_min": SpecConfig.p_min, "grow": 2, "rate": "gate", "ngram_cost": True,
        "leaf_p": SpecConfig.leaf_p, "leaf_gate": True}


def replay(row: dict, policy: dict, d: float, V, gate=None) -> tuple[float, int, int, int]:
    """-> (cost in target steps, tokens emitted, drafted, accepted) for one prompt.

    The rules are jllm.spec.policy's own functions (draft_goes_on, ngram_keep, next_length, leaf_position and
    the DraftGate), so a replay of JLLM is the engine's policy; the other keys try alternatives:
    kmax (kmax_ngram: the n-gram proposer's, default kmax); p_min with rule "before" (jllm's: decided before
    each draft step) or "after" (run the step, then drop its token if its own probability is < p_min: that
    step is paid for and wasted); ngram (default on); wrong (every draft token wrong); grow (a draft round
    proposes at most 2 past what the previous one got accepted: next_length); rate: "gate" (the gate's
    extend_pays), a number r (one more token while chain >= r * its cost by the V table), or absent (p_min
    alone); ngram_cost (n-gram proposals cut by ngram_keep); leaf_p (side leaves at leaf_position),
    leaf_gate (only while DraftGate.leaf_pays). gate: a DraftGate deciding draft or plain rounds, as jllm
    runs it; a draft back from plain rounds catches up at ~8 % of a step per extra token (one batched pass)."""
    out, at = row["out"], _chain_at(row)
    ctx = list(row["prompt"]) + [out[0]]       # out[0] comes from the prefill
    i, n_out = 1, len(out)
    cost, drafted, accepted = 0.0, 0, 0
    kmax, rule = policy["kmax"], policy.get("rule", "before")
    kn_max = policy.get("kmax_ngram", kmax)     # the n-gram proposer's own cap (default: the same)
    kn = kn_max
    synced = i                                  # the draft has seen the text up to here
    ng = [0, 0]                                 # n-gram tokens accepted, n-gram rounds cut short
    cap = kmax                                  # policy "grow": a draft round may go at most this far
    extend = _extend_rule(policy, gate, d, V)
    while i < n_out:
        room = n_out - i - 1
        drafts, kind, steps = [], None, 0
        if policy.get("ngram", True) and room > 0:
            prop, m = ngram_lookup(ctx, min(kn, room))
            if prop and m >= policy.get("ngram_min", 3):
                drafts, kind = prop, "ngram"
                if policy.get("ngram_cost"):
                    pays = (lambda k, c: gate.extend_pays(k, c, free=True)) if gate is not None \
                        else (lambda k, c: c >= V(k) - V(k - 1))
                    drafts = drafts[:ngram_keep(len(drafts), ng[0], ng[1], pays)]
        if kind is None and room > 0 and (gate is None or gate.choose() == "draft"):
            kind, chain, steps = "draft", 1.0, 1          # the first step is the draft's catch-up pass
            cost += d * max(0, i - synced - 1) * 0.08
            k = min(kmax, room, cap)
            while True:
                tok, p, _ = at(i, len(drafts))  # after a wrong token the real draft's confidence is unknown: this stands in
                if rule == "after" and drafts and p < policy["p_min"]:
                    break
                drafts.append(-1 if policy.get("wrong") else tok)
                chain *= p
                goes_on = len(drafts) < k if rule == "after" else \
                    draft_goes_on(len(drafts), k, 1, chain, policy["p_min"], extend)
                if not goes_on:
                    break
                steps += 1
            cost += d * steps
        n = 0
        while n < len(drafts) and drafts[n] == out[i + n]:
            n += 1
        leaf = None
        if kind == "draft" and policy.get("leaf_p") and not policy.get("wrong") and \
                (not policy.get("leaf_gate") or gate is None or gate.leaf_pays()):
            leaf = leaf_position([at(i, j)[1] for j in range(len(drafts))], policy["leaf_p"])
        taken = leaf is not None and n == leaf and i + n + 1 < n_out and at(i, n)[2] == out[i + n]
        rows_k = len(drafts) + (leaf is not None)
        cost += V(rows_k)
        if gate is not None:
            gate.observe(V(rows_k) / V(0), rows_k, d if kind == "draft" else None)
            if kind == "draft":
                gate.record(n + taken + 1, steps, rows_k)
            if leaf is not None:
                gate.observe_leaf(taken)
        if kind == "draft":
            synced = i + n + 1
            if policy.get("grow"):
                cap = next_length("draft", cap, len(drafts), n + taken, 1, kmax)
        drafted += len(drafts)
        accepted += n
        if kind == "ngram":
            kn = next_length("ngram", kn, len(drafts), n, 1, kn_max)
            ng[0] += n
            ng[1] += n < len(drafts)
        n += taken
        ctx.extend(out[i:i + n + 1])
        i += n + 1
    return cost, n_out - 1, drafted, accepted


def _chain_at(row: dict):
    """at(i, j) -> (token, probability, second choice) of the j-th draft of a chain begun after out[:i]: a
    head's recorded chain (trace_head), or a draft model's predictions along the target's output."""
    if "head" in row:
        hd = row["head"]
        return lambda i, j: hd[i][j] if j < len(hd[i]) else (-1, 0.0, -1)
    dr, dp, d2 = row["draft"], row["draft_p"], row["draft2"]
    return lambda i, j: (dr[i + j], dp[i + j], d2[i + j])


def _extend_rule(policy: dict, gate, d: float, V):
    """The draft's `extend` for draft_goes_on: the gate's extend_pays, a fixed rate by the V table, or None."""
    rate = policy.get("rate")
    if rate is None:
        return None
    if rate == "gate":
        return gate.extend_pays if gate is not None else None
    return lambda n, chain: chain >= rate * (d + V(n) - V(n - 1))


def sim(a) -> None:
    data = json.loads(Path(a.traces).read_text())
    rows = data["rows"]
    Vtab, V = _verify_costs(a)
    cats = sorted({r["category"] for r in rows})
    print(f"V(k) = {Vtab}")
    for d in [float(x) for x in a.d.split(",")]:
        _line(f"d={d:.2f} JLLM (the engine's policy, defaults)", rows, cats, JLLM, d, V, True)
        _line(f"d={d:.2f} JLLM, WRONG draft", rows, cats, dict(JLLM, wrong=True), d, V, True)
        for rule in ("after", "before"):
            for pmin in (0.5, 0.6, 0.7, 0.8, 0.9):
                for kmax in (4, 8):
                    _line(f"d={d:.2f} {rule:<6} p_min={pmin:.1f} kmax={kmax}", rows, cats,
                          {"kmax": kmax, "p_min": pmin, "rule": rule}, d, V)
        for leaf_p in (0.5, 0.7, 0.9):        # jllm's policy with side leaves (gate in the loop)
            _line(f"d={d:.2f} jllm gate   leaf_p={leaf_p}", rows, cats,
                  {"kmax": 8, "p_min": 0.7, "grow": 2, "leaf_p": leaf_p}, d, V, True)
        _line(f"d={d:.2f} cost rate=gate p_min=0.7 ngram_cost", rows, cats,
              {"kmax": 8, "p_min": 0.7, "grow": 2, "rate": "gate", "ngram_cost": True}, d, V, True)
        for rate in (1.0, 1.3, "gate"):
            for pmin in (0.5, 0.7):
                _line(f"d={d:.2f} cost rate={rate} p_min={pmin}", rows, cats,
                      {"kmax": 8, "p_min": pmin, "grow": 2, "rate": rate}, d, V, True)
        for wrong in (False, True):           # jllm's policy with its gate in the loop, and without
            for gated in (False, True):
                _line(f"d={d:.2f} jllm {'gate  ' if gated else 'always'} {'WRONG draft' if wrong else ''}", rows,
                      cats, {"kmax": 8, "p_min": 0.7, "grow": 2, "wrong": wrong}, d, V, gated)


def _verify_costs(a):
    """-> (V(0..8) table, V as a function of k clamped to the table): --V or the measured one."""
    Vtab = [float(x) for x in a.V.split(",")] if a.V else V_MEASURED
    return Vtab, lambda k: Vtab[min(k, len(Vtab) - 1)]


def _line(label, rows, cats, pol, d, V, gated=False) -> None:
    res = {c: [0.0, 0, 0, 0] for c in cats + ["ALL"]}
    for r in rows:
        c, t, dd, acc = replay(r, pol, d, V, DraftGate() if gated else None)
        for key in (r["category"], "ALL"):
            res[key][0] += c; res[key][1] += t; res[key][2] += dd; res[key][3] += acc
    s = " ".join(f"{c[:5]}:{v[1] / v[0]:.2f}" for c, v in res.items())
    print(f"{label}  {s}  alpha={res['ALL'][3] / max(res['ALL'][2], 1):.2f}")


def variant(a) -> None:
    """Draft variants against the recorded traces: how often the draft's top-1 equals the target's token,
    and the replayed speedup with the draft step's cost scaled by the share of its bytes it reads."""
    from jllm.model.loader import load_model
    from jllm.catalog import resolve

    data = json.loads(Path(a.traces).read_text())
    draft = load_model(resolve(a.draft), "cpu", "native4", output_rows=DRAFT_VOCAB)
    layers = list(draft.w.layers)
    per_layer = sum(l.nbytes() for l in (layers[0].qkv, layers[0].o, layers[0].gate_up, layers[0].down))
    total = per_layer * len(layers) + draft.w.output.nbytes()
    _, V = _verify_costs(a)
    draft.stack = None                 # the Python layer loop, so the dropped layers and Sparse.glu take effect
    kernels = draft.kernels
    mlp = sum(l.gate_up.nbytes() + l.down.nbytes() for l in layers)

    class Sparse:                      # the MLP keeps only the `keep` share of channels with the largest |act(gate)|
        keep = 1.0

        def __getattr__(self, name):
            return getattr(kernels, name)

        def glu(self, gu, gelu):
            f = gu.shape[1] // 2
            g = torch.nn.functional.silu(gu[:, :f])
            n = max(1, int(self.keep * f))
            idx = g.abs().topk(n, -1).indices
            h = torch.zeros_like(g)
            h.scatter_(1, idx, g.gather(1, idx) * gu[:, f:].gather(1, idx))
            return h

    draft.kernels = Sparse()
    variants = [("drop", s) for s in a.skips.split(";") if s] + [("keep", k) for k in a.keeps.split(",")]
    for kind, arg in variants:
        drop = {int(x) for x in arg.split(",")} if kind == "drop" else set()
        Sparse.keep = float(arg) if kind == "keep" else 1.0
        draft.w.layers = [l for i, l in enumerate(layers) if i not in drop]
        share = (per_layer * len(draft.w.layers) + draft.w.output.nbytes()) / total
        share -= mlp / total * 2 / 3 * (1 - Sparse.keep)      # gate read whole, up rows and down columns by keep
        hits = n = 0
        rows = []
        for r in data["rows"]:
            ids, out = r["prompt"], r["out"]
            cache = draft.new_cache(len(ids) + len(out) + 8)
            with torch.inference_mode():
                p = torch.softmax(draft.forward(torch.tensor(ids + out[:-1]), cache)[len(ids) - 1:].float(), -1)
                top = p.max(-1)
            v = dict(r, draft=top.indices.tolist(), draft_p=top.values.tolist())
            rows.append(v)
            hits += sum(x == y for x, y in zip(v["draft"], out))
            n += len(out)
        res = []
        for pmin in (0.6, 0.7):
            c = t = 0.0
            for v in rows:
                cc, tt, _, _ = replay(v, {"kmax": 8, "p_min": pmin}, a.d0 * share, V)
                c += cc
                t += tt
            res.append(f"p_min {pmin}: {t / c:.3f}x")
        print(f"{kind} {arg}: bytes {share:.2f}, agree {hits / n:.3f}, " + ", ".join(res), flush=True)


def bound(a) -> None:
    """What a policy can learn from the draft's confidence, and what it leaves. First the calibration: over
    the traces, how often the draft's top-1 is the target's token by the draft's own probability for it
    (and by whether a one-token n-gram lookup agrees with it). Then an upper bound no policy reaches: each
    round chosen with foresight of how far the draft's chain and the n-gram's copy will hold (plain step,
    draft of exactly that length, or n-gram of exactly that length, whichever brings most tokens per cost).
    With calibrated probabilities, the gap between that bound and `sim` is what cannot be known in advance."""
    data = json.loads(Path(a.traces).read_text())
    rows = data["rows"]
    Vtab, V = _verify_costs(a)
    bins = {}
    for r in rows:
        out, at = r["out"], _chain_at(r)
        for i in range(1, len(out)):
            g, _ = ngram_lookup(r["prompt"] + out[:i], 1)
            tok, p, _ = at(i, 0)
            key = ("agree" if g and g[0] == tok else "differ" if g else "none", min(9, int(p * 10)))
            hits = bins.setdefault(key, [0, 0])
            hits[0] += 1
            hits[1] += tok == out[i]
    print("the draft's top-1 probability p -> share of its tokens the target agrees with (positions)")
    for lookup in ("all", "agree", "differ", "none"):
        cells = []
        for b in range(10):
            n = sum(v[0] for (g, bb), v in bins.items() if bb == b and lookup in ("all", g))
            h = sum(v[1] for (g, bb), v in bins.items() if bb == b and lookup in ("all", g))
            if n:
                cells.append(f"{b / 10:.1f}:{h / n:.2f}({n})")
        print(f"  n-gram {lookup:<6} " + " ".join(cells))
    print(f"V(k) = {Vtab}")
    for d in [float(x) for x in a.d.split(",")]:
        tokens = cost = 0.0
        for r in rows:
            out, at = r["out"], _chain_at(r)
            i = 1
            while i < len(out):
                chain = 0
                while i + chain < len(out) and chain < 8 and at(i, chain)[0] == out[i + chain]:
                    chain += 1
                g, _ = ngram_lookup(r["prompt"] + out[:i], 8)
                copy = 0
                while copy < len(g) and i + copy < len(out) and g[copy] == out[i + copy]:
                    copy += 1
                options = [(1, 1.0)] + [(k + 1, V(k) + k * d) for k in range(1, chain + 1)] \
                    + [(k + 1, V(k)) for k in range(1, copy + 1)]
                t, c = max(options, key=lambda o: o[0] / o[1])
                i += t
                tokens += t
                cost += c
        print(f"d={d:.2f} foresight bound {tokens / cost:.3f}x")
    if a.head:
        vocab_share(rows, a.head)


def vocab_share(rows, head_path: str) -> None:
    """The share of the target's output tokens outside a head's draft vocabulary (d2t), per category: tokens
    the head can never draft, however it is trained."""
    from jllm.catalog import resolve
    from jllm.eagle3.format import read_d2t
    from jllm.gguf.reader import read_gguf

    d2t = read_d2t(read_gguf(str(resolve(head_path))))
    if d2t is None:
        print(f"{head_path}: scores the whole vocabulary")
        return
    vocab = set(d2t.tolist())
    cats: dict[str, list[int]] = {}
    for r in rows:
        c = cats.setdefault(r["category"], [0, 0])
        c[0] += len(r["out"])
        c[1] += sum(t not in vocab for t in r["out"])
    n, m = sum(c[0] for c in cats.values()), sum(c[1] for c in cats.values())
    print(f"output tokens outside the draft vocabulary of {len(vocab)}: " + " ".join(
        f"{k[:5]}:{c[1] / c[0]:.3f}" for k, c in sorted(cats.items())) + f" ALL:{m / n:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("trace", "costs", "sim", "variant", "bound"):
        p = sub.add_parser(name)
        p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
        p.add_argument("-md", "--draft", default="qwen2.5-coder-0.5b")
        p.add_argument("-n", type=int, default=128)
        p.add_argument("--out", default=str(TRACES))
        p.add_argument("--traces", default=str(TRACES))
        p.add_argument("--repeat", type=int, default=12)
        p.add_argument("--ctx", type=int, default=300, help="costs: context length before the measured passes")
        p.add_argument("--d", default="0.25,0.2")
        p.add_argument("--V", default=None)
        p.add_argument("--d0", type=float, default=0.27, help="variant: the unchanged draft's step cost")
        p.add_argument("--skips", default="", help="variant: ;-separated lists of draft layers to drop")
        p.add_argument("--keeps", default="1,0.5,0.4,0.3,0.2", help="variant: shares of MLP channels kept")
        p.add_argument("--head", default=None, help="bound: also the share of output tokens outside this "
                       "head's draft vocabulary")
    a = ap.parse_args()
    {"trace": trace, "costs": costs, "sim": sim, "variant": variant, "bound": bound}[a.cmd](a)


if __name__ == "__main__":
    main()
