"""`jllm bench`: decode tok/s, prefill tok/s, and the cost of one batched forward over k+1 new tokens
relative to one decode step (k = 1..max_k) — the number speculative decoding lives on. Prints a table.
"""

from __future__ import annotations

import itertools
import json
import resource
import statistics
import time

import torch

from jllm.catalog import resolve
from jllm.engine import Engine
from jllm.errors import JllmError

# A fixed, varied text so prompt token counts are reproducible (repeated to reach the prompt length).
_FILLER = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
    "def add(a, b):\n    return a + b\n"
    "Speculative decoding drafts several tokens cheaply and verifies them in one batched pass. "
)


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _prompt(eng, n: int) -> list[int]:
    ids = eng.tokenizer.encode(_FILLER * (n // 20 + 2), add_bos=False)
    return ids[:n]


def measure(eng, prompt_tokens: int = 512, decode_tokens: int = 64, max_k: int = 8, repeats: int = 5) -> dict:
    dev = eng.device
    if prompt_tokens + decode_tokens + max_k + 2 > eng.ctx_size:
        raise JllmError(f"bench needs a context of at least {prompt_tokens + decode_tokens + max_k + 2} tokens")
    ids = _prompt(eng, prompt_tokens)

    # prefill: fresh cache, whole prompt, best of 2
    best = float("inf")
    for _ in range(2):
        eng.reset()
        t0 = time.perf_counter()
        logits, _ = eng.prefill(ids)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    prefill_tok_s = len(ids) / best

    # decode: greedy single-token steps after the prompt, each with its argmax (on a GPU the step is
    # asynchronous until its token is read)
    tok = first = int(torch.argmax(logits))
    step_times = []
    for _ in range(decode_tokens):
        t0 = time.perf_counter()
        logits = eng.step(tok)
        tok = int(torch.argmax(logits))
        step_times.append(time.perf_counter() - t0)
    step_s = statistics.median(step_times)
    # on a GPU, greedy decoding chains its steps on the device (jllm.cuda.chain), as generation does: timed
    # over decode_tokens after a warm-up (the chain's graph is captured once per cache)
    chain_s = None
    if eng.target.chains():                 # from the same place as the steps: right after the prompt
        for n in (4, decode_tokens):
            eng.target.rollback(len(ids))
            t0 = time.perf_counter()
            got = list(itertools.islice(eng.target.chain_tokens(first, n), n))
            _sync(dev)
            chain_s = (time.perf_counter() - t0) / len(got)
        eng.target.rollback(len(ids) + decode_tokens)   # where the steps left it, for the verify passes

    # batched forward of k+1 tokens at the same position, relative to one decode step
    base = len(eng.target)
    block = _prompt(eng, max_k + 1)
    ratios = {}
    for k in range(0, max_k + 1):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            eng.target.forward(block[:k + 1])
            _sync(dev)
            times.append(time.perf_counter() - t0)
            eng.target.rollback(base)
        ratios[k] = statistics.median(times)
    one = ratios[0]
    gpu = None
    if dev.type == "cuda":                  # the device's own memory (beside weights_mb): the KV cache, the peak
        cache = eng.target.cache
        gpu = {"kv_mb": cache.nbytes() / 2**20, "kv_positions": cache.max_tokens,
               "peak_mb": torch.cuda.max_memory_allocated(dev) / 2**20}
    return {
        "model": str(eng.gguf.path.name), "precision": eng.precision, "device": str(dev),
        "threads": torch.get_num_threads(), "load_s": eng.load_ms / 1000.0,
        "decode_tok_s": 1.0 / (chain_s or step_s), "decode_ms": (chain_s or step_s) * 1000,
        "decode_step_tok_s": 1.0 / step_s, "prefill_tok_s": prefill_tok_s,
        "prompt_tokens": len(ids), "forward_ms": {k + 1: v * 1000 for k, v in ratios.items()},
        "verify_ratio": {k: ratios[k] / one for k in range(1, max_k + 1)},
        "weights_mb": eng.model.w.nbytes() / 2**20, "peak_rss_mb": _peak_rss_mb(),
        **({"gpu_memory": gpu} if gpu else {}),
    }


def print_table(r: dict) -> None:
    print(f"model {r['model']}  precision {r['precision']}  device {r['device']}  threads {r['threads']}")
    print(f"{'load s':>10} {'decode tok/s':>13} {'prefill tok/s':>14} {'weights MB':>11} {'peak RSS MB':>12}")
    print(f"{r['load_s']:>10.2f} {r['decode_tok_s']:>13.2f} {r['prefill_tok_s']:>14.1f} "
          f"{r['weights_mb']:>11.0f} {r['peak_rss_mb']:>12.0f}")
    if r.get("decode_step_tok_s") and abs(r["decode_step_tok_s"] - r["decode_tok_s"]) > 1e-9:
        print(f"decode {r['decode_tok_s']:.2f} tok/s with greedy steps chained on the device; one step at a time "
              f"(a token read back after each): {r['decode_step_tok_s']:.2f} tok/s")
    if "gpu_memory" in r:
        g = r["gpu_memory"]
        print(f"GPU memory: weights {r['weights_mb']:.0f} MB, KV cache {g['kv_mb']:.0f} MB ({g['kv_positions']} "
              f"positions), peak allocated {g['peak_mb']:.0f} MB (the rest of it: scratch)")
    print(f"\n{'k':>3} {'tokens':>7} {'forward ms':>11} {'x decode step':>14}")
    for k, ratio in r["verify_ratio"].items():
        print(f"{k:>3} {k + 1:>7} {r['forward_ms'][k + 1]:>11.2f} {ratio:>14.2f}")


def llamacpp_bench(bin_dir: str, model_path: str, threads: int, prompt_tokens: int, decode_tokens: int) -> dict:
    """Run llama.cpp's llama-bench on the same file (the side-by-side baseline); returns tok/s."""
    import subprocess
    from pathlib import Path

    exe = Path(bin_dir) / "llama-bench"
    if not exe.exists():
        raise JllmError(f"--llamacpp: {exe} not found (build it with ../shared/tools/build_llamacpp.sh)")
    cmd = [str(exe), "-m", model_path, "-t", str(threads), "-p", str(prompt_tokens), "-n", str(decode_tokens),
           "-r", "2", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise JllmError(f"llama-bench failed: {out.stderr.strip().splitlines()[-1:] or out.returncode}")
    res = {}
    for row in json.loads(out.stdout):
        key = "prefill_tok_s" if row.get("n_prompt", 0) > 0 else "decode_tok_s"
        res[key] = float(row["avg_ts"])
    return res


def perplexity(eng, text: str, max_tokens: int = 1024, chunk: int = 256) -> tuple[float, int]:
    """Perplexity of the model on the first max_tokens tokens of text, one context, in chunks."""
    ids = eng.tokenizer.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise JllmError("perplexity needs a text of at least two tokens")
    eng.reset()
    nll, n = 0.0, 0
    for s in range(0, len(ids) - 1, chunk):
        part = ids[s:s + chunk]
        logp = torch.log_softmax(eng.target.forward(part).float(), -1)
        targets = torch.tensor(ids[s + 1:s + 1 + len(part)], device=logp.device)
        logp = logp[:len(targets)]
        nll -= logp.gather(1, targets[:, None]).sum().item()
        n += len(targets)
    return float(torch.exp(torch.tensor(nll / n))), n


def run_bench(a) -> int:
    ctx = max(a.ctx_size, a.prompt_tokens + a.decode_tokens + a.max_k + 16)
    eng = Engine(str(resolve(a.model)), device=a.device, precision=a.precision, ctx_size=ctx, threads=a.threads)
    if a.perplexity:
        with open(a.perplexity, encoding="utf-8") as f:
            ppl, n = perplexity(eng, f.read(), max_tokens=min(a.ppl_tokens, ctx - 1))
        print(f"perplexity {ppl:.4f} over {n} tokens of {a.perplexity} ({eng.precision})")
        return 0
    r = measure(eng, a.prompt_tokens, a.decode_tokens, a.max_k, a.repeats)
    print_table(r)
    if a.llamacpp:
        base = llamacpp_bench(a.llamacpp, str(eng.gguf.path), torch.get_num_threads(), a.prompt_tokens,
                              a.decode_tokens)
        r["llamacpp"] = base
        print(f"\nllama.cpp (llama-bench, same file, same threads, measured just now)")
        print(f"{'':>10} {'jllm':>10} {'llama.cpp':>10} {'ratio':>7}")
        for key, label in (("decode_tok_s", "decode"), ("prefill_tok_s", "prefill")):
            print(f"{label:>10} {r[key]:>10.2f} {base[key]:>10.2f} {r[key] / base[key]:>7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0
