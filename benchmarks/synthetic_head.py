"""Write an EAGLE-3 head of the real shapes with random weights for a target GGUF (a synthetic one on the lent
GPU, where neither the real target nor the shipped head has to travel): the cost of a head's draft step and of
a speculative round is measured with it; its drafts are almost all wrong (random weights).

    python benchmarks/synthetic_head.py /tmp/s15.gguf /tmp/h15.gguf [--draft-vocab 28672 --ffn 2304]

The file is what `jllm train-head` writes (jllm.train.export), for the target's shape and tokenizer: d2t the
first --draft-vocab ids, matrices in Q4_0 by default, as the shipped head.
"""

from __future__ import annotations

import argparse

import torch
from gguf import GGMLQuantizationType as Q

from jllm.gguf.reader import read_gguf
from jllm.model.config import config_from_gguf
from jllm.train.eagle3 import Eagle3Head, HeadConfig
from jllm.train.export import write_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--draft-vocab", type=int, default=28672)
    ap.add_argument("--ffn", type=int, default=2304)
    ap.add_argument("--qtype", default="Q4_0", choices=["Q4_0", "Q8_0", "F16", "F32"])
    ap.add_argument("--layers", type=int, nargs=3, help="the target layers it reads (default: the trainer's)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    g = read_gguf(a.target)
    cfg = config_from_gguf(g.metadata, set(g.tensors), a.target)
    torch.manual_seed(a.seed)
    c = HeadConfig.for_target(cfg, a.draft_vocab, a.ffn, a.layers)
    head = Eagle3Head(c, torch.zeros(1, cfg.hidden))      # the embedding is the target's: not written
    size = write_head(a.out, head, a.target, Q[a.qtype], name="synthetic eagle3 head")
    print(f"{a.out}: {size / 1e6:.1f} MB, draft vocabulary {c.draft_vocab}, FFN {c.ffn}, "
          f"target layers {list(c.target_layers)}")


if __name__ == "__main__":
    main()
