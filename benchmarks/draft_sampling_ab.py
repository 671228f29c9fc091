"""Sampled speculative decoding with the head drawing its drafts over its own draft vocabulary (A, this tree)
against over the target's whole vocabulary (B, the path before session 31: a softmax, the filters and a CDF
over 151,936 ids a draft step), toggled in one process, A B then B A, on every third corpus prompt; decode
tok/s and the draft's share of the time for each.

    python benchmarks/draft_sampling_ab.py [--temp 1.0 --top-p 1.0 --top-k 0 --min-p 0 -n 96 --every 3]
"""

from __future__ import annotations

import argparse

from sampling_ab import add_args, decode, params_of

from jllm.catalog import resolve
from jllm.engine import Engine
from jllm.spec.config import SpecConfig
from jllm.spec.corpus import load_corpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, temp=1.0, top_p=1.0)
    ap.add_argument("--every", type=int, default=3)
    a = ap.parse_args()
    eng = Engine(str(resolve(a.model)), draft_path=str(resolve(a.draft_model)), spec=SpecConfig())
    choose = eng.draft_proposer.choose
    if choose.ids is None:
        raise SystemExit(f"{a.draft_model} scores the target's whole vocabulary: nothing to compare")
    versions = {"A draft vocabulary": choose.target_vocab, "B whole vocabulary": 0}   # 0: the full path
    params = params_of(a)
    items = load_corpus()[::a.every]
    res: dict = {}
    for order in (list(versions), list(versions)[::-1]):
        for name in order:
            choose.target_vocab = versions[name]
            tok, sec, draft = decode(eng, items, params)
            res.setdefault(name, []).append((tok / sec, draft / sec))
    print(f"{len(items)} prompts, {a.n} tokens, temperature {a.temp}, top-p {a.top_p}, top-k {a.top_k}, "
          f"min-p {a.min_p}; speculative decode tok/s (drafting's share of the time), two runs each")
    for name, v in res.items():
        print(f"{name:<20} {'  '.join(f'{t:6.2f} ({d:.1%})' for t, d in v)}")


if __name__ == "__main__":
    main()
