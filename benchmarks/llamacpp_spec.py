"""llama.cpp on the speculative corpus, beside `jllm bench --spec`: the same prompts (jllm's chat template,
rendered to text with its special tokens, which llama.cpp tokenizes with parse_special), greedy, the same
number of new tokens, 2 threads. Plain decoding is `llama-completion`, speculative decoding
`llama-speculative-simple -md DRAFT --spec-type TYPE` (draft-eagle3 with an EAGLE-3 head). Each prompt runs
plain then speculative, back to back, so the host's speed swings fall on both.

    python benchmarks/llamacpp_spec.py --bin ~/.cache/jllm-baseline-llamacpp/build/bin \
        -m qwen2.5-coder-1.5b -md qwen2.5-coder-1.5b-eagle3 [--limit N] [--json OUT]

llama.cpp's qwen2 graph (llama-cpp-python 0.3.36's copy) does not expose the layer inputs that an EAGLE-3
head reads; its qwen3 graph and ~20 others do. BENCHMARKS.md says which one-line patch of
src/models/qwen2.cpp the measured build carries.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from collections import defaultdict
from pathlib import Path

from jllm.catalog import resolve
from jllm.gguf.reader import read_gguf
from jllm.spec.corpus import load_corpus
from jllm.tokenizer.chat import ChatTemplate
from jllm.tokenizer.tokenizer import Tokenizer

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")
EVAL = re.compile(r"(?:llama_perf_context_print|common_perf_print):\s+eval time =\s+([\d.]+) ms /\s+(\d+) runs")
ENCODED = re.compile(r"encoded\s+(\d+) tokens")


def run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"{Path(cmd[0]).name} failed ({out.returncode}): {' | '.join(tail)}")
    return out.stdout + out.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="llama.cpp's build/bin")
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--draft-model", default="qwen2.5-coder-1.5b-eagle3")
    ap.add_argument("--spec-type", default="draft-eagle3")
    ap.add_argument("--draft-max", type=int, default=None, help="llama.cpp's --draft-max (its default if unset)")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    target, draft = str(resolve(a.model)), str(resolve(a.draft_model))
    meta = read_gguf(target).metadata
    tok = Tokenizer.from_metadata(meta)
    template = ChatTemplate.from_metadata(meta, tok)
    bin_dir = Path(a.bin).expanduser()
    common = ["-m", target, "-n", str(a.n_predict), "-t", str(a.threads), "--temp", "0", "-c", "4096"]
    items = load_corpus()[:a.limit] if a.limit else load_corpus()
    rows = []
    for item in items:
        ids = tok.encode(template.render(item["messages"], add_generation_prompt=True), parse_special=True)
        text = tok.decode(ids[1:] if tok.add_bos and ids and ids[0] == tok.bos_id else ids)
        plain = run([str(bin_dir / "llama-completion"), *common, "-p", text, "-no-cnv", "--no-display-prompt",
                     "--no-warmup"])
        m = EVAL.search(plain)
        if m is None:
            raise SystemExit("llama-completion printed no eval time")
        plain_ms, plain_n = float(m.group(1)), int(m.group(2))
        spec_cmd = [str(bin_dir / "llama-speculative-simple"), *common, "-md", draft, "--spec-type", a.spec_type,
                    "-p", text]
        if a.draft_max is not None:
            spec_cmd += ["--draft-max", str(a.draft_max)]
        spec = run(spec_cmd)
        d, dr, ac, enc = DECODED.search(spec), DRAFTED.search(spec), ACCEPTED.search(spec), ENCODED.search(spec)
        if d is None:
            raise SystemExit("llama-speculative-simple printed no decode time")
        row = {"id": item["id"], "category": item["category"], "prompt_tokens": len(ids),
               "llama_prompt_tokens": int(enc.group(1)) if enc else None,
               "plain_tokens": plain_n, "plain_s": plain_ms / 1000,
               "spec_tokens": int(d.group(1)), "spec_s": float(d.group(2)),
               "drafted": int(dr.group(1)) if dr else 0, "accepted": int(ac.group(1)) if ac else 0}
        rows.append(row)
        if row["llama_prompt_tokens"] not in (None, len(ids)):
            print(f"{item['id']}: llama.cpp read {row['llama_prompt_tokens']} prompt tokens, jllm {len(ids)}")
        print(f"{item['id']:<28} plain {row['plain_tokens'] / row['plain_s']:6.2f} tok/s  "
              f"spec {row['spec_tokens'] / row['spec_s']:6.2f} tok/s  "
              f"alpha {row['accepted'] / max(1, row['drafted']):.2f}", flush=True)
    groups = defaultdict(list)
    for r in rows:
        groups[r["category"]].append(r)
    groups["ALL"] = rows
    summary = {}
    print(f"\n{'category':<14} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'alpha':>6}")
    for cat, rs in groups.items():
        p = sum(r["plain_tokens"] for r in rs) / sum(r["plain_s"] for r in rs)
        s = sum(r["spec_tokens"] for r in rs) / sum(r["spec_s"] for r in rs)
        alpha = sum(r["accepted"] for r in rs) / max(1, sum(r["drafted"] for r in rs))
        summary[cat] = {"plain_tok_s": p, "spec_tok_s": s, "speedup": s / p, "alpha": alpha}
        print(f"{cat:<14} {p:>12.2f} {s:>11.2f} {s / p:>7.2f}x {alpha:>6.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"categories": summary, "prompts": rows, "draft": draft,
                                            "spec_type": a.spec_type}, indent=1))


if __name__ == "__main__":
    main()
