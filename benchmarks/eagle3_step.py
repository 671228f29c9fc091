"""The cost of an EAGLE-3 head's draft step against the target's decode step, on the CPU:
`python benchmarks/eagle3_step.py [-m qwen2.5-coder-1.5b] [--draft-vocab 32000] [--context 512]`.

The head is synthetic (random F16 weights, written to a temporary eagle3 GGUF) with the real shapes a head
for the target has: its hidden size, heads and FFN width, one layer, a draft vocabulary of --draft-vocab rows
mapped by d2t; it is loaded the way jllm loads a head (native4: 4-bit tiles). Both are timed at the same
context, in the order of a speculative round (target step, head prefill over the accepted rows, head steps), so
the head's weights are as cold as they will be in use and load from other processes hits both alike;
medians and minima (the uncontended cost, where other processes share the cores) are printed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from jllm.eagle3 import format as fmt
from jllm.eagle3.head import Eagle3Head
from jllm.model.loader import load_model


def write_synthetic_head(path: Path, target_cfg, draft_vocab: int, seed: int = 0) -> None:
    """A random head in llama.cpp's eagle3 layout for a target of this config (no tokenizer metadata)."""
    c = target_cfg
    rng = np.random.default_rng(seed)
    D, Dt, F, H, Hk, hd = c.hidden, c.hidden, c.ffn, c.n_heads, c.n_kv_heads, c.head_dim

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)

    w = gguf.GGUFWriter(str(path), fmt.ARCH)
    w.add_block_count(1)
    w.add_context_length(c.context_length)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hk)
    w.add_rope_freq_base(c.rope_base)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_array(fmt.KEY_TARGET_LAYERS, fmt.default_target_layers(c.n_layers))
    w.add_uint32(fmt.KEY_TARGET_HIDDEN, Dt)
    ones = np.ones(D, dtype=np.float32)
    w.add_tensor(fmt.FC, mat(D, 3 * Dt))
    for name in (fmt.ATTN_NORM, fmt.HIDDEN_NORM, fmt.FFN_NORM, fmt.OUTPUT_NORM):
        w.add_tensor(name, ones)
    w.add_tensor(fmt.ATTN_Q, mat(H * hd, 2 * D))
    w.add_tensor(fmt.ATTN_K, mat(Hk * hd, 2 * D))
    w.add_tensor(fmt.ATTN_V, mat(Hk * hd, 2 * D))
    w.add_tensor(fmt.ATTN_OUT, mat(D, H * hd))
    w.add_tensor(fmt.FFN_GATE, mat(F, D))
    w.add_tensor(fmt.FFN_UP, mat(F, D))
    w.add_tensor(fmt.FFN_DOWN, mat(D, F))
    w.add_tensor(fmt.OUTPUT, mat(draft_vocab, D))
    w.add_tensor(fmt.D2T, np.arange(draft_vocab, dtype=np.int64), raw_dtype=fmt.D2T_TYPE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _ms(f, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="target: alias or GGUF path")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--context", type=int, default=512, help="tokens in both caches before timing")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=3, help="head steps a round")
    ap.add_argument("--accepted", type=int, default=3, help="rows per prefill (n accepted + 1)")
    ap.add_argument("--target-precision", default="native",
                    help="native4 for a synthetic F16 target (benchmarks/synthetic_gguf.py), so that its "
                         "matrices are 4-bit as a Q4_K_M file's mostly are")
    a = ap.parse_args()

    path = Path(a.model)
    if not path.exists():
        from jllm.catalog import resolve

        path = resolve(a.model)
    target = load_model(path, precision=a.target_precision, max_positions=a.context + 4096)
    c = target.cfg
    with tempfile.TemporaryDirectory() as tmp:
        head_path = Path(tmp) / "head.gguf"
        write_synthetic_head(head_path, c, a.draft_vocab)
        head = Eagle3Head.load(head_path, target, use_cache=False)
        cache = target.new_cache(a.context + 4096)
        tokens = torch.randint(0, 1000, (a.context,))
        _, hidden = target.forward(tokens, cache, last_only=True, capture=head.target_layers)
        s = head.prefill(hidden, tokens.roll(-1))
        base_t, base_h = cache.length, head.length
        tok = torch.tensor([42])

        def target_step():
            target.forward(tok, cache, last_only=True)
            cache.truncate(base_t)

        def head_step():
            head.step(42, s.state)
            head.truncate(base_h)

        rows = hidden[-a.accepted:]
        ids = tokens[-a.accepted:]

        def head_prefill():
            head.prefill(rows, ids)
            head.truncate(base_h)

        # the order of a speculative round: the target's pass (which streams ~1 GB through the caches), the
        # head's prefill over the accepted rows, then its draft steps, so the head starts cold every round
        t_ms, h_ms, p_ms = [], [], []
        for r in range(a.rounds + 2):
            t_, p_, h_ = _ms(target_step, 1), _ms(head_prefill, 1), _ms(head_step, a.steps)
            if r >= 2:                                                    # two rounds of warm-up
                t_ms += t_
                p_ms += p_
                h_ms += h_
    (t, h, p), (t0, h0, p0) = ([f(x) for x in (t_ms, h_ms, p_ms)] for f in (statistics.median, min))
    mb = sum(m.nbytes() for m in (head.qkv, head.o, head.gate_up, head.down, head.output)) / 1e6
    print(f"target {path.name} ({a.target_precision}, {target.w.nbytes() / 1e6:.0f} MB read a step), "
          f"context {a.context}, head: hidden {c.hidden}, ffn {c.ffn}, heads {c.n_heads}/"
          f"{c.n_kv_heads}, draft vocab {a.draft_vocab}, {head.precision} ({mb:.1f} MB read a step), "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'':28}{'median ms':>10}{'/ target':>10}{'min ms':>10}{'/ target':>10}")
    for label, m, m0 in (("target decode step", t, t0), ("head step", h, h0),
                         (f"head prefill, {a.accepted} rows", p, p0)):
        print(f"{label:28}{m:10.3f}{m / t:10.3f}{m0:10.3f}{m0 / t0:10.3f}")


if __name__ == "__main__":
    main()
