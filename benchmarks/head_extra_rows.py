"""Could the target's own output rows let an EAGLE-3 head draft the tokens outside its draft vocabulary (d2t)?
For every position of the corpus traces' greedy outputs, the head's first draft from the target's states (its
prefill over prompt + output) is scored over its own rows, and again with the target's output rows, times a
scale, added for the ids d2t lacks: how often each gets the target's token, per category, and how often the
added rows get the tokens only they can.

    python benchmarks/head_extra_rows.py [--traces benchmarks/results/spec_traces_head_s25.json] [--scales ...]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from jllm.catalog import resolve
from jllm.engine import Engine
from jllm.model.transformer import rms_norm
from jllm.spec.config import SpecConfig


def matrix(path: str, name: str) -> torch.Tensor:
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    rows = dequantize(t.data, t.tensor_type).astype(np.float32)
    return torch.from_numpy(rows).reshape(*reversed([int(x) for x in t.shape]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--head", default="qwen2.5-coder-1.5b-eagle3")
    ap.add_argument("--traces", default="benchmarks/results/spec_traces_head_s25.json")
    ap.add_argument("--scales", type=float, nargs="+", default=[0.6, 0.8, 1.0])
    a = ap.parse_args()
    target_path, head_path = str(resolve(a.model)), str(resolve(a.head))
    eng = Engine(target_path, draft_path=head_path, spec=SpecConfig())
    head, seq = eng.head, eng.target
    if head.d2t is None:
        raise SystemExit(f"{a.head} scores the whole vocabulary: no rows to add")
    d2t = head.d2t.long()
    names = {t.name for t in GGUFReader(target_path).tensors}
    out_rows = matrix(target_path, "output.weight" if "output.weight" in names else "token_embd.weight")
    own = matrix(head_path, "output.weight")
    cos = torch.nn.functional.cosine_similarity(own, out_rows[d2t], dim=1)
    ratio = own.norm(dim=1) / out_rows[d2t].norm(dim=1)
    q = torch.tensor([0.1, 0.5, 0.9])
    print(f"the head's output rows against the target's for the same ids: cosine {cos.quantile(q).tolist()}, "
          f"norm ratio {ratio.quantile(q).tolist()} (10th, 50th, 90th percentiles)")
    inside = torch.zeros(out_rows.shape[0], dtype=torch.bool)
    inside[d2t] = True
    rows = json.load(open(a.traces))["rows"]
    scored = []
    for r in rows:
        ids, out = r["prompt"], r["out"]
        eng.reset()
        seq.sync(ids + out)
        head.truncate(0)
        with torch.inference_mode():
            logits, state = head.forward(torch.tensor((ids + out)[1:]),
                                         head.fuse(seq.features[:len(ids) + len(out) - 1].float()))
            normed = rms_norm(state, head.output_norm, head.cfg.rms_eps)
        # head row P predicts the token at P + 2: rows len(ids) - 1 .. predict out[1:] (out[0] is the target's)
        p0 = len(ids) - 1
        n = len(out) - 1
        scored.append((r["category"], logits[p0:p0 + n].float(), normed[p0:p0 + n].float() @ out_rows.T,
                       torch.tensor(out[1:])))
    print(f"{'scale':>6} " + " ".join(f"{c[:10]:>22}" for c in sorted({s[0] for s in scored})) + f" {'ALL':>22}")
    for scale in [None] + a.scales:
        cats = defaultdict(lambda: [0, 0, 0, 0])            # positions, first draft right, outside, right there
        for cat, own_logits, full, want in scored:
            if scale is None:
                got = d2t[own_logits.argmax(1)]
            else:
                mixed = full * scale
                mixed[:, d2t] = own_logits
                got = mixed.argmax(1)
            c, out_ = cats[cat], ~inside[want]
            c[0] += len(want)
            c[1] += int((got == want).sum())
            c[2] += int(out_.sum())
            c[3] += int((got[out_] == want[out_]).sum())
        cats["ALL"] = [sum(v[i] for v in cats.values()) for i in range(4)]
        label = "own" if scale is None else f"{scale:g}"
        print(f"{label:>6} " + " ".join(f"{v[1] / v[0]:>10.3f} ({v[3] / max(1, v[2]):.2f} of {v[2] / v[0]:.3f})"
                                        for _, v in sorted(cats.items(), key=lambda kv: (kv[0] == 'ALL', kv[0]))))


if __name__ == "__main__":
    main()
