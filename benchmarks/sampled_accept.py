"""How often the head's first draft would be accepted when sampling at temperature T, two ways of drafting:
sampling it from the head's distribution q (as jllm does; accepted with probability sum min(p, q), p the
target's distribution at T) or proposing q's most likely token as a point (accepted with probability p at that
token). Over each corpus prompt's plain sampled output (seed 0, 128 tokens), at every position: the target's
p there and the head's q from the target's states before it (the same catch-up as drafting). Per category,
the two acceptances and q's top probability.

    python benchmarks/sampled_accept.py 1.0 [PROMPTS]       # ~4 min for the 42
"""
import collections
import sys

import torch

from jllm.catalog import resolve
from jllm.engine import Engine
from jllm.sampling import SamplingParams, probs
from jllm.spec.config import SpecConfig
from jllm.spec.corpus import load_corpus


def walk(params: SamplingParams, items, draft: str = "qwen2.5-coder-1.5b-eagle3"):
    """For each corpus item, its plain sampled output (params), and at each of its positions: (item, p, z), the
    target's distribution there and the proposer's logits over the target's ids from the context before it
    (the head caught up as drafting does; a draft model synced; ids outside its vocabulary at -inf)."""
    eng = Engine(str(resolve("qwen2.5-coder-1.5b")), draft_path=str(resolve(draft)), spec=SpecConfig())
    prop = eng.draft_proposer
    for item in items:
        ids = eng.chat_ids(item["messages"])
        eng.spec = None; eng.reset()
        out = eng.generate(ids, params).token_ids
        eng.reset()
        with torch.inference_mode():
            tlog = torch.cat([eng.target.forward(ids)[-1:], eng.target.forward(out[:-1])])   # row i predicts out[i]
            for i in range(len(out)):
                if prop.kind == "head":
                    z = prop.choose.to_target(prop.catch_up(ids + out[:i]).logits)
                else:
                    z = _padded(prop.seq.sync(ids + out[:i]), tlog.shape[1])
                yield item, probs(tlog[i], params, []), z


def _padded(logits: torch.Tensor, v: int) -> torch.Tensor:
    """A draft model's logits over its first ids (FR-Spec) -> over the target's v ids, -inf past its own."""
    z = (logits[-1] if logits.dim() > 1 else logits).float()
    return torch.cat([z, torch.full((v - z.shape[0],), float("-inf"))]) if z.shape[0] < v else z


if __name__ == "__main__":
    T = float(sys.argv[1]); limit = int(sys.argv[2]) if len(sys.argv) > 2 else 42
    params = SamplingParams(temperature=T, seed=0, max_tokens=128)
    acc = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for item, p, z in walk(params, load_corpus()[:limit]):
        q = probs(z, params, [])
        a = acc[item["category"]]
        a[0] += torch.minimum(p, q).sum().item(); a[1] += p[int(q.argmax())].item()
        a[2] += q.max().item(); a[3] += 1
    tot = [sum(a[k] for a in acc.values()) for k in range(4)]
    print(f"T {T}: category  sample-from-q  argmax-of-q  q's top prob  positions")
    for c, a in list(acc.items()) + [("ALL", tot)]:
        print(f"{c:<12} {a[0] / a[3]:.3f} {a[1] / a[3]:.3f} {a[2] / a[3]:.3f} {a[3]}")
