"""llama.cpp's `eagle3` GGUF: an EAGLE-3 draft head (Li et al., 2025), read, validated and checked against
its target. The names below are the ones llama.cpp's loader looks up (src/models/eagle3.cpp, the key and
tensor tables in src/llama-arch.cpp, its converter's Eagle3 branch in conversion/llama.py, and how
common/speculative.cpp feeds the head); jllm's writer (jllm/train) imports them from here.

Metadata (`eagle3.` is `general.architecture`, as for any llama.cpp model):
  general.architecture          "eagle3"
  eagle3.target_layers          int array of exactly 3 target layer ids (low, middle, high). Id L is the
                                target's residual stream at the *input* of its block L (after L blocks, before
                                block L's attention norm); id == the target's block count is the last block's
                                output before the final norm. llama.cpp's converter takes the checkpoint's
                                `eagle_aux_hidden_state_layer_ids`, else [2, n // 2, n - 3] for n target blocks.
  eagle3.target_hidden_size     the target's hidden size Dt (the fused input is 3 Dt wide)
  eagle3.norm_before_residual   bool, default false (see the step below)
  eagle3.norm_before_fc         bool, default false: RMSNorm the 3 Dt features (weight enc.output_norm) before fc
  eagle3.embedding_length (D), feed_forward_length, block_count (1), attention.head_count,
  attention.head_count_kv, attention.layer_norm_rms_epsilon, rope.freq_base, rope.dimension_count,
  context_length, vocab_size: the usual llama keys for the head's one decoder layer.
  tokenizer.ggml.*              the target's tokenizer, copied by the converter (checked against the target).

Tensors (jllm's [rows, cols] = [out, in]; llama.cpp lists them the other way round):
  fc.weight               [D, 3 Dt]   fusion of the three target states
  enc.output_norm.weight  [3 Dt]      only with norm_before_fc
  d2t                     [Vd] I64    optional: draft row i scores target token d2t[i] (absolute ids, all
                                      distinct, < target vocab; the HF checkpoints' d2t holds offsets i ->
                                      d2t[i] - i, and the converter adds the index). Absent: Vd = target vocab.
  token_embd.weight       [V, D]      optional; absent: the target's embedding (then D must equal Dt)
  output.weight           [Vd, D]     optional; absent: the target's output layer (then D = Dt, Vd = V)
  output_norm.weight      [D]
  blk.0.attn_norm.weight  [D]         RMSNorm of the token embedding
  blk.0.attn_norm_2.weight [D]        RMSNorm of the fused hidden state ("hidden_norm" in HF checkpoints)
  blk.0.attn_q.weight     [H hd, 2 D]   q, k, v read [embedding normed, hidden normed] (2 D wide)
  blk.0.attn_k.weight     [Hk hd, 2 D]
  blk.0.attn_v.weight     [Hk hd, 2 D]
  blk.0.attn_output.weight [D, H hd]
  blk.0.ffn_norm.weight   [D]
  blk.0.ffn_gate.weight, blk.0.ffn_up.weight [F, D]; blk.0.ffn_down.weight [D, F]   (SwiGLU)
  blk.0.rope_freqs.weight [rope_dim / 2]   optional (llama3 rope scaling): frequency i is divided by it

One head position P (llama.cpp's decoder graph), x = the token input, g = the hidden input:
  e   = rms_norm(embed(x), attn_norm)
  gn  = rms_norm(g, attn_norm_2)
  a   = attention(Wq, Wk, Wv over concat(e, gn)), RoPE at position P: llama's *adjacent-pair* rotation
        (llama.cpp's rope type NORM for eagle3; the converter permutes q/k rows from HF's rotate-halves order,
        as for llama), scale 1 / sqrt(head_dim), causal over the head's own cache, no biases
  h   = Wo a + (gn if norm_before_residual else g)
  out = h + down(silu(gate(n)) * up(n)), n = rms_norm(h, ffn_norm)       the pre-norm state, fed back
  logits over the draft vocabulary = output(rms_norm(out, output_norm)); draft row i is target id d2t[i]

What goes in (common/speculative.cpp's convention): at head position P the pair is (token P + 1, g_P) with
g_P = fc(concat(f1[P], f2[P], f3[P])) over the target's three captured states at P, in target_layers order
(normed first with norm_before_fc). So the accepted context's rows fill the head cache one position behind
the tokens: row P needs the token that followed P, and the last accepted row waits for the token the target
picks next. Each later draft step at position P + 1 takes (the token just drafted, `out` of the step before)
in place of (token, g): the head's own pre-norm output stands in for the target's fused state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from jllm.errors import JllmError
from jllm.gguf.reader import GGUFFile, read_gguf

ARCH = "eagle3"
N_TARGET_LAYERS = 3

# metadata keys
KEY_ARCH = "general.architecture"
KEY_TARGET_LAYERS = f"{ARCH}.target_layers"
KEY_TARGET_HIDDEN = f"{ARCH}.target_hidden_size"
KEY_NORM_BEFORE_RESIDUAL = f"{ARCH}.norm_before_residual"
KEY_NORM_BEFORE_FC = f"{ARCH}.norm_before_fc"
KEY_HIDDEN = f"{ARCH}.embedding_length"
KEY_FFN = f"{ARCH}.feed_forward_length"
KEY_BLOCKS = f"{ARCH}.block_count"
KEY_HEADS = f"{ARCH}.attention.head_count"
KEY_KV_HEADS = f"{ARCH}.attention.head_count_kv"
KEY_HEAD_DIM = f"{ARCH}.attention.key_length"          # optional; default D / H
KEY_RMS_EPS = f"{ARCH}.attention.layer_norm_rms_epsilon"
KEY_ROPE_BASE = f"{ARCH}.rope.freq_base"
KEY_ROPE_DIM = f"{ARCH}.rope.dimension_count"
KEY_CONTEXT = f"{ARCH}.context_length"
KEY_VOCAB = f"{ARCH}.vocab_size"

# tensor names
FC = "fc.weight"
FC_NORM = "enc.output_norm.weight"
D2T = "d2t"
TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"
OUTPUT_NORM = "output_norm.weight"
ATTN_NORM = "blk.0.attn_norm.weight"
HIDDEN_NORM = "blk.0.attn_norm_2.weight"
ATTN_Q = "blk.0.attn_q.weight"
ATTN_K = "blk.0.attn_k.weight"
ATTN_V = "blk.0.attn_v.weight"
ATTN_OUT = "blk.0.attn_output.weight"
FFN_NORM = "blk.0.ffn_norm.weight"
FFN_GATE = "blk.0.ffn_gate.weight"
FFN_UP = "blk.0.ffn_up.weight"
FFN_DOWN = "blk.0.ffn_down.weight"
ROPE_FREQS = "blk.0.rope_freqs.weight"
D2T_TYPE = GGMLQuantizationType.I64

REQUIRED_TENSORS = (FC, OUTPUT_NORM, ATTN_NORM, HIDDEN_NORM, ATTN_Q, ATTN_K, ATTN_V, ATTN_OUT, FFN_NORM,
                    FFN_GATE, FFN_UP, FFN_DOWN)
OPTIONAL_TENSORS = (FC_NORM, D2T, TOKEN_EMBD, OUTPUT, ROPE_FREQS)


def default_target_layers(n_target_layers: int) -> list[int]:
    """The converter's choice where a checkpoint names none: low, middle, high."""
    return [2, n_target_layers // 2, n_target_layers - 3]


@dataclass(frozen=True)
class HeadConfig:
    """An eagle3 head's hyper-parameters, validated against its own tensors (not yet against a target)."""
    target_layers: tuple[int, int, int]
    target_hidden: int              # Dt
    hidden: int                     # D
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    context_length: int
    draft_vocab: int                # Vd: rows of the output layer (the target's vocabulary without d2t)
    norm_before_residual: bool
    norm_before_fc: bool
    own_embedding: bool
    own_output: bool
    has_d2t: bool

    @property
    def attn_scale(self) -> float:
        return self.head_dim ** -0.5


def _int_list(v) -> list[int] | None:
    if isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return [int(x) for x in v]
    return None


def read_head_config(gguf: GGUFFile) -> HeadConfig:
    """The head's config from its metadata, every tensor's shape checked against it (JllmError, one line)."""
    src, meta, tensors = gguf.path, gguf.metadata, gguf.tensors
    if meta.get(KEY_ARCH) != ARCH:
        raise JllmError(f"{src}: not an EAGLE-3 head (general.architecture is {meta.get(KEY_ARCH)!r}, "
                        f"not {ARCH!r})")

    def get(key: str, default=None):
        v = meta.get(key, default)
        if v is None:
            raise JllmError(f"{src}: eagle3 head lacks the metadata key {key}")
        return v[0] if isinstance(v, list) and key != KEY_TARGET_LAYERS else v

    layers = _int_list(get(KEY_TARGET_LAYERS))
    if layers is None or len(layers) != N_TARGET_LAYERS:
        raise JllmError(f"{src}: {KEY_TARGET_LAYERS} must hold {N_TARGET_LAYERS} layer ids, "
                        f"has {meta.get(KEY_TARGET_LAYERS)!r}")
    if int(get(KEY_BLOCKS, 1)) != 1:
        raise JllmError(f"{src}: an eagle3 head has one decoder layer, this one says {get(KEY_BLOCKS)}")
    hidden, heads = int(get(KEY_HIDDEN)), int(get(KEY_HEADS))
    kv_heads = int(get(KEY_KV_HEADS, heads))
    if min(hidden, heads, kv_heads) < 1 or heads % kv_heads:
        raise JllmError(f"{src}: inconsistent eagle3 metadata (embedding_length {hidden}, head_count {heads}, "
                        f"head_count_kv {kv_heads})")
    head_dim = int(meta.get(KEY_HEAD_DIM, hidden // heads))
    missing = [n for n in REQUIRED_TENSORS if n not in tensors]
    norm_before_fc = bool(meta.get(KEY_NORM_BEFORE_FC, False))
    if norm_before_fc and FC_NORM not in tensors:
        missing.append(FC_NORM)
    if missing:
        raise JllmError(f"{src}: eagle3 head lacks the tensor(s) {', '.join(missing)}")
    dt = int(get(KEY_TARGET_HIDDEN))
    ffn = int(get(KEY_FFN))
    d2t = tensors.get(D2T)
    own_output = OUTPUT in tensors
    if own_output:
        draft_vocab = tensors[OUTPUT].shape[0]
    elif d2t is not None:
        draft_vocab = d2t.shape[0]
    else:
        draft_vocab = 0                                   # the target's vocabulary, known once it is checked
    rope_dim = int(meta.get(KEY_ROPE_DIM, head_dim))
    q, kv = heads * head_dim, kv_heads * head_dim
    want = {FC: (hidden, 3 * dt), FC_NORM: (3 * dt,), OUTPUT_NORM: (hidden,), ATTN_NORM: (hidden,),
            HIDDEN_NORM: (hidden,), ATTN_Q: (q, 2 * hidden), ATTN_K: (kv, 2 * hidden), ATTN_V: (kv, 2 * hidden),
            ATTN_OUT: (hidden, q), FFN_NORM: (hidden,), FFN_GATE: (ffn, hidden), FFN_UP: (ffn, hidden),
            FFN_DOWN: (hidden, ffn), ROPE_FREQS: (rope_dim // 2,), TOKEN_EMBD: (None, hidden),
            OUTPUT: (None, hidden), D2T: (draft_vocab or None,)}
    for name, shape in want.items():
        t = tensors.get(name)
        if t is None:
            continue
        if len(t.shape) != len(shape) or any(w is not None and w != s for w, s in zip(shape, t.shape)):
            implied = ["any" if w is None else w for w in shape]
            raise JllmError(f"{src}: eagle3 tensor {name} is {list(t.shape)}, the metadata implies {implied}")
    if d2t is not None and d2t.ggml_type != D2T_TYPE:
        raise JllmError(f"{src}: eagle3 tensor d2t has type {d2t.ggml_type.name}, llama.cpp's layout is I64")
    return HeadConfig(
        target_layers=tuple(layers), target_hidden=dt, hidden=hidden, ffn=ffn, n_heads=heads,
        n_kv_heads=kv_heads, head_dim=head_dim, rms_eps=float(get(KEY_RMS_EPS, 1e-6)),
        rope_base=float(get(KEY_ROPE_BASE, 10000.0)), rope_dim=rope_dim,
        context_length=int(get(KEY_CONTEXT, 4096)), draft_vocab=draft_vocab,
        norm_before_residual=bool(meta.get(KEY_NORM_BEFORE_RESIDUAL, False)), norm_before_fc=norm_before_fc,
        own_embedding=TOKEN_EMBD in tensors, own_output=own_output, has_d2t=d2t is not None)


def read_d2t(gguf: GGUFFile) -> torch.Tensor | None:
    """d2t as int64 [Vd] (absolute target ids), or None where the head scores the target's whole vocabulary."""
    if D2T not in gguf.tensors:
        return None
    return torch.from_numpy(gguf.raw(D2T).view("<i8").copy())


def is_head(path_or_gguf) -> bool:
    """Whether a GGUF file is an eagle3 head (general.architecture), without loading it."""
    g = path_or_gguf if isinstance(path_or_gguf, GGUFFile) else read_gguf(path_or_gguf)
    return g.metadata.get(KEY_ARCH) == ARCH


def check_target(cfg: HeadConfig, head: GGUFFile, target_cfg, target: GGUFFile,
                 d2t: torch.Tensor | None = None) -> None:
    """Refuse (JllmError, one line naming every difference) a head made for another target: hidden size,
    the layer ids (which must exist in the target), the vocabulary and tokenizer. target_cfg: the target's
    jllm.model.config.ModelConfig."""
    from jllm.spec.compat import tokenizer_fingerprint

    diffs = []
    if cfg.target_hidden != target_cfg.hidden:
        diffs.append(f"target hidden size {cfg.target_hidden} vs {target_cfg.hidden}")
    bad = [L for L in cfg.target_layers if not 0 <= L <= target_cfg.n_layers]
    if bad:
        diffs.append(f"target layer(s) {bad} beyond the target's {target_cfg.n_layers} layers")
    if not cfg.own_embedding and cfg.hidden != target_cfg.hidden:
        diffs.append(f"no own token_embd, so its hidden size {cfg.hidden} must be the target's {target_cfg.hidden}")
    if not cfg.own_output and cfg.hidden != target_cfg.hidden:
        diffs.append(f"no own output, so its hidden size {cfg.hidden} must be the target's {target_cfg.hidden}")
    V = target_cfg.vocab_size
    if cfg.own_embedding and head.tensors[TOKEN_EMBD].shape[0] != target.tensors["token_embd.weight"].shape[0]:
        diffs.append(f"token_embd rows {head.tensors[TOKEN_EMBD].shape[0]} vs "
                     f"{target.tensors['token_embd.weight'].shape[0]}")
    if d2t is not None:
        if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= V):
            diffs.append(f"d2t ids {int(d2t.min())}..{int(d2t.max())} outside the target's vocabulary of {V}")
        elif torch.unique(d2t).numel() != d2t.numel():
            diffs.append("d2t maps two draft rows to one target id")
    elif cfg.own_output and cfg.draft_vocab > V:
        diffs.append(f"output rows {cfg.draft_vocab} (no d2t) vs the target's vocabulary of {V}")
    hv = head.metadata.get(KEY_VOCAB)
    if isinstance(hv, int) and hv != V:
        diffs.append(f"vocab_size {hv} vs {V}")
    h, t = tokenizer_fingerprint(head.metadata), tokenizer_fingerprint(target.metadata)
    if h["n_tokens"]:                                  # a head without tokenizer metadata is judged on the rest
        for field in ("model", "pre", "n_tokens", "tokens", "merges", "scores", "bos_id", "eos_id", "eot_id"):
            if h[field] != t[field]:
                label = f"tokenizer {field}" + (" sha256" if field in ("tokens", "merges", "scores") else "")
                a, b = (h[field], t[field]) if "sha256" not in label else (h[field][:12], t[field][:12])
                diffs.append(f"{label} {a!r} vs {b!r}")
    if diffs:
        raise JllmError(f"eagle3 head {Path(head.path).name} was not made for {Path(target.path).name} "
                        f"(head vs target): {'; '.join(diffs)}; use a head trained for this target")
