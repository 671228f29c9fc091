"""Model hyper-parameters from GGUF metadata, with architecture differences kept as data (one table).

Every supported architecture runs through the same transformer (`transformer.py`); what differs between
llama, qwen2, qwen3 and gemma3 is the row of flags below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from jllm.errors import JllmError


@dataclass(frozen=True)
class ArchTraits:
    rope_neox: bool            # rotate halves (NEOX) instead of adjacent pairs (llama.cpp's GGUF permutes Q/K for llama)
    qk_norm: bool              # RMSNorm over each head of q and k before RoPE
    sandwich_norm: bool        # extra RMSNorm after attention and after the MLP (gemma3)
    gelu: bool                 # GeGLU (tanh-approximate GELU) instead of SwiGLU
    embed_scale: bool          # multiply embeddings by sqrt(hidden size)
    sliding_window_pattern: int = 0   # every Nth layer is global, the others use the sliding window (0: none)


ARCHS: dict[str, ArchTraits] = {
    "llama": ArchTraits(rope_neox=False, qk_norm=False, sandwich_norm=False, gelu=False, embed_scale=False),
    "qwen2": ArchTraits(rope_neox=True, qk_norm=False, sandwich_norm=False, gelu=False, embed_scale=False),
    "qwen3": ArchTraits(rope_neox=True, qk_norm=True, sandwich_norm=False, gelu=False, embed_scale=False),
    "gemma3": ArchTraits(rope_neox=True, qk_norm=True, sandwich_norm=True, gelu=True, embed_scale=True,
                         sliding_window_pattern=6),
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    traits: ArchTraits
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_scale: float = 1.0            # linear position scaling for global layers
    rope_base_local: float = 10000.0   # gemma3's sliding-window layers
    sliding_window: int = 0
    attn_scale: float = 0.0
    tied_embeddings: bool = False
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def is_sliding(self, layer: int) -> bool:
        p = self.traits.sliding_window_pattern
        return bool(p and self.sliding_window and (layer + 1) % p != 0)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def config_from_gguf(metadata: dict[str, Any], tensor_names: set[str], source: str = "model") -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch == "eagle3":
        raise JllmError(f"{source} is an EAGLE-3 draft head, not a model: give it with -md, beside its target "
                        f"model with -m")
    if arch not in ARCHS:
        raise JllmError(f"{source}: architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})")

    def get(key: str, default: Any = None) -> Any:
        v = metadata.get(f"{arch}.{key}", default)
        if v is None:
            raise JllmError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return v

    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    n_kv = int(n_kv[0] if isinstance(n_kv, list) else n_kv)
    n_layers = int(get("block_count"))
    if min(hidden, n_heads, n_kv, n_layers) < 1 or n_heads % n_kv:
        raise JllmError(f"{source}: GGUF metadata is inconsistent (embedding_length {hidden}, head_count "
                        f"{n_heads}, head_count_kv {n_kv}, block_count {n_layers})")
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // n_heads))
    ffn = get("feed_forward_length")
    ffn = int(ffn[0] if isinstance(ffn, list) else ffn)
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = int(metadata.get(f"{arch}.vocab_size", len(tokens) if tokens else 0))
    if not vocab:
        raise JllmError(f"{source}: cannot tell the vocabulary size (no tokenizer.ggml.tokens)")
    traits = ARCHS[arch]
    scale = 1.0
    if metadata.get(f"{arch}.rope.scaling.type") == "linear":
        scale = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    return ModelConfig(
        arch=arch,
        traits=traits,
        n_layers=n_layers,
        hidden=hidden,
        ffn=ffn,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        context_length=int(get("context_length", 4096)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_dim=int(metadata.get(f"{arch}.rope.dimension_count", head_dim)),
        rope_scale=scale,
        sliding_window=int(metadata.get(f"{arch}.attention.sliding_window", 0)) if traits.sliding_window_pattern else 0,
        attn_scale=1.0 / math.sqrt(head_dim),
        tied_embeddings="output.weight" not in tensor_names,
        name=str(metadata.get("general.name", "")),
    )


def check_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str = "model") -> None:
    """That the tensors have the shapes the metadata implies ([rows, columns] = [out, in] features)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    want = {"token_embd.weight": (None, cfg.hidden)}
    for i in range(cfg.n_layers):
        want.update({f"blk.{i}.attn_q.weight": (q, cfg.hidden), f"blk.{i}.attn_k.weight": (kv, cfg.hidden),
                     f"blk.{i}.attn_v.weight": (kv, cfg.hidden), f"blk.{i}.attn_output.weight": (cfg.hidden, q),
                     f"blk.{i}.ffn_gate.weight": (cfg.ffn, cfg.hidden), f"blk.{i}.ffn_up.weight": (cfg.ffn, cfg.hidden),
                     f"blk.{i}.ffn_down.weight": (cfg.hidden, cfg.ffn)})
    for name, (rows, cols) in want.items():
        shape = shapes.get(name)
        if shape is not None and (len(shape) != 2 or shape[1] != cols or rows is not None and shape[0] != rows):
            raise JllmError(f"{source}: tensor {name} is {list(shape)}, but the metadata implies "
                            f"{[rows if rows is not None else shape[0], cols]}; the file's metadata does not "
                            f"match its tensors")
