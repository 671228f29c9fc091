"""Sampled decoding, plain and speculative, under two versions of jllm.sampling.probs in one process: this
tree's and the one in another copy of sampling.py (an earlier commit's: `git show REV:src/jllm/sampling.py >
/tmp/sampling_old.py`), A B then B A, on every sixth corpus prompt; decode tok/s for each.

    python benchmarks/sampling_ab.py /tmp/sampling_old.py [--temp 0.8 --top-p 0.95 --top-k 0 --min-p 0 -n 96]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from jllm import sampling
from jllm.catalog import resolve
from jllm.engine import Engine
from jllm.sampling import SamplingParams
from jllm.spec import proposers, verify
from jllm.spec.config import SpecConfig
from jllm.spec.corpus import load_corpus


def add_args(ap: argparse.ArgumentParser, temp: float, top_p: float) -> None:
    """The model, the proposer and the sampling settings of a sampled A/B (this script, draft_sampling_ab.py)."""
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--draft-model", default="qwen2.5-coder-1.5b-eagle3")
    ap.add_argument("--temp", type=float, default=temp)
    ap.add_argument("--top-p", type=float, default=top_p)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("-n", type=int, default=96)


def params_of(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=a.temp, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p, seed=0, max_tokens=a.n)


def decode(eng: Engine, items: list[dict], params: SamplingParams) -> tuple[float, float, float]:
    """Each corpus item from a cold engine (speculation as eng.spec says) -> (tokens, decode seconds, drafting
    seconds), summed."""
    tok = sec = draft = 0.0
    for it in items:
        eng.reset()
        r = eng.generate(eng.chat_ids(it["messages"]), params)
        tok += len(r.token_ids)
        sec += r.timings.decode_ms / 1000
        draft += r.spec_stats.draft_s if r.spec_stats is not None else 0.0
    return tok, sec, draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("other", help="another sampling.py, whose probs is B")
    add_args(ap, temp=0.8, top_p=0.95)
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("sampling_other", a.other)
    other = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = other
    spec.loader.exec_module(other)
    mods = [m for m in (sampling, proposers, verify) if hasattr(m, "probs")]      # where probs is looked up
    versions = {"A (this tree)": sampling.probs, "B (other)": other.probs}

    eng = Engine(str(resolve(a.model)), draft_path=str(resolve(a.draft_model)), spec=SpecConfig())
    cfg = eng.spec
    params = params_of(a)
    items = load_corpus()[::6]
    res: dict = {}
    for order in (list(versions), list(versions)[::-1]):
        for name in order:
            for m in mods:
                m.probs = versions[name]
            for spec_cfg in (None, cfg):
                eng.spec = spec_cfg
                tok, sec, _ = decode(eng, items, params)
                res.setdefault((name, "speculative" if spec_cfg else "plain"), []).append(tok / sec)
    print(f"{len(items)} prompts, {a.n} tokens, temperature {a.temp}, top-p {a.top_p}, top-k {a.top_k}, "
          f"min-p {a.min_p}; decode tok/s, two runs each")
    for (name, how), v in res.items():
        print(f"{name:<14} {how:<12} {'  '.join(f'{x:6.2f}' for x in v)}")


if __name__ == "__main__":
    main()
