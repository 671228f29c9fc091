"""`jllm bench --multiturn`: two-turn conversations whose first user message holds >= 1500 tokens, each turn
in a new `jllm chat --conversation ID -p ... --json` process, once with the persistent KV cache and once with
`--no-kv-cache`; compares the second turn's prompt evaluation (hydration included) and its output. With
`--kv-store URL`, a third way: turn 1 with a cache dir and the Redis, turn 2 in a fresh, empty cache dir
(a replica that never saw turn 1; the conversation's messages copied over, as a client would send them) with
the same Redis, so that its state comes from the shared tier.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from jllm.catalog import resolve
from jllm.errors import JllmError
from jllm.gguf.reader import read_gguf
from jllm.spec.corpus import load_corpus
from jllm.tokenizer.tokenizer import Tokenizer

QUESTIONS = [
    ("Summarize the first passage in two sentences.", "Now name three key terms from the last passage."),
    ("Which passage is the oldest text, and why do you think so?", "Rewrite its first sentence in plain English."),
    ("List the passages with a one-line title for each.", "Which two passages are most alike? Answer briefly."),
]


def long_message(min_tokens: int, tokenizer, offset: int) -> str:
    """Passages from the corpus, rotated by offset, until the message holds at least min_tokens tokens."""
    passages = [m["messages"][-1]["content"] for m in load_corpus()
                if m["category"] in ("summarizing", "rewriting")]
    text, i = "Here are several passages.\n\n", 0
    while len(tokenizer.encode(text)) < min_tokens:
        text += f"Passage {i + 1}:\n{passages[(i + offset) % len(passages)]}\n\n"
        i += 1
    return text


def _turn(model: str, conv: str, message: str, cache_dir: str, extra: list[str], n_predict: int) -> dict:
    cmd = [sys.executable, "-m", "jllm", "chat", "-m", model, "--conversation", conv, "-p", message, "--json",
           "-n", str(n_predict), "-c", "4096", "--cache-dir", cache_dir, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise JllmError(f"bench turn failed: {last.removeprefix('jllm: ')}")
    return json.loads(out.stdout)


def _shared_turns(model: str, conv: str, first: str, second: str, root: str, flags: list[str], a) -> dict:
    """Turn 1 on replica A (cache dir root/a), turn 2 on replica B (root/b, empty but for the conversation's
    messages), both on the Redis in flags; returns turn 2's result. The conversation's shared entry is
    removed afterwards, so that the bench leaves nothing in that Redis."""
    from jllm.cache.shared import RedisTier

    a_dir, b_dir = os.path.join(root, conv, "a"), os.path.join(root, conv, "b")
    _turn(model, conv, first, a_dir, flags, a.n_predict)
    shutil.copytree(os.path.join(a_dir, "conversations"), os.path.join(b_dir, "conversations"))
    try:
        return _turn(model, conv, second, b_dir, flags, a.n_predict)
    finally:
        RedisTier(flags[flags.index("--kv-store") + 1]).remove(conv)


def run(a) -> int:
    model = str(resolve(a.model))
    tok = Tokenizer.from_metadata(read_gguf(model).metadata)
    rows = []
    extra = ["--precision", a.precision] if a.precision else []
    shared = ["--kv-store", a.kv_store] if getattr(a, "kv_store", None) else None
    with tempfile.TemporaryDirectory() as cached_dir, tempfile.TemporaryDirectory() as plain_dir, \
            tempfile.TemporaryDirectory() as shared_dir:
        for i in range(a.conversations):
            q1, q2 = QUESTIONS[i % len(QUESTIONS)]
            first = long_message(a.first_tokens, tok, i) + q1
            conv = f"bench-{os.getpid()}-{i}"
            res = {}
            for mode, d, flags in (("cache", cached_dir, []), ("no-cache", plain_dir, ["--no-kv-cache"])):
                _turn(model, conv, first, d, extra + flags, a.n_predict)
                res[mode] = _turn(model, conv, q2, d, extra + flags, a.n_predict)
            if shared is not None:
                res["shared"] = _shared_turns(model, conv, first, q2, shared_dir, extra + shared, a)
            c, p = res["cache"]["timings"], res["no-cache"]["timings"]
            with_cache = c["prompt_eval_ms"] + c["hydrate_ms"]
            row = {"conversation": i, "turn2_prompt_tokens": p["prompt_tokens_evaluated"],
                   "cached_tokens": c["cached_tokens"], "evaluated_with_cache": c["prompt_tokens_evaluated"],
                   "hydrate_ms": c["hydrate_ms"], "prompt_ms_cache": with_cache, "prompt_ms_no_cache":
                   p["prompt_eval_ms"], "saving": 1 - with_cache / p["prompt_eval_ms"],
                   "identical": res["cache"]["token_ids"] == res["no-cache"]["token_ids"]}
            rows.append(row)
            print(f"conversation {i}: turn-2 prompt {row['turn2_prompt_tokens']} tokens; with cache "
                  f"{row['evaluated_with_cache']} evaluated + {row['cached_tokens']} hydrated in "
                  f"{with_cache:.0f} ms (hydrate {row['hydrate_ms']:.0f} ms); without {p['prompt_eval_ms']:.0f} ms; "
                  f"saving {row['saving']:.1%}; {'identical' if row['identical'] else 'DIFFERENT'} output",
                  flush=True)
            if shared is not None:
                t = res["shared"]["timings"]
                ms = t["prompt_eval_ms"] + t["hydrate_ms"]
                row.update(shared_cached_tokens=t["cached_tokens"], shared_hydrate_ms=t["hydrate_ms"],
                           prompt_ms_shared=ms, saving_shared=1 - ms / p["prompt_eval_ms"],
                           identical_shared=res["shared"]["token_ids"] == res["no-cache"]["token_ids"])
                print(f"  shared tier, a fresh replica: {t['prompt_tokens_evaluated']} evaluated + "
                      f"{t['cached_tokens']} from Redis in {ms:.0f} ms (hydrate {t['hydrate_ms']:.0f} ms); "
                      f"saving {row['saving_shared']:.1%} against recomputation, {ms / with_cache:.2f}x the local "
                      f"tier's time; {'identical' if row['identical_shared'] else 'DIFFERENT'} output", flush=True)
    mean = sum(r["saving"] for r in rows) / len(rows)
    print(f"\nmean second-turn prompt-evaluation saving {mean:.1%}; identical output "
          f"{sum(r['identical'] for r in rows)}/{len(rows)}")
    if shared is not None:
        mean_shared = sum(r["saving_shared"] for r in rows) / len(rows)
        print(f"shared tier (a fresh replica): mean saving {mean_shared:.1%}; identical output "
              f"{sum(r['identical_shared'] for r in rows)}/{len(rows)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": os.path.basename(model), "rows": rows, "mean_saving": mean}, f, indent=1)
    return 0
