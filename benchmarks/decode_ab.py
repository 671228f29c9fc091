"""Plain decode of two jllm source trees, paired: each round runs tree A then tree B in fresh processes
(their own kernel builds), so the host's memory phases fall on both alike; prints ms a token per process.

    git worktree add /tmp/before HEAD~1
    python benchmarks/decode_ab.py /tmp/before/src src [--rounds 3] [-m qwen2.5-coder-1.5b] [-n 96]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CHILD = r'''
import sys, time
from jllm.catalog import resolve
from jllm.engine import Engine
from jllm.sampling import SamplingParams
from jllm.spec.config import SpecConfig
eng = Engine(str(resolve(sys.argv[1])), spec=SpecConfig(mode="none"))
ids = eng.chat_ids([{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
eng.generate(ids, SamplingParams(max_tokens=8))
for _ in range(3):
    eng.reset()
    t = time.perf_counter()
    out = eng.generate(ids, SamplingParams(max_tokens=int(sys.argv[2]))).token_ids
    print((time.perf_counter() - t) / len(out) * 1000)
'''


def run(src: str, model: str, n: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(n)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{src}: {out.stderr.strip().splitlines()[-1]}")
    return [float(x) for x in out.stdout.split()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    ratios = []
    for r in range(a.rounds):
        ta, tb = run(a.a, a.model, a.n), run(a.b, a.model, a.n)
        ratios.append(statistics.median(ta) / statistics.median(tb))
        print(f"round {r + 1}: A {' '.join(f'{x:.1f}' for x in ta)}  B {' '.join(f'{x:.1f}' for x in tb)} "
              f"ms a token; A/B {ratios[-1]:.2f}", flush=True)
    print(f"median A/B over {a.rounds} rounds: {statistics.median(ratios):.2f} (B is that much faster)")


if __name__ == "__main__":
    main()
