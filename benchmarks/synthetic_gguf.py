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
    # arch, layers, hidden, ffn, heads, kv heads, head size, vocab, tied
    "qwen2.5-1.5b": ("qwen2", 28, 1536, 8960, 12, 2, 128, 151936, False),
    "qwen2.5-0.5b": ("qwen2", 24, 896, 4864, 14, 2, 64, 151936, True),
    "qwen3-4b": ("qwen3", 36, 2560, 9728, 32, 8, 128, 151936, True),      # the origin document's target
    "tiny": ("qwen2", 2, 64, 128, 4, 2, 16, 512, False),
    "tiny-k": ("qwen2", 2, 256, 512, 4, 2, 64, 512, False),           # the smallest the K-quants take (tests)
    "tiny-k2": ("qwen2", 2, 512, 2304, 8, 2, 64, 512, False),         # rows of several super-blocks (tests)
}


# --dtype of random blocks -> (the block type, the std of its codes)
T = gguf.GGMLQuantizationType
BLOCKS = {"q4_0": (T.Q4_0, 4.6), "q8_0": (T.Q8_0, 74.0)}


def q4_k_m_type(name: str, layer: int) -> T:
    """The block type llama.cpp's Q4_K_M gives a tensor (as in the real Qwen2.5-Coder files): Q6_K for the
    output (the embedding when it is tied to it) and for attn_v and ffn_down in every other layer, Q4_K for the
    rest."""
    if name == "output.weight" or (name.endswith(("attn_v.weight", "ffn_down.weight")) and layer % 2 == 0):
        return T.Q6_K
    return T.Q4_K


def k_blocks(rng: np.random.Generator, kind: T, rows: int, cols: int, std: float) -> np.ndarray:
    """Random Q4_K or Q6_K super-blocks whose values have about `std` and mean about 0."""
    values, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    if kind == T.Q4_K:           # value = d * scale * q - dmin * min; scale, min ~ 31.5, q ~ 7.5 +- 4.6
        d = std / (31.5 * 4.6)
        raw[:, :, :4] = np.array([d, 7.5 * d], dtype=np.float16).view(np.uint8)
    else:                        # Q6_K: value = d * scale * (q - 32); int8 scales ~ +-74, q - 32 ~ +-18.5
        raw[:, :, 208:210] = np.full((rows, cols // values, 1), std / (74 * 18.5), dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write(path: str, shape: str, dtype: str = "f16", seed: int = 0) -> None:
    arch, n_layers, hidden, ffn, heads, kv_heads, head_dim, vocab, tied = SHAPES[shape]
    q_dim = heads * head_dim
    if dtype == "q4_k_m" and (hidden % 256 or ffn % 256):
        raise SystemExit(f"--dtype q4_k_m needs sizes that are multiples of 256 (shape {shape}: {hidden}, {ffn})")
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

    def add(name: str, rows: int, cols: int, std: float, layer: int = 0) -> None:
        if dtype == "q4_k_m":
            kind = q4_k_m_type("output.weight" if tied and name == "token_embd.weight" else name, layer)
            w.add_tensor(name, k_blocks(rng, kind, rows, cols, std), raw_dtype=kind)
        elif blocks is None:
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
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # one merge (two spaces), its token first among the padding: llama.cpp refuses a BPE vocabulary without merges
    tokens = list(BYTE_CHARS) + [BYTE_CHARS[32] * 2] + [f"[PAD{i}]" for i in range(vocab - 257 - len(specials))] \
        + specials
    types = [1] * (vocab - len(specials)) + [3] * len(specials)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{BYTE_CHARS[32]} {BYTE_CHARS[32]}"])
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
        add(p + "attn_q.weight", q_dim, hidden, std, i)
        add(p + "attn_k.weight", kv_heads * head_dim, hidden, std, i)
        add(p + "attn_v.weight", kv_heads * head_dim, hidden, std, i)
        if arch == "qwen2":
            w.add_tensor(p + "attn_q.bias", np.zeros(q_dim, dtype=np.float32))
            w.add_tensor(p + "attn_k.bias", np.zeros(kv_heads * head_dim, dtype=np.float32))
            w.add_tensor(p + "attn_v.bias", np.zeros(kv_heads * head_dim, dtype=np.float32))
        else:                                                   # qwen3: per-head norms of q and k, no biases
            w.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        add(p + "attn_output.weight", hidden, q_dim, std, i)
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        add(p + "ffn_gate.weight", ffn, hidden, std, i)
        add(p + "ffn_up.weight", ffn, hidden, std, i)
        add(p + "ffn_down.weight", hidden, ffn, 1.0 / np.sqrt(ffn), i)
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
    ap.add_argument("--dtype", default="f16", choices=["f16", "f32", *BLOCKS, "q4_k_m"],
                    help="q4_0 / q8_0: random blocks of that type; q4_k_m: Q4_K and Q6_K as llama.cpp's Q4_K_M "
                    "mixes them (for speed on the GPU's blocks precision)")
    a = ap.parse_args()
    write(a.out, a.shape, a.dtype)


if __name__ == "__main__":
    main()
