"""The target model for training: the GGUF's own weights, dequantized, in a Hugging Face model.

Why Hugging Face and not jllm's own torch path: training needs batched generation and a forward pass over
many padded sequences at once on a GPU; jllm's Transformer decodes one sequence (~33 tok/s on CUDA).
Why not transformers' own GGUF loader: it needs `accelerate` and parses the header with gguf-py's slow reader;
the weights here come from jllm's reader and dequantizer (bitwise gguf-py), so the HF model computes the
same function as jllm's exact path, up to float rounding and the compute dtype (tests/test_train_head.py
checks the logits against jllm's).

Hidden states: llama.cpp's eagle3 reads, for each id l in `eagle3.target_layers`, the *input* of target
layer l (the residual stream after layers 0..l-1; common/speculative.cpp, llama_get_embeddings_layer_inp),
which is Hugging Face's `hidden_states[l]` (hidden_states[0] is the embedding output); jllm/eagle3/format.py
describes the same choice. The default ids are llama.cpp's converter's, [2, n_layers // 2, n_layers - 3].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jllm.errors import JllmError
from jllm.gguf import quants
from jllm.gguf.reader import GGUFFile, read_gguf
from jllm.model.config import ModelConfig, config_from_gguf
from jllm.tokenizer.chat import ChatTemplate
from jllm.tokenizer.tokenizer import Tokenizer

# jllm architecture -> transformers (model class, config class); the three share tensor names and norms
HF_CLASSES = {"qwen2": ("Qwen2ForCausalLM", "Qwen2Config"), "llama": ("LlamaForCausalLM", "LlamaConfig"),
              "qwen3": ("Qwen3ForCausalLM", "Qwen3Config")}

_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm"}


def hf_name(gguf_name: str) -> str:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    blk, layer, kind, suffix = gguf_name.split(".")
    if blk != "blk" or kind not in _BLOCK:
        raise JllmError(f"tensor {gguf_name} has no Hugging Face counterpart in the training target")
    return f"model.layers.{layer}.{_BLOCK[kind]}.{suffix}"


def _llama_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's interleaved-pair Q/K rows back to HF's rotate-halves order (the converter's inverse)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class Target:
    path: str
    gguf: GGUFFile
    cfg: ModelConfig
    model: torch.nn.Module           # HF causal LM, eval mode, on `device`
    tokenizer: Tokenizer
    template: ChatTemplate
    device: torch.device
    _decoder: object = None          # the BatchedDecoder of the last generate, reused while it is big enough

    @property
    def embedding(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight

    @property
    def final_norm(self) -> torch.Tensor:
        return self.model.model.norm.weight

    @torch.no_grad()
    def features(self, ids: torch.Tensor, lengths: torch.Tensor, layers, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: [B, T] right-padded, lengths: [B] -> (feats [B, T, 3 D]: the inputs of target layers `layers`,
        concatenated low, mid, high; logits [B, T, vocab]), both in the model's dtype. rows = (b, t): the
        logits of those positions only, [R, vocab] (the output matrix runs over them alone: a batch's logits
        at every position would be B * T * vocab, ~5 GB in bf16 for 16k tokens)."""
        mask = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
        out = self.model.model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True,
                               use_cache=False)
        feats = torch.cat([out.hidden_states[l] for l in layers], dim=-1)
        last = out.last_hidden_state                             # after the final norm
        return feats, self.model.lm_head(last if rows is None else last[rows[0], rows[1]])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new: int, sample: bool, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, rows: int | None = None) -> list[list[int]]:
        """Each prompt's continuation (ids, the end-of-turn token included when one ended it), batched
        (train/batched.py); greedy unless `sample`. rows: decode at most this many at once (the others take
        the rows of replies that have ended); None: all of them."""
        from jllm.train.batched import BatchedDecoder

        rows = -(-min(len(prompts), rows or len(prompts)) // 64) * 64
        slots = -(-(max(len(p) for p in prompts) + max_new) // 256) * 256
        dec = self._decoder
        if dec is None or dec.B < rows or dec.T < slots:
            self._decoder = None                                  # its cache freed before the next is made
            dec = self._decoder = BatchedDecoder(self.model, max(rows, dec.B if dec else 0),
                                                 max(slots, dec.T if dec else 0))
        pad = self.tokenizer.eos_id if self.tokenizer.eos_id is not None else 0
        return dec.generate(prompts, max_new, self.tokenizer.eot_ids, sample=sample, temperature=temperature,
                            top_p=top_p, seed=seed, pad_id=pad)

    @torch.no_grad()
    def hf_generate(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        """Greedy continuations by transformers' own `generate`: the oracle of `generate`'s tests."""
        pad = self.tokenizer.eos_id if self.tokenizer.eos_id is not None else 0
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=max_new, eos_token_id=sorted(self.tokenizer.eot_ids),
                                  pad_token_id=pad, do_sample=False, temperature=None, top_p=None, top_k=None)
        ends = self.tokenizer.eot_ids
        result = []
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
            result.append(row[:cut])
        return result


def load_target(path: str, device: str = "cpu", dtype: torch.dtype | None = None) -> Target:
    """The GGUF at `path` as a Hugging Face model on `device` (bf16 on CUDA, f32 on the CPU by default)."""
    import transformers

    dev = torch.device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    g = read_gguf(path)
    cfg = config_from_gguf(g.metadata, set(g.tensors), source=str(path))
    if cfg.arch not in HF_CLASSES:
        raise JllmError(f"{path}: training a head supports targets of architecture "
                        f"{', '.join(HF_CLASSES)}; this one is {cfg.arch}")
    if cfg.rope_scale != 1.0:
        raise JllmError(f"{path}: rope scaling is not supported by the training target")
    model_cls, config_cls = (getattr(transformers, n) for n in HF_CLASSES[cfg.arch])
    hf_cfg = config_cls(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_eps,
                        max_position_embeddings=cfg.context_length, tie_word_embeddings=cfg.tied_embeddings,
                        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base})
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = model_cls(hf_cfg)
    state = {}
    for name, info in g.tensors.items():
        w = quants.dequantize(g.raw(name), info.ggml_type, info.shape)
        if cfg.arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _llama_unpermute(w, cfg.n_heads)
        elif cfg.arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _llama_unpermute(w, cfg.n_kv_heads)
        state[hf_name(name)] = w.to(dtype)
        g.release(name)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tied_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise JllmError(f"{path}: the GGUF's tensors do not fill the {model_cls.__name__} "
                        f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    if cfg.tied_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg)      # built on meta: build it again
    model = model.to(dev).eval()
    tok = Tokenizer.from_metadata(g.metadata)
    return Target(str(path), g, cfg, model, tok, ChatTemplate.from_metadata(g.metadata, tok), dev)
