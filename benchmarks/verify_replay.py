"""The sampled verify's own cost, this tree's jllm.spec.verify against another copy of verify.py (an earlier
commit's: `git show REV:src/jllm/spec/verify.py > /tmp/verify_old.py`): real verify calls are recorded from
sampled speculative decoding (the target and its head on every sixth corpus prompt), then each is replayed under
both versions, alternating which goes first, from the same generator seed. Prints ms a verify and how many
replays gave the same outcome (the two must agree on every one where the rule is unchanged).

    python benchmarks/verify_replay.py /tmp/verify_old.py [-n 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

from jllm.catalog import resolve
from jllm.engine import Engine
from jllm.sampling import SamplingParams, make_generator
from jllm.spec import loop, verify
from jllm.spec.config import SpecConfig
from jllm.spec.corpus import load_corpus

SETTINGS = ((1.0, 1.0), (0.8, 0.95), (0.7, 1.0))          # (temperature, top-p): serve's default first


def record(eng: Engine, items: list[dict], params: SamplingParams) -> list[tuple]:
    """Every verify_block call of decoding `items` with `params`, with copies of its tensors."""
    calls, real = [], loop.verify_block

    def keep(drafts, probs, leaf, logits, p, history, gen):
        calls.append((list(drafts), None if probs is None else probs.clone(), leaf, logits.clone(), p,
                      list(history)))
        return real(drafts, probs, leaf, logits, p, history, gen)

    loop.verify_block = keep
    try:
        for it in items:
            eng.reset()
            eng.generate(eng.chat_ids(it["messages"]), params)
    finally:
        loop.verify_block = real
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("other", help="another verify.py, whose verify_block is 'other'")
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--draft-model", default="qwen2.5-coder-1.5b-eagle3")
    ap.add_argument("-n", type=int, default=64, help="tokens a prompt")
    ap.add_argument("--rounds", type=int, default=3, help="replays of every call under each version")
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("verify_other", a.other)
    other = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = other
    spec.loader.exec_module(other)
    eng = Engine(str(resolve(a.model)), draft_path=str(resolve(a.draft_model)), spec=SpecConfig())
    items = load_corpus()[::6]
    print(f"{len(items)} prompts, {a.n} tokens each; ms a verify, each call replayed {a.rounds}x under each")
    for temp, top_p in SETTINGS:
        calls = record(eng, items, SamplingParams(temperature=temp, top_p=top_p, seed=0, max_tokens=a.n))
        secs, same = {"this": 0.0, "other": 0.0}, 0
        for r in range(a.rounds):
            for i, (drafts, q, leaf, logits, p, history) in enumerate(calls):
                order = [("this", verify), ("other", other)]
                outcome = {}
                for name, mod in (order if (i + r) % 2 else order[::-1]):
                    gen = make_generator(1000 + i)
                    t = time.perf_counter()
                    v = mod.verify_block(drafts, q, leaf, logits, p, history, gen)
                    secs[name] += time.perf_counter() - t
                    outcome[name] = (v.accepted, v.next)
                same += outcome["this"] == outcome["other"]
        n = a.rounds * len(calls)
        drafted = sum(len(c[0]) for c in calls) / max(len(calls), 1)
        print(f"T {temp} top-p {top_p}: {len(calls)} verifies ({drafted:.2f} drafts each): this "
              f"{secs['this'] / n * 1e3:.3f} ms, other {secs['other'] / n * 1e3:.3f} ms; same outcome {same}/{n}",
              flush=True)


if __name__ == "__main__":
    main()
