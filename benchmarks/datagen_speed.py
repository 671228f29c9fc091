"""Reply tokens per second of the training-data maker: jllm.train.batched against transformers' `generate`,
same model, same prompts, side by side in one run. On a GPU machine:

    python benchmarks/datagen_speed.py -m TARGET.gguf            # the real target (jllm.train.target)
    python benchmarks/datagen_speed.py --synthetic               # random weights of Qwen2.5-1.5B's shapes

Random weights never emit an end-of-turn token, so every row runs the full --new tokens: the figure is the
decoder's rate with no early stops (real replies stop early, and a batch then runs part-empty). `agree`: the
share of rows whose first --hf-new greedy tokens are generate's (bf16 on both sides: near-ties may part them,
which random weights have many of; the real target few).
"""

from __future__ import annotations

import argparse
import time

import torch

from jllm.train.batched import BatchedDecoder


def synthetic_model(device: str):
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                   num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                   max_position_embeddings=32768, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    return model.eval()


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="a GGUF target")
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--batch", type=int, nargs="+", default=[128, 384])
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    ap.add_argument("--new", type=int, default=256, help="reply tokens per row")
    ap.add_argument("--hf-new", type=int, default=64, help="reply tokens per row for generate (slower; 0: skip it)")
    a = ap.parse_args()
    if a.model:
        from jllm.train.target import load_target

        model = load_target(a.model, "cuda").model
    else:
        model = synthetic_model("cuda")
    vocab = model.config.vocab_size
    print(f"{'decoder':<12} {'batch':>5} {'prompt':>6} {'new':>5} {'s':>7} {'tok/s':>9} {'agree':>6}")
    for B in a.batch:
        g = torch.Generator().manual_seed(B)
        prompts = torch.randint(10, vocab - 10, (B, a.prompt), generator=g).tolist()
        dec = BatchedDecoder(model, B, a.prompt + a.new)
        dec.generate(prompts[:8], 4, {-1})                            # capture the step graphs, warm up
        greedy = None
        for sample in (False, True):
            out, s = timed(lambda: dec.generate(prompts, a.new, {-1}, sample=sample, temperature=0.8,
                                                top_p=0.95))
            greedy = greedy or out
            n = sum(len(r) for r in out)
            print(f"{'batched' + (' T0.8' if sample else ''):<12} {B:>5} {a.prompt:>6} {a.new:>5} {s:>7.2f} "
                  f"{n / s:>9.0f}")
        del dec
        torch.cuda.empty_cache()
        if not a.hf_new:
            continue
        ids = torch.tensor(prompts, device="cuda")
        out, s = timed(lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                              max_new_tokens=a.hf_new, min_new_tokens=a.hf_new,
                                              do_sample=False, pad_token_id=0))
        n = (out.shape[1] - a.prompt) * B
        hf = out[:, a.prompt:].tolist()
        agree = sum(g[:a.hf_new] == h for g, h in zip(greedy, hf)) / B
        print(f"{'hf generate':<12} {B:>5} {a.prompt:>6} {a.hf_new:>5} {s:>7.2f} {n / s:>9.0f} {agree:>6.2f}")
        del out, ids
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
