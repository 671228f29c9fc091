"""How far each compute precision is from the exact f32 path on a text: perplexity, mean KL(exact || p) per
token, and how often the top-1 token equals exact's. Teacher-forced over one context, in chunks.

    python benchmarks/precision_kl.py [-m MODEL] [--text FILE] [--tokens N] [precisions ...]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from jllm.model.loader import load_model
from jllm.catalog import resolve

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "reference" / "seed.txt"


def log_probs(model, ids: list[int], chunk: int = 256) -> torch.Tensor:
    """[len(ids) - 1, vocab] log-probabilities of each next token."""
    cache = model.new_cache(len(ids))
    out = []
    for s in range(0, len(ids) - 1, chunk):
        part = ids[s:min(s + chunk, len(ids) - 1)]
        out.append(torch.log_softmax(model.forward(torch.tensor(part), cache).float(), -1))
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("precisions", nargs="*", default=["native", "native4", "int8"])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--tokens", type=int, default=1024)
    a = ap.parse_args()
    path = resolve(a.model)
    exact = load_model(path, "cpu", "exact", max_positions=a.tokens)
    from jllm.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(exact.gguf.metadata)
    ids = tok.encode(Path(a.text).read_text(encoding="utf-8"))[:a.tokens]
    targets = torch.tensor(ids[1:])
    ref = log_probs(exact, ids)
    del exact
    print(f"{Path(path).name}, {len(ids)} tokens of {a.text}")
    print(f"{'precision':<10} {'perplexity':>10} {'KL nats/tok':>12} {'top-1 = exact':>14}")
    rows = [("exact", ref)]
    for p in a.precisions:
        rows.append((p, log_probs(load_model(path, "cpu", p, max_positions=a.tokens), ids)))
    for name, lp in rows:
        ppl = math.exp(-lp.gather(1, targets[:, None]).mean().item())
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        top1 = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{name:<10} {ppl:>10.3f} {kl:>12.4f} {top1:>13.1%}")


if __name__ == "__main__":
    main()
