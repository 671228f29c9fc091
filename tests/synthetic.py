"""Tiny synthetic GGUF models for tests, each with its own oracle.

`write_tiny_model(path, arch)` builds a small Hugging Face `transformers` model with random weights, writes it
to GGUF the way llama.cpp's `convert_hf_to_gguf.py` writes that architecture, and returns the HF model, whose
weights are then replaced by exactly what the file holds (dequantized), so that jllm and the oracle compute
the same function and may differ only by float rounding.

Tests import it as `from synthetic import write_tiny_model`: pytest puts tests/ on sys.path because tests/
has a conftest.py and no __init__.py (the default "prepend" import mode). Do not add tests/__init__.py.

llama.cpp conventions reproduced here (convert_hf_to_gguf.py, and llama.cpp's loader where the file is silent):
- llama: Q and K weight rows are permuted per head from HF's "rotate halves" order to interleaved pairs,
  `w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2)` (n_head = the KV head count for K), so that
  llama.cpp applies plain (adjacent-pair) RoPE; qwen2, qwen3 and gemma3 are stored as in HF and use NEOX RoPE.
  llama also writes `llama.vocab_size` and `llama.rope.dimension_count`.
- gemma3: RMSNorm computes x * (1 + w); every `*norm.weight` (q/k norms included) is stored as 1 + w.
  Embeddings are multiplied by sqrt(hidden) (not stored). llama.cpp scales queries by 1/sqrt(head_dim) (27B
  excepted), so GGUF cannot carry `query_pre_attn_scalar`: it must equal head_dim here. The sliding-window
  layer pattern is not in the file either: llama.cpp fixes it at 6, layer i is global iff (i + 1) % 6 == 0,
  so gemma3 gets 6 layers (0-4 sliding, 5 global). Global layers use `gemma3.rope.freq_base`, sliding layers
  10000 (llama.cpp's constant; recent converters also write it as `gemma3.rope.freq_base_swa`).
  A sliding layer at position p sees positions p - window + 1 .. p (HF and llama.cpp agree).
- 1-D tensors (norms, biases) and `*_norm.weight` stay F32; other 2-D weights take the requested type.
- Untied models carry `output.weight`; tied ones do not (that is how both llama.cpp and jllm tell).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from jllm.tokenizer.bpe import BYTE_CHARS

# ---------------------------------------------------------------------------------------------- tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Merges over GPT-2 byte-level symbols ("Ġ" is the space byte); each line joins two existing tokens.
MERGES = [
    "Ġ t", "h e", "i n", "Ġ a", "e r", "o n", "r e", "Ġt he", "a n", "e n", "o r", "Ġ s", "e d", "Ġ w",
    "i s", "a t", "i t", "Ġ o", "in g", "Ġ c", "Ġ f", "Ġ b", "Ġ i", "l l", "o u", "Ġ p", "e s", "Ġ m",
    "Ġ d", "Ġa n", "Ġan d", "Ġ h", "l e", "Ġt o", "Ġo f", "H e", "He ll", "Hell o", "Ġw or", "Ġwor l",
    "Ġworl d",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode map: byte b -> a printable character, listed in byte order 0..255."""
    return list(BYTE_CHARS)


def tiny_vocab(specials_first: bool) -> tuple[list[str], list[int]]:
    """(tokens, token types): 256 byte symbols, one token per merge, 3 control tokens; 300 in all."""
    normal = byte_symbols() + [m.replace(" ", "") for m in MERGES]
    if specials_first:
        tokens = SPECIAL_TOKENS + normal
        types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * len(normal)
    else:
        tokens = normal + SPECIAL_TOKENS
        types = [gguf.TokenType.NORMAL] * len(normal) + [gguf.TokenType.CONTROL] * 3
    assert len(set(tokens)) == len(tokens)
    return tokens, [int(t) for t in types]


VOCAB_SIZE = 256 + len(MERGES) + len(SPECIAL_TOKENS)

# ---------------------------------------------------------------------------------------------- architectures

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


@dataclass(frozen=True)
class ArchSpec:
    hf_class: str               # transformers model class
    hf_config: str              # transformers config class
    config: dict                # config kwargs (overridable)
    tokenizer_pre: str          # tokenizer.ggml.pre
    specials_first: bool        # SmolLM puts its control tokens at ids 0-2, Qwen at the end of the vocabulary
    bos: str
    eos: str
    add_bos: bool
    gemma_norms: bool = False   # RMSNorm weight w means 1 + w; GGUF stores 1 + w


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        "LlamaForCausalLM", "LlamaConfig",
        dict(_COMMON, num_hidden_layers=2, head_dim=16, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
        tokenizer_pre="smollm", specials_first=True, bos="<|im_start|>", eos="<|im_end|>", add_bos=False),
    "qwen2": ArchSpec(
        "Qwen2ForCausalLM", "Qwen2Config",
        dict(_COMMON, num_hidden_layers=2, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        tokenizer_pre="qwen2", specials_first=False, bos="<|endoftext|>", eos="<|im_end|>", add_bos=False),
    "qwen3": ArchSpec(
        "Qwen3ForCausalLM", "Qwen3Config",
        dict(_COMMON, num_hidden_layers=3, head_dim=16, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        tokenizer_pre="qwen2", specials_first=False, bos="<|endoftext|>", eos="<|im_end|>", add_bos=False),
    "gemma3": ArchSpec(
        "Gemma3ForCausalLM", "Gemma3TextConfig",
        dict(_COMMON, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
             tie_word_embeddings=True, final_logit_softcapping=None, attn_logit_softcapping=None,
             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        tokenizer_pre="qwen2", specials_first=False, bos="<|endoftext|>", eos="<|im_end|>", add_bos=True,
        gemma_norms=True),
}

# HF parameter name inside model.layers.N -> GGUF name inside blk.N (gemma3's "post_attention_layernorm" is a
# true post-norm; elsewhere it is the pre-MLP norm, hence two tables).
_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}

QUANTIZABLE = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
               GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
               GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1)  # what gguf-py 0.19 can quantize


def gguf_name(arch: str, hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    prefix, layer, rest = hf_name.split(".", 3)[1:]
    assert prefix == "layers", hf_name
    table = _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
    return f"blk.{layer}.{table[rest]}"


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-halves row order -> llama.cpp interleaved pairs, per head (rows = n_head * head_dim)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

# ---------------------------------------------------------------------------------------------- the oracle


@dataclass
class HFReference:
    """The HF model whose weights equal the GGUF file's (dequantized), and what a test needs to drive jllm."""
    path: Path
    arch: str
    qtype: GGMLQuantizationType
    model: torch.nn.Module               # eval mode, float32, eager attention
    tokens: list[str]                    # the GGUF vocabulary (GPT-2 byte-level symbols)
    special_ids: dict[str, int] = field(default_factory=dict)
    bos_id: int = -1
    eos_id: int = -1

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """HF forward over the whole sequence at positions 0..T-1: [T, vocab] float32."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        return self.model(input_ids=ids, use_cache=False).logits[0].float()


def _build_hf_model(spec: ArchSpec, seed: int, overrides: dict):
    import transformers

    kwargs = dict(spec.config, **overrides)
    config = getattr(transformers, spec.hf_config)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, spec.hf_class)(config).float().eval()
    _randomize(model, spec, seed)
    return model


@torch.no_grad()
def _randomize(model: torch.nn.Module, spec: ArchSpec, seed: int) -> None:
    """Weights that keep activations O(1): linear std 1/sqrt(fan_in), embeddings std 0.5 (logits of a few units),
    norms near 1 (gemma: near 0, it adds 1), biases std 0.1."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            value = 0.1 * randn(p.shape) + (0.0 if spec.gemma_norms else 1.0)
        elif name.endswith(".bias"):
            value = 0.1 * randn(p.shape)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            value = 0.5 * randn(p.shape)
        else:
            value = randn(p.shape) / math.sqrt(p.shape[1])
        p.copy_(value)


def _file_type(qtype: GGMLQuantizationType) -> gguf.LlamaFileType:
    if qtype == GGMLQuantizationType.F32:
        return gguf.LlamaFileType.ALL_F32
    return gguf.LlamaFileType[f"MOSTLY_{qtype.name}"]

# ---------------------------------------------------------------------------------------------- the writer


def write_tiny_model(path, arch: str, qtype: GGMLQuantizationType = GGMLQuantizationType.F32, seed: int = 0,
                     **overrides) -> HFReference:
    """Write a tiny random `arch` model ("llama", "qwen2", "qwen3", "gemma3") as GGUF at `path`; 2-D weights
    in `qtype`. `overrides` go to the HF config (e.g. tie_word_embeddings=False, num_hidden_layers=3)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (have {', '.join(ARCHS)})")
    qtype = GGMLQuantizationType(qtype)
    if qtype not in QUANTIZABLE:
        raise ValueError(f"gguf-py cannot quantize to {qtype.name}; use one of "
                         f"{', '.join(q.name for q in QUANTIZABLE)}")
    spec = ARCHS[arch]
    path = Path(path)
    tokens, token_types = tiny_vocab(spec.specials_first)
    special_ids = {t: tokens.index(t) for t in SPECIAL_TOKENS}
    overrides = dict(dict(bos_token_id=special_ids[spec.bos], eos_token_id=special_ids[spec.eos],
                          pad_token_id=special_ids["<|endoftext|>"]), **overrides)
    model = _build_hf_model(spec, seed, overrides)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tied = bool(cfg.tie_word_embeddings)

    writer = gguf.GGUFWriter(path, arch)
    _write_metadata(writer, arch, spec, cfg, head_dim, qtype)
    _write_tokenizer(writer, spec, tokens, token_types, special_ids)

    params = dict(model.named_parameters())  # a tied lm_head is not listed separately
    if tied:
        assert "lm_head.weight" not in params and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        for hf_name in _tensor_order(params):
            p = params[hf_name]
            name = gguf_name(arch, hf_name)
            data = p.detach().numpy().astype(np.float32)

            permute_heads = None
            if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
                permute_heads = cfg.num_attention_heads
            elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
                permute_heads = cfg.num_key_value_heads
            if permute_heads:
                data = llama_permute(data, permute_heads)
            shift = 1.0 if spec.gemma_norms and hf_name.endswith("norm.weight") else 0.0
            data = data + np.float32(shift)

            t = qtype if data.ndim == 2 and not name.endswith("_norm.weight") else GGMLQuantizationType.F32
            stored = gguf.quants.quantize(np.ascontiguousarray(data), t)
            writer.add_tensor(name, stored, raw_dtype=t)

            # Give the oracle exactly what the file holds: dequantize and undo the conventions.
            # (x + 1) - 1 in float32 is exact for the stored 1 + w, so HF's 1 + w' equals the stored value.
            back = gguf.quants.dequantize(stored, t).reshape(data.shape).astype(np.float32) - np.float32(shift)
            if permute_heads:
                back = llama_unpermute(back, permute_heads)
            p.copy_(torch.from_numpy(np.ascontiguousarray(back)))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return HFReference(path=path, arch=arch, qtype=qtype, model=model, tokens=tokens, special_ids=special_ids,
                       bos_id=special_ids[spec.bos], eos_id=special_ids[spec.eos])


def _tensor_order(params: dict) -> list[str]:
    """token_embd, the blocks in order, output_norm, output: the order converted files usually have."""
    def key(name: str):
        if name == "model.embed_tokens.weight":
            return (0, 0, name)
        if name.startswith("model.layers."):
            return (1, int(name.split(".")[2]), name)
        return (2, 0 if name == "model.norm.weight" else 1, name)
    return sorted(params, key=key)


def _write_metadata(w: gguf.GGUFWriter, arch: str, spec: ArchSpec, cfg, head_dim: int,
                    qtype: GGMLQuantizationType) -> None:
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None) is not None:  # the converter writes these only when config has head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        if cfg.query_pre_attn_scalar != head_dim:
            raise ValueError("gemma3: GGUF has no key for query_pre_attn_scalar; llama.cpp scales queries by "
                             f"1/sqrt(head_dim), so it must equal head_dim ({head_dim})")
        if list(cfg.layer_types) != ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                     for i in range(cfg.num_hidden_layers)]:
            raise ValueError("gemma3: llama.cpp fixes the sliding-window pattern at 6 (every 6th layer global)")
        w.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_file_type(_file_type(qtype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_tokenizer(w: gguf.GGUFWriter, spec: ArchSpec, tokens: list[str], types: list[int],
                     special_ids: dict[str, int]) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(spec.tokenizer_pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(special_ids[spec.bos])
    w.add_eos_token_id(special_ids[spec.eos])
    w.add_pad_token_id(special_ids["<|endoftext|>"])
    w.add_add_bos_token(spec.add_bos)
    w.add_chat_template(CHATML_TEMPLATE)
