"""`jllm bench --spec`: the corpus (corpus.json) run with and without speculation, same engine, same prompts,
fixed max tokens; per category plain tok/s, speculative tok/s, speedup, acceptance, identical output.

Greedy by default, where speculation must give the plain run's output token for token. With --temp > 0 both
runs sample (seeded, the same seed per prompt): speculative sampling draws its random numbers otherwise than
plain sampling, so the outputs differ while following the same distribution (tests/test_spec_decode.py and
tests/test_head_proposer.py check that by chi-squared tests); each run's tok/s counts its own tokens, and the
identical column is left out.

Each prompt is decoded plain first and then speculatively, from a cold cache both times. The draft model's
prompt prefill is prompt time (Engine.stream runs it before the first token, as the target's own prefill),
so it is in neither decode time; every draft step after it, including catching up on tokens the draft did
not propose, is speculative decode time.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict

import torch

from jllm.catalog import resolve
from jllm.engine import Engine
from jllm.errors import JllmError
from jllm.sampling import SamplingParams
from jllm.spec.config import SpecConfig, check_tree
from jllm.spec.corpus import load_corpus


def _run(eng, ids, params, spec):
    """One prompt on its own: cold caches, no gate state from the previous prompt."""
    eng.spec = spec
    eng.reset()
    res = eng.generate(ids, params)
    return res, (res.spec_stats.as_dict() if spec is not None else None)


def run_corpus(eng, spec_cfg, limit: int | None = None, log=print, params: SamplingParams | None = None) -> dict:
    """params: how both runs choose tokens and how many (greedy, 128, unless given)."""
    params = params or SamplingParams(max_tokens=128)
    items = load_corpus()[:limit] if limit else load_corpus()
    if eng.device.type == "cuda":       # the GPU captures a CUDA graph per pass shape on first use: not timed
        warm = eng.chat_ids([{"role": "user", "content": "Write a short Python function that adds two numbers."}])
        for cfg in (None, spec_cfg):
            _run(eng, warm, params, cfg)
    rows = []
    for item in items:
        ids = eng.chat_ids(item["messages"])
        plain, _ = _run(eng, ids, params, None)
        spec, st = _run(eng, ids, params, spec_cfg)
        row = {
            "id": item["id"], "category": item["category"], "prompt_tokens": len(ids),
            "tokens": len(plain.token_ids), "identical": plain.token_ids == spec.token_ids,
            "plain_s": plain.timings.decode_ms / 1000, "spec_s": spec.timings.decode_ms / 1000,
            "spec_tokens": len(spec.token_ids), "drafted": st["drafted"], "accepted": st["accepted"],
            "rounds": st["rounds"], "by_proposer": st["by_proposer"],
            "leaves": st["leaves"], "leaves_taken": st["leaves_taken"],
            "draft_s": st["draft_ms"] / 1000, "verify_s": st["verify_ms"] / 1000,
        }
        rows.append(row)
        same = ("identical" if row["identical"] else "DIFFERENT") if params.greedy else \
            f"{row['spec_tokens']:>4} tok sampled"
        log(f"{item['id']:<28} {row['tokens']:>4} tok  plain {row['tokens'] / row['plain_s']:6.2f} tok/s  "
            f"spec {row['spec_tokens'] / row['spec_s']:6.2f} tok/s  alpha {_alpha(row):.2f}  {same}")
    eng.spec = spec_cfg
    return {**summarize(rows), "sampling": dataclasses.asdict(params)}


def _alpha(r: dict) -> float:
    return r["accepted"] / r["drafted"] if r["drafted"] else 0.0


def summarize(rows: list[dict]) -> dict:
    groups = defaultdict(list)
    for r in rows:
        groups[r["category"]].append(r)
    groups["ALL"] = rows

    def agg(rs):
        plain_tok = sum(r["tokens"] for r in rs)
        spec_tok = sum(r["spec_tokens"] for r in rs)
        plain_s, spec_s = sum(r["plain_s"] for r in rs), sum(r["spec_s"] for r in rs)
        drafted, accepted, rounds = (sum(r[k] for r in rs) for k in ("drafted", "accepted", "rounds"))
        return {"prompts": len(rs), "plain_tok_s": plain_tok / plain_s, "spec_tok_s": spec_tok / spec_s,
                "speedup": (spec_tok / spec_s) / (plain_tok / plain_s),
                "alpha": accepted / drafted if drafted else 0.0,
                "mean_accepted": accepted / rounds if rounds else 0.0,
                "identical": sum(r["identical"] for r in rs)}

    return {"categories": {k: agg(v) for k, v in groups.items()}, "prompts": rows}


def print_summary(s: dict) -> None:
    greedy = s.get("sampling", {}).get("temperature", 0.0) == 0.0      # sampled outputs are not compared
    print(f"\n{'category':<14} {'n':>3} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'alpha':>6} "
          f"{'mean acc':>9}" + (f" {'identical':>10}" if greedy else ""))
    for cat, a in s["categories"].items():
        print(f"{cat:<14} {a['prompts']:>3} {a['plain_tok_s']:>12.2f} {a['spec_tok_s']:>11.2f} "
              f"{a['speedup']:>7.2f}x {a['alpha']:>6.2f} {a['mean_accepted']:>9.2f}" +
              (f" {a['identical']:>5}/{a['prompts']}" if greedy else ""))


def make_draft_wrong(eng) -> None:
    """Turn the engine's draft into one that is always wrong, at its full cost: it still runs every draft step,
    then shifts each proposed id by one (the target's choice is never the draft's choice plus one, except by a
    vanishing coincidence). Measures what speculation costs when it cannot help."""
    eng.draft_proposer = AlwaysWrong(eng.draft_proposer, eng.model.cfg.vocab_size)


class AlwaysWrong:
    """A proposer that runs another one at its full cost and shifts every proposed id by one."""

    def __init__(self, inner, vocab: int):
        self.inner, self.vocab, self.kind = inner, vocab, inner.kind

    def __getattr__(self, name):                        # the rest (a head's catch-up, state) is the inner's
        return getattr(self.inner, name)

    def propose(self, context, k, limits):
        # a leaf or a tree's other branches could be right
        p = self.inner.propose(context, k, dataclasses.replace(limits, leaf_p=0.0, tree=None))
        p.tokens = [(t + 1) % self.vocab for t in p.tokens]
        if p.probs is not None:                          # keep q consistent with what is proposed
            p.probs = torch.roll(p.probs, shifts=1, dims=-1)
        return p


def run(a) -> int:

    draft = str(resolve(a.draft_model)) if a.draft_model else None
    mode = a.spec_mode or ("auto" if draft else "ngram")
    check_tree(a.draft_tree)
    params = SamplingParams(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=a.seed,
                            max_tokens=a.n_predict)          # a bad setting refused before the models load
    cfg = SpecConfig(mode=mode, draft_max=a.draft_max, draft_min=a.draft_min, p_min=a.draft_p_min,
                     leaf_p=a.draft_leaf_p, tree_width=a.draft_tree)
    eng = Engine(str(resolve(a.model)), device=a.device, precision=a.precision, ctx_size=a.ctx_size,
                 threads=a.threads, draft_path=draft, spec=cfg)
    wrong_draft = getattr(a, "wrong_draft", False)
    if wrong_draft:
        if eng.draft_proposer is None:
            raise JllmError("--wrong-draft needs a draft model or head (-md)")
        make_draft_wrong(eng)
    t0 = time.perf_counter()
    s = run_corpus(eng, cfg, limit=a.limit, params=params)
    print_summary(s)
    wrong = " (always wrong)" if wrong_draft else ""
    how = "greedy" if params.greedy else f"sampled at temperature {a.temp} (top-k {a.top_k}, top-p {a.top_p}, " \
        f"min-p {a.min_p}, seed {a.seed})"
    print(f"\n{eng.gguf.path.name} + {a.draft_model or 'no draft'}{wrong}, mode {mode}, precision {eng.precision}, "
          f"max {a.n_predict} tokens, {how}, {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": eng.gguf.path.name, "draft": a.draft_model, "mode": mode,
                       "wrong_draft": bool(wrong_draft),
                       "precision": eng.precision, "max_tokens": a.n_predict, **s}, f, indent=1)
    return 0
