"""How often the head's first draft would be accepted when sampling at temperature T, two ways of drafting:
sampling it from the head's distribution q (as jllm does; accepted with probability sum min(p, q), p the
target's distribution at T) or proposing q's most likely token as a point (accepted with probability p at that
token). Over each corpus prompt's plain sampled output (seed 0, 128 tokens), at every position: the target's
p there and the head's q from the target's states before it (the same catch-up as drafting). Per category,
the two acceptances and q's top probability.

    python benchmarks/sampled_accept.py 1.0 [PROMPTS]       # ~4 min for the 42
"""
import sys, collections, torch
from jllm.engine import Engine
from jllm.catalog import resolve
from jllm.sampling import SamplingParams, probs
from jllm.spec.config import SpecConfig
from jllm.spec.corpus import load_corpus
T = float(sys.argv[1]); limit = int(sys.argv[2]) if len(sys.argv) > 2 else 42
eng = Engine(str(resolve("qwen2.5-coder-1.5b")), draft_path=str(resolve("qwen2.5-coder-1.5b-eagle3")), spec=SpecConfig())
prop = eng.draft_proposer
params = SamplingParams(temperature=T, seed=0, max_tokens=128)
acc = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
for item in load_corpus()[:limit]:
    ids = eng.chat_ids(item["messages"])
    eng.spec = None; eng.reset()
    out = eng.generate(ids, params).token_ids
    eng.reset()
    with torch.inference_mode():
        last = eng.target.forward(ids)[-1:]
        rest = eng.target.forward(out[:-1])
        tlog = torch.cat([last, rest])               # row i predicts out[i]
        for i in range(len(out)):
            first = prop.catch_up(ids + out[:i])
            q = probs(prop.choose.to_target(first.logits), params, [])
            p = probs(tlog[i], params, [])
            a = acc[item["category"]]
            a[0] += torch.minimum(p, q).sum().item(); a[1] += p[int(q.argmax())].item()
            a[2] += q.max().item(); a[3] += 1
    print(item["id"], f"{acc[item['category']][0] / acc[item['category']][3]:.3f}", flush=True)
tot = [sum(a[k] for a in acc.values()) for k in range(4)]
print(f"T {T}: category  sample-from-q  argmax-of-q  q's top prob  positions")
for c, a in list(acc.items()) + [("ALL", tot)]:
    print(f"{c:<12} {a[0] / a[3]:.3f} {a[1] / a[3]:.3f} {a[2] / a[3]:.3f} {a[3]}")
