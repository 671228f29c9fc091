"""Why does the shipped EAGLE-3 head agree with the target less on the corpus (first draft 0.62) than on its own
held-out data during training (0.78)? Each sequence is scored four ways, the head's first draft against the
target's top token at every reply position:

    target states from   the training's target (Hugging Face over the GGUF's weights, float32)  or jllm's (native)
    head computed by     the training's Eagle3Head (the file's weights, dequantized, float32)   or jllm's (native4)

so the gap splits into the data (corpus against held-out conversations), the target's numerics and the head's
(its Q4_0 weights are in both heads; the native kernels' int8 activations only in jllm's). The training head
also unrolls its 7 draft steps, as the training's held-out score does.

    python benchmarks/head_gap.py [--held 30] [--data training/qwen2.5-coder-1.5b] [--max-len 700]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from jllm.catalog import resolve
from jllm.engine import Engine
from jllm.spec.config import SpecConfig
from jllm.train import data as data_mod
from jllm.train.head import init_from_head, new_head
from jllm.train.target import load_target

# the order training/README.md's command concatenates them in: the held-out draw depends on it
FILES = ("s1", "s2", "s3", "s4", "s5", "s6", "s7", "v1")


def held_out(data_dir: str, fingerprint: str, n: int, max_len: int, seed: int = 0, holdout: float = 0.02):
    """n of the conversations the shipped head's training kept out (TrainConfig's draw), each <= max_len tokens."""
    conv = data_mod.Conversations.concat([data_mod.Conversations.load(f"{data_dir}/conversations-{f}.npz",
                                                                       fingerprint) for f in FILES])
    held = sorted(random.Random(seed + 1).sample(range(len(conv)), int(len(conv) * holdout)))
    fit = [i for i in held if len(conv.ids(i)) <= max_len and len(conv.ids(i)) - conv.reply_start[i] >= 16]
    pick = random.Random(seed + 2).sample(fit, min(n, len(fit)))
    return [dict(id=f"held-{i}", category=data_mod.SOURCES[conv.source[i]] + ("/s" if conv.sampled[i] else ""),
                 ids=conv.ids(i).astype(np.int64).tolist(), start=int(conv.reply_start[i])) for i in pick]


def corpus(traces: str):
    rows = json.load(open(traces))["rows"]
    return [dict(id=r["id"], category=r["category"], ids=r["prompt"] + r["out"], start=len(r["prompt"]))
            for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--head", default="qwen2.5-coder-1.5b-eagle3")
    ap.add_argument("--traces", default="benchmarks/results/spec_traces_head_s25.json")
    ap.add_argument("--data", default="training/qwen2.5-coder-1.5b")
    ap.add_argument("--held", type=int, default=30, help="held-out conversations to score (0: the corpus only)")
    ap.add_argument("--max-len", type=int, default=700)
    ap.add_argument("--limit", type=int, default=0, help="only the first N corpus sequences")
    ap.add_argument("--json")
    a = ap.parse_args()
    target_path, head_path = str(resolve(a.model)), str(resolve(a.head))
    t0 = time.perf_counter()
    hf = load_target(target_path, "cpu")
    eng = Engine(target_path, draft_path=head_path, spec=SpecConfig())
    rt_head, seq = eng.head, eng.target
    d2t = rt_head.d2t.long()
    tr_head = new_head(hf, d2t.numpy(), rt_head.cfg.ffn, rt_head.cfg.target_layers)
    init_from_head(tr_head, head_path)
    tr_head.eval()
    print(f"loaded in {time.perf_counter() - t0:.0f} s")
    sets = [("corpus", corpus(a.traces)[:a.limit or None])]
    if a.held:
        sets.append(("held-out", held_out(a.data, hf.tokenizer.fingerprint(), a.held, a.max_len)))
    report = {}
    for name, seqs in sets:
        tally = defaultdict(lambda: defaultdict(lambda: np.zeros(2)))   # category -> measure -> (hits, count)
        t1 = time.perf_counter()
        for s in seqs:
            ids, start, n = s["ids"], s["start"], len(s["ids"])
            x = torch.tensor(ids)[None]
            with torch.inference_mode():
                feats_hf, logits_hf = hf.features(x, torch.tensor([n]), rt_head.cfg.target_layers)
                top_hf = logits_hf[0].argmax(-1)
                del logits_hf
                eng.reset()
                logits_rt = seq.forward(ids)
                top_rt = logits_rt.argmax(-1)
                del logits_rt
                feats_rt = seq.features[:n].float()
            # row t (token t + 1, state t) drafts token t + 2: scored where t + 2 is a reply token, against the
            # target's top token at row t + 1
            rows = torch.arange(max(0, start - 2), n - 2)
            want = top_hf[rows + 1]
            c = tally[s["category"]]
            c["target tops agree (hf, jllm)"] += [int((top_rt[rows + 1] == want).sum()), len(rows)]
            for fname, f in (("hf", feats_hf[0].float()), ("jllm", feats_rt)):
                with torch.inference_mode():
                    rt_head.truncate(0)
                    lg, _ = rt_head.forward(torch.tensor(ids[1:]), rt_head.fuse(f[:n - 1]))
                    got = d2t[lg.argmax(-1)][rows]
                c[f"states {fname}, head jllm"] += [int((got == want).sum()), len(rows)]
                with torch.no_grad():
                    for j, h in enumerate(tr_head.unroll(f[None], x, 7)):
                        r = rows - j
                        live = r >= 0
                        got = d2t[tr_head.logits(h[0, r.clamp(min=0)]).argmax(-1)]
                        c[f"states {fname}, head train, step {j}"] += [int(((got == want) & live).sum()),
                                                                       int(live.sum())]
        print(f"\n{name}: {len(seqs)} sequences, {time.perf_counter() - t1:.0f} s")
        allc = defaultdict(lambda: np.zeros(2))
        for cat in tally:
            for m, v in tally[cat].items():
                allc[m] += v
        cats = sorted(tally) + ["ALL"]
        tally["ALL"] = allc
        measures = list(allc)
        print(f"{'measure':<36}" + "".join(f"{c[:11]:>12}" for c in cats))
        for m in measures:
            print(f"{m:<36}" + "".join(f"{tally[c][m][0] / max(1, tally[c][m][1]):>12.3f}" for c in cats))
        print(f"{'positions':<36}" + "".join(f"{int(tally[c][measures[0]][1]):>12}" for c in cats))
        report[name] = {c: {m: tally[c][m].tolist() for m in measures} for c in cats}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
