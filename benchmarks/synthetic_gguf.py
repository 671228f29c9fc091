"""Write a GGUF with the real shapes of a model and random weights, for speed measurements where the real
file cannot travel (the borrowed GPU machine): `python benchmarks/synthetic_gguf.py OUT.gguf --shape qwen2.5-1.5b`.

The tokenizer is byte-level BPE with no merges, padded with unused tokens to the real vocabulary size, plus
ChatML control tokens, so the whole engine (CLI, bench) loads it. Weights are F16 (or F32) normal noise
scaled so activations stay finite; the text it produces is meaningless, the time it takes is not.
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np

from jllm.tokenizer.bpe import BYTE_CHARS

SHAPES = {
    # arch, layers, hidden, ffn, heads, kv heads, vocab, tied
    "qwen2.5-1.5b": ("qwen2", 28, 1536, 8960, 12, 2, 151936, False),
    "qwen2.5-0.5b": ("qwen2", 24, 896, 4864, 14, 2, 151936, True),
    "tiny": ("qwen2", 2, 64, 128, 4, 2, 512, False),
}


# --dtype of random blocks -> (the block type, the std of its codes)
BLOCKS = {"q4_0": (gguf.GGMLQuantizationType.Q4_0, 4.6), "q8_0": (gguf.GGMLQuantizationType.Q8_0, 74.0)}


def write(path: str, shape: str, dtype: str = "f16", seed: int = 0) -> None:
    arch, n_layers, hidden, ffn, heads, kv_heads, vocab, tied = SHAPES[shape]
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    np_dtype = np.float16 if dtype == "f16" else np.float32
    blocks = BLOCKS.get(dtype)

    def mat(rows: int, cols: int, std: float) -> np.ndarray:
        if blocks is None:
            return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np_dtype)
        # random codes of a 32-value block type, each block's f16 scale set for about `std` (a speed figure
        # needs the type's bytes and layout, not trained values)
        kind, code_std = blocks
        values, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
        raw[:, :, :2] = np.full((rows, cols // values, 1), std / code_std, dtype=np.float16).view(np.uint8)
        return raw.reshape(rows, -1)

    def add(name: str, rows: int, cols: int, std: float) -> None:
        if blocks is None:
            w.add_tensor(name, mat(rows, cols, std))
        else:
            w.add_tensor(name, mat(rows, cols, std), raw_dtype=blocks[0])

    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"synthetic {shape}")
    w.add_block_count(n_layers)
    w.add_context_length(32768)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = list(BYTE_CHARS) + [f"[PAD{i}]" for i in range(vocab - 256 - len(specials))] + specials
    types = [1] * (vocab - len(specials)) + [3] * len(specials)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([])
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    std = 1.0 / np.sqrt(hidden)
    add("token_embd.weight", vocab, hidden, 1.0)
    for i in range(n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        add(p + "attn_q.weight", hidden, hidden, std)
        add(p + "attn_k.weight", kv_heads * head_dim, hidden, std)
        add(p + "attn_v.weight", kv_heads * head_dim, hidden, std)
        w.add_tensor(p + "attn_q.bias", np.zeros(hidden, dtype=np.float32))
        w.add_tensor(p + "attn_k.bias", np.zeros(kv_heads * head_dim, dtype=np.float32))
        w.add_tensor(p + "attn_v.bias", np.zeros(kv_heads * head_dim, dtype=np.float32))
        add(p + "attn_output.weight", hidden, hidden, std)
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        add(p + "ffn_gate.weight", ffn, hidden, std)
        add(p + "ffn_up.weight", ffn, hidden, std)
        add(p + "ffn_down.weight", hidden, ffn, 1.0 / np.sqrt(ffn))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    if not tied:
        add("output.weight", vocab, hidden, std)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES))
    ap.add_argument("--dtype", default="f16", choices=["f16", "f32", *BLOCKS],
                    help="q4_0 / q8_0: random blocks of that type (for speed on the GPU's blocks precision)")
    a = ap.parse_args()
    write(a.out, a.shape, a.dtype)


if __name__ == "__main__":
    main()
