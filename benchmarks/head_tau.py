"""The head's first sampled draft's acceptance, sum over tokens of min(p, q), with its drafts drawn at tau times
the sampling temperature (q = softmax(z / (tau T)) over the head's logits z, p the target's at T, top-p applied
to both), for each tau given: over two corpus prompts a category, along each prompt's plain sampled output (seed
0, 96 tokens), the head caught up on the context before each position as drafting does. Per category and all.

    python benchmarks/head_tau.py 1.0 [TOP_P] [TAUS]          # e.g. 1.0 1.0 0.5,0.65,0.8,1.0 (~2 min a run)
"""
import sys, collections, torch
from jllm.engine import Engine
from jllm.catalog import resolve
from jllm.sampling import SamplingParams, probs
from jllm.spec.config import SpecConfig
from jllm.spec.corpus import load_corpus
T = float(sys.argv[1]); TOPP = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
TAUS = tuple(float(t) for t in sys.argv[3].split(",")) if len(sys.argv) > 3 else (0.7, 0.85, 1.0, 1.15, 1.3)
eng = Engine(str(resolve("qwen2.5-coder-1.5b")), draft_path=str(resolve("qwen2.5-coder-1.5b-eagle3")), spec=SpecConfig())
prop = eng.draft_proposer
params = SamplingParams(temperature=T, top_p=TOPP, seed=0, max_tokens=96)
acc = collections.defaultdict(lambda: [0.0] * (len(TAUS) + 1))
seen = collections.Counter()
items = load_corpus()
picked = [it for c in sorted({i["category"] for i in items}) for it in [i for i in items if i["category"] == c][:2]]
for item in picked:
    ids = eng.chat_ids(item["messages"])
    eng.spec = None; eng.reset()
    out = eng.generate(ids, params).token_ids
    eng.reset()
    with torch.inference_mode():
        last = eng.target.forward(ids)[-1:]
        rest = eng.target.forward(out[:-1])
        tlog = torch.cat([last, rest])
        for i in range(len(out)):
            first = prop.catch_up(ids + out[:i])
            z = prop.choose.to_target(first.logits)
            p = probs(tlog[i], params, [])
            a = acc[item["category"]]
            for j, tau in enumerate(TAUS):
                a[j] += torch.minimum(p, probs(z / tau, params, [])).sum().item()
            a[-1] += 1
    print(item["id"], " ".join(f"{acc[item['category']][j] / acc[item['category']][-1]:.3f}" for j in range(len(TAUS))), flush=True)
tot = [sum(a[k] for a in acc.values()) for k in range(len(TAUS) + 1)]
print(f"T {T} top-p {TOPP}: tau " + " ".join(f"{t:>6}" for t in TAUS))
for c, a in sorted(acc.items()) + [("ALL", tot)]:
    print(f"{c:<12} " + " ".join(f"{a[j] / a[-1]:6.3f}" for j in range(len(TAUS))))
