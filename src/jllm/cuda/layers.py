"""The decoder layers of the blocks precision on the GPU: the GGUF's blocks through jllm.cuda.matvec, attention
through jllm.cuda.attention, and the small operations through jllm.cuda.fused (one norm a residual add, RoPE and
the cache writes in one kernel), with positions on the device so that a step can be a CUDA graph
(jllm.cuda.graphs). Every kernel works row by row: a row's output is the same whatever rows share the call.
"""

from __future__ import annotations

import torch

from jllm.cuda import fused
from jllm.cuda.attention import attention
from jllm.cuda.layout import QUERIES
from jllm.model.transformer import rms_norm


def blocks_layers(model, x: torch.Tensor, cache, pos: torch.Tensor, taken: dict | None = None,
                  final=None) -> tuple[torch.Tensor, torch.Tensor, object]:
    """x [T, D] (the embedded rows), pos int64 [T] their positions -> (the last layer's output, its final norm,
    that norm made ready for `final`'s tensor-core products, or None). Writes the rows' keys and values at pos.
    taken: as Transformer._layers fills it. final: the layer that takes the final norm (the output), if any.
    Each norm, the GLU and the attention's merge make their output ready for the tensor cores' products of
    the layer that takes it (jllm.cuda.mma, when on), so no launch of its own does that."""
    c, w = model.cfg, model.w
    T = x.shape[0]
    H, Hk, hd = c.n_heads, c.n_kv_heads, c.head_dim
    split = (H + Hk) * hd
    x = x.float().contiguous()
    prep = w.layers[0].qkv.empty_prep(x) if w.layers else None
    h = fused.rms_norm(x, w.layers[0].attn_norm, c.rms_eps, prep)
    for i, L in enumerate(w.layers):
        if taken is not None:
            taken[i] = x
        qkv = L.qkv(h, prep)                                                  # [T, (H + 2 Hk) hd]
        qk, v = qkv[:, :split].view(T, H + Hk, hd), qkv[:, split:].view(T, Hk, hd)
        if L.q_norm is not None:                                              # qwen3, gemma3: per-head norms
            qk = torch.cat([rms_norm(qk[:, :H], L.q_norm, c.rms_eps), rms_norm(qk[:, H:], L.k_norm, c.rms_eps)],
                           dim=1)
        sliding = c.is_sliding(i)
        cos, sin = model.rope_local if sliding else model.rope_global
        q = fused.rope_store(qk, v, pos, cos, sin, c.traits.rope_neox, c.rope_dim, cache.k[i], cache.v[i])
        prep = L.o.empty_prep(q) if c.head_dim <= 256 and T <= QUERIES else None
        a = L.o(attention(q, cache.k[i], cache.v[i], pos, c.sliding_window if sliding else 0, c.attn_scale,
                          prep=prep), prep)
        if L.post_attn_norm is not None:
            a = fused.rms_norm(a, L.post_attn_norm, c.rms_eps)
        prep = L.gate_up.empty_prep(x)
        x, h = fused.add_rms_norm(x, a, L.ffn_norm, c.rms_eps, prep)
        gu = L.gate_up(h, prep)
        prep = L.down.empty_prep(gu[:, :gu.shape[1] // 2])
        m = L.down(fused.glu(gu, c.traits.gelu, prep=prep), prep)
        if L.post_ffn_norm is not None:
            m = fused.rms_norm(m, L.post_ffn_norm, c.rms_eps)
        nxt = w.layers[i + 1].qkv if i + 1 < len(w.layers) else final
        prep = nxt.empty_prep(x) if nxt is not None and hasattr(nxt, "empty_prep") else None
        after = w.layers[i + 1].attn_norm if i + 1 < len(w.layers) else w.output_norm
        x, h = fused.add_rms_norm(x, m, after, c.rms_eps, prep)                # the next layer's norm, or the final
    if taken is not None:
        taken[c.n_layers] = x
    return x, h, prep
