"""The first sampled draft's acceptance, sum over tokens of min(p, q), with drafts drawn at tau times the sampling
temperature (q = softmax(z / (tau T)) over the proposer's logits z, p the target's at T, top-p applied to both),
for each tau given: over two corpus prompts a category, along each prompt's plain sampled output (seed 0, 96
tokens; sampled_accept.walk). Per category and all. -md: the 0.5B draft model instead of the head.

    python benchmarks/head_tau.py 1.0 [--top-p P] [--taus 0.5,0.65,0.8,1.0] [-md qwen2.5-coder-0.5b]
"""
import argparse
import collections

import torch

from jllm.sampling import SamplingParams, probs
from jllm.spec.corpus import load_corpus
from sampled_accept import walk

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("temp", type=float)
ap.add_argument("--top-p", type=float, default=1.0)
ap.add_argument("--taus", default="0.7,0.85,1.0,1.15,1.3")
ap.add_argument("-md", "--draft", default="qwen2.5-coder-1.5b-eagle3")
a = ap.parse_args()
taus = [float(t) for t in a.taus.split(",")]
params = SamplingParams(temperature=a.temp, top_p=a.top_p, seed=0, max_tokens=96)
items = load_corpus()
picked = [it for c in sorted({i["category"] for i in items}) for it in [i for i in items if i["category"] == c][:2]]
acc = collections.defaultdict(lambda: [0.0] * (len(taus) + 1))
for item, p, z in walk(params, picked, a.draft):
    row = acc[item["category"]]
    for j, tau in enumerate(taus):
        row[j] += torch.minimum(p, probs(z / tau, params, [])).sum().item()
    row[-1] += 1
total = [sum(r[k] for r in acc.values()) for k in range(len(taus) + 1)]
print(f"T {a.temp} top-p {a.top_p} {a.draft}: tau " + " ".join(f"{t:>6}" for t in taus))
for c, r in sorted(acc.items()) + [("ALL", total)]:
    print(f"{c:<12} " + " ".join(f"{r[j] / r[-1]:6.3f}" for j in range(len(taus))))
