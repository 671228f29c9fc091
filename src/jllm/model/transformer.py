"""The decoder-only transformer shared by all architectures: forward over T new tokens at given positions.

Batch invariance: the logits of the token at position p are a bitwise-deterministic function of tokens
0..p, however the tokens were split into forward calls. Linears are invariant by construction (linear.py),
norms and element-wise ops work row by row, and attention is computed query by query over exactly the keys
that query sees — the same call with the same shapes whether the query came alone (decode) or with others
(prefill, speculative verify).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from jllm.model.config import ModelConfig
from jllm.model.kv_cache import KVCache, kv_dtype
from jllm.model.weights import Weights
from jllm.sequence import CUDA_PREFILL_CHUNK, PREFILL_CHUNK


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, w.shape, w, eps)


def rope_table(cfg: ModelConfig, base: float, scale: float, n_pos: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [n_pos, rope_dim / 2] float32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, cfg.rope_dim, 2, dtype=torch.int64).float() / cfg.rope_dim))
    pos = torch.arange(n_pos, dtype=torch.float32) / scale
    ang = torch.outer(pos, inv_freq)
    return ang.cos().to(device), ang.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool, rope_dim: int) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, rope_dim / 2]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    if neox:
        a, b = rot[..., : rope_dim // 2], rot[..., rope_dim // 2:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: Weights, device: torch.device, max_positions: int):
        self.cfg, self.w, self.device = cfg, weights, device
        n = max(max_positions, 1)
        self.rope_global = rope_table(cfg, cfg.rope_base, cfg.rope_scale, n, device)
        self.rope_local = rope_table(cfg, cfg.rope_base_local, 1.0, n, device) if cfg.sliding_window else None
        self.embed_scale = math.sqrt(cfg.hidden) if cfg.traits.embed_scale else None
        # the blocks precision (a GPU, or Triton's interpreter in the tests): attention by jllm.cuda.attention,
        # each (query, head) over exactly its keys, as the CPU kernel does, so that batched passes are bitwise
        # single steps there too; positions on the device, so that a step can be a CUDA graph (cuda/graphs.py)
        from jllm.cuda.linear import MATVEC_ROWS, BlocksLinear

        self.block_attention = isinstance(weights.output, BlocksLinear)
        self.kernels = None
        self.stack = None          # the forward pass as one native call, when every linear runs on the native kernel
        if device.type == "cpu" and not self.block_attention:
            from jllm.kernels import qgemm

            self.kernels = qgemm()
            if self.kernels is not None:
                self.stack = self._native_stack()
        # f16 on the native stack and the blocks precision (half the bytes per step; kv_cache.py), else f32
        # (torch attention, and the exact, int8 and bf16 precisions, which the oracles and comparisons use).
        # Fixed at load: the Python layers read the stack's cache with the same kernels.
        self.kv_dtype = kv_dtype(self.stack is not None or self.block_attention)
        self.graphs = self.prefill_graphs = None
        if self.block_attention and device.type == "cuda" and os.environ.get("JLLM_CUDA_GRAPHS", "1") != "0":
            from jllm.cuda.graphs import PrefillGraphs, StepGraphs

            self.graphs = StepGraphs(self._blocks_body, MATVEC_ROWS)    # the passes that stay row-exact
            self.prefill_graphs = PrefillGraphs(self._prefill_body, n)  # a prefill's chunks, padded
        self.chain = None           # greedy steps chained on the device (cuda/chain.py), where the embedding is there
        if self.graphs is not None and os.environ.get("JLLM_CUDA_CHAIN", "1") != "0":
            from jllm.cuda.chain import GreedyChain
            from jllm.cuda.embedding import DeviceEmbedding

            # the argmax feeds the embedding unchecked: an output row past the table would read past it
            if isinstance(weights.embed, DeviceEmbedding) and weights.output.out_features <= weights.embed.rows:
                self.chain = GreedyChain(self._chain_body, self.graphs.pool)
        # a prefill's chunk length: the GPU's passes gain from longer chunks (fewer launches, fewer passes over
        # the dequantized matrices); the CPU's do not, and their activations' memory grows with it
        self.prefill_chunk = CUDA_PREFILL_CHUNK if self.block_attention and device.type == "cuda" else PREFILL_CHUNK

    def _native_stack(self):
        from jllm.model.qlinear import GROUP_BYTES, QLinear

        c, w = self.cfg, self.w
        mats = [(L.qkv, L.o, L.gate_up, L.down) for L in w.layers]
        if not all(isinstance(m, QLinear) for ms in mats + [(w.output,)] for m in ms):
            return None
        stack = self.kernels.Stack(c.n_heads, c.n_kv_heads, c.head_dim, c.rms_eps, c.attn_scale,
                                   c.traits.rope_neox, c.rope_dim, c.traits.gelu, GROUP_BYTES)
        none = torch.empty(0)
        for i, L in enumerate(w.layers):
            norms = [L.attn_norm, L.q_norm, L.k_norm, L.post_attn_norm, L.ffn_norm, L.post_ffn_norm]
            cos, sin = self.rope_local if c.is_sliding(i) else self.rope_global
            stack.add_layer([none if n is None else n for n in norms],
                            [t for m in mats[i] for t in (m.data, m.offsets, m.kinds, m.bias)],
                            [m.out_features for m in mats[i]], cos, sin,
                            c.sliding_window if c.is_sliding(i) else 0)
        o = w.output                              # the final norm and the output layer in the same call
        stack.set_head(w.output_norm.contiguous(), o.data, o.offsets, o.kinds, o.out_features, o.bias)
        return stack

    def new_cache(self, max_tokens: int, dtype: torch.dtype | None = None) -> KVCache:
        c = self.cfg
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, max_tokens, dtype=dtype or self.kv_dtype,
                       device=self.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' rows as the layers take them [T, D] (scaled where the architecture scales them)."""
        x = self.w.embed(tokens)
        return x * self.embed_scale if self.embed_scale is not None else x

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False,
                capture: tuple[int, ...] | None = None, tree: list[int] | None = None):
        """tokens: [T] int64 -> logits [T, vocab] (or [1, vocab] with last_only) float32.

        Writes the new tokens' keys and values at cache.length and advances it by T.
        tree (native stack only): the parents of the last len(tree) tokens, the rows of a speculative tree (each a
        row index before it in this call; the rows before them are a chain). A tree row's logits are those of a
        decode step along its path, at the position of its depth; its key and value sit at its own row's
        position (Sequence.keep moves an accepted path's into place). A side leaf is a tree of one row.
        capture (layer ids, each 0..n_layers; an EAGLE-3 head's target_layers): return (logits, hidden) with
        hidden [T, len(capture) * hidden] float32, block j the residual stream entering layer capture[j]
        (n_layers: the last layer's output before the final norm), for every row even with last_only.
        Without it nothing is copied.
        """
        c, w = self.cfg, self.w
        T = tokens.shape[0]
        if tree and self.stack is None:
            raise ValueError("side leaves and trees need the native layer stack")
        norm = self.kernels.rms_norm if self.kernels is not None else rms_norm
        start = cache.reserve(T)
        x = self.embed(tokens)                                                # x: [T, D]
        if capture is not None and not all(0 <= i <= c.n_layers for i in capture):
            raise ValueError(f"capture layers {capture} beyond 0..{c.n_layers}")
        if self.stack is not None:                                            # layers, norm, output: one call
            tree = list(tree) if tree else []
            if capture is None:
                logits = self.stack.forward(x, cache.k, cache.v, start, last_only, tree)
            else:
                hidden = torch.empty(T, len(capture) * c.hidden)
                logits = self.stack.forward(x, cache.k, cache.v, start, last_only, tree, list(capture), hidden)
            cache.length = start + T
            return logits if capture is None else (logits, hidden)
        if self.graphs is not None and not tree and self.graphs.fits(T):
            logits, hidden = self.graphs.run(x, cache, start, tuple(capture) if capture else None)
            cache.length = start + T                         # decode and verify steps: one graph replay
            logits = logits[-1:] if last_only else logits
            return logits if capture is None else (logits, hidden)
        if self.prefill_graphs is not None and last_only and not tree and T > self.graphs.max_rows:
            ran = self.prefill_graphs.run(x, cache, start, tuple(capture) if capture else None)
            if ran is not None:                              # a prefill's chunk: one replay
                cache.length = start + T
                return ran[0] if capture is None else ran
        taken = {} if capture is not None else None
        if self.block_attention:                                  # the GPU's layers (jllm/cuda/layers.py)
            from jllm.cuda.layers import blocks_layers

            pos = torch.arange(start, start + T, device=x.device)
            _, x, prep = blocks_layers(self, x, cache, pos, taken, None if last_only else w.output)
        else:
            x, prep = norm(self._layers(x, cache, start, taken), w.output_norm, c.rms_eps), None
        cache.length = start + T
        logits = w.output(x[-1:] if last_only else x) if prep is None else w.output(x, prep)
        if capture is None:
            return logits
        return logits, torch.cat([taken[i] for i in capture], dim=1).float()

    def _blocks_body(self, x: torch.Tensor, cache: KVCache, pos: torch.Tensor, capture: tuple[int, ...] | None):
        """The blocks precision's pass after the embedding: (every row's logits, the captured layers' inputs
        [T, F] float32 or None). A CUDA graph's body (cuda/graphs.py, StepGraphs)."""
        from jllm.cuda.layers import blocks_layers

        taken = {} if capture else None
        _, h, prep = blocks_layers(self, x, cache, pos, taken, self.w.output)
        logits = self.w.output(h, prep)
        return logits, None if not capture else torch.cat([taken[i] for i in capture], dim=1).float()

    def _chain_body(self, state: torch.Tensor, cache: KVCache, capture: tuple[int, ...] | None):
        """One greedy chain step (cuda/chain.py): the token state[0] at position state[1], both on the device ->
        (logits [1, V], the captured layers' inputs or None); the step graph's body of one row after the same
        embedding."""
        x = self.embed(state[:1])                         # ids on the device: looked up there, unchecked
        return self._blocks_body(x, cache, state[1:2], capture)

    def _prefill_body(self, x: torch.Tensor, cache: KVCache, pos: torch.Tensor, last: torch.Tensor,
                      capture: tuple[int, ...] | None):
        """The blocks precision's pass over a padded prefill chunk: (the logits of row `last` [1, V], the
        captured layers' inputs [B, F] float32 or None). A CUDA graph's body (cuda/graphs.py, PrefillGraphs)."""
        from jllm.cuda.layers import blocks_layers

        taken = {} if capture else None
        _, h, _ = blocks_layers(self, x, cache, pos, taken)
        logits = self.w.output(h.index_select(0, last))
        return logits, None if not capture else torch.cat([taken[i] for i in capture], dim=1).float()

    def _layers(self, x: torch.Tensor, cache: KVCache, start: int, taken: dict | None = None) -> torch.Tensor:
        """The decoder layers in Python (any device and precision but blocks, jllm/cuda/layers.py; the native
        stack runs the same kernels). taken: filled with layer id -> the residual stream entering that layer,
        [T, D] (n_layers: the output)."""
        c, w = self.cfg, self.w
        T = x.shape[0]
        norm = self.kernels.rms_norm if self.kernels is not None else rms_norm
        q_dim, kv_dim = c.n_heads * c.head_dim, c.kv_dim
        for i, L in enumerate(w.layers):
            if taken is not None:
                taken[i] = x
            h = norm(x, L.attn_norm, c.rms_eps)
            qkv = L.qkv(h)                                                    # [T, q_dim + 2 kv_dim]
            qk = qkv[:, :q_dim + kv_dim].reshape(T, c.n_heads + c.n_kv_heads, c.head_dim)
            v = qkv[:, q_dim + kv_dim:].reshape(T, c.n_kv_heads, c.head_dim)
            if L.q_norm is not None:
                qk = torch.cat([norm(qk[:, :c.n_heads], L.q_norm, c.rms_eps),
                                norm(qk[:, c.n_heads:], L.k_norm, c.rms_eps)], dim=1)
            sliding = c.is_sliding(i)
            cos, sin = self.rope_local if sliding else self.rope_global
            if self.kernels is not None:
                q = self.kernels.rope_store(qk[:, :c.n_heads], qk[:, c.n_heads:], v, cos[start:start + T],
                                            sin[start:start + T], c.traits.rope_neox, c.rope_dim,
                                            cache.k[i], cache.v[i], start)
            else:
                qk = apply_rope(qk, cos[start:start + T], sin[start:start + T], c.traits.rope_neox, c.rope_dim)
                q, k = qk[:, :c.n_heads], qk[:, c.n_heads:]                  # [T, H, hd], [T, Hk, hd]
                cache.k[i, :, start:start + T] = k.transpose(0, 1)
                cache.v[i, :, start:start + T] = v.transpose(0, 1)
            a = self._attention(q, cache, i, start, c.sliding_window if sliding else 0)   # [T, q_dim]
            a = L.o(a)
            if L.post_attn_norm is not None:
                a = norm(a, L.post_attn_norm, c.rms_eps)
            x = x + a
            h = norm(x, L.ffn_norm, c.rms_eps)
            gu = L.gate_up(h)                                                 # [T, 2 ffn]
            if self.kernels is not None:
                m = L.down(self.kernels.glu(gu, c.traits.gelu))
            else:
                g, u = gu[:, :c.ffn], gu[:, c.ffn:]
                g = F.gelu(g, approximate="tanh") if c.traits.gelu else F.silu(g)
                m = L.down(g * u)
            if L.post_ffn_norm is not None:
                m = norm(m, L.post_ffn_norm, c.rms_eps)
            x = x + m
        if taken is not None:
            taken[c.n_layers] = x
        return x

    def _attention(self, q: torch.Tensor, cache: KVCache, layer: int, start: int, window: int) -> torch.Tensor:
        """q: [T, H, hd] for positions start..start+T-1 -> [T, H * hd], one query at a time (see module doc)."""
        c = self.cfg
        T = q.shape[0]
        if self.kernels is not None:                      # jllm's CPU kernel: same contract, one call
            return self.kernels.attention(q, cache.k[layer], cache.v[layer], start, window, c.attn_scale)
        K, V = cache.k[layer].unsqueeze(0), cache.v[layer].unsqueeze(0)       # [1, Hk, max, hd]
        if T > 1 and q.device.type != "cpu":
            return self._attention_batched(q, K, V, start, window)
        out = torch.empty(T, c.n_heads, c.head_dim, device=q.device)
        gqa = c.n_heads != c.n_kv_heads
        for t in range(T):
            p = start + t
            lo = max(0, p - window + 1) if window else 0
            qt = q[t].contiguous().view(1, c.n_heads, 1, c.head_dim)
            o = F.scaled_dot_product_attention(qt, K[:, :, lo:p + 1], V[:, :, lo:p + 1],
                                               scale=c.attn_scale, enable_gqa=gqa)
            out[t] = o[0, :, 0]
        return out.view(T, c.n_heads * c.head_dim)

    def _attention_batched(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, start: int,
                           window: int) -> torch.Tensor:
        """All T queries in one call (GPUs, where a call per query would be launch-bound; their GEMMs are not
        batch-invariant anyway). q: [T, H, hd] -> [T, H * hd]."""
        c = self.cfg
        T = q.shape[0]
        end = start + T
        lo = max(0, start - window + 1) if window else 0
        qpos = torch.arange(start, end, device=q.device)[:, None]
        kpos = torch.arange(lo, end, device=q.device)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), K[:, :, lo:end], V[:, :, lo:end],
                                           attn_mask=mask, scale=c.attn_scale,
                                           enable_gqa=c.n_heads != c.n_kv_heads)      # [1, H, T, hd]
        return o[0].transpose(0, 1).reshape(T, c.n_heads * c.head_dim)
