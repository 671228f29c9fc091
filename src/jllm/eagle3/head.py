"""An EAGLE-3 draft head (format.py describes the file and the computation) on jllm's kernels, with its own
KV cache.

How a proposer drives it, with the target at position p after a verify pass over [last, d1 .. dk] at
positions p .. p + k that kept d1 .. dn and then the target's own token b (captured states `hidden`, one row
per verified position, from Transformer.forward(..., capture=head.target_layers)):

    head.truncate(p)                                  # drop the previous round's draft steps
    s = head.prefill(hidden[:n + 1], [d1, .., dn, b]) # head positions p .. p + n; s.logits: the token after b
    for _ in range(k - 1):
        t = head.target_id(int(s.logits.argmax()))
        s = head.step(t, s.state)                     # position head.length; its own state fed back

Row P of a prefill pairs the target's state at P with the token at P + 1 (llama.cpp's convention), so the
head's cache always ends where the target's accepted context ends; after the prompt's prefill over tokens
0 .. N - 1 and the target's pick t_N, call head.prefill(hidden[0 .. N - 1], tokens[1 .. N]).

Linears are jllm's QLinear tiles on the native kernel (native4 by default: every matrix on 4-bit tiles, as
for a draft model), the same code path as the target's Python layer loop, so every row's result is
independent of the other rows in the call (prefill of T rows == T single steps, bit for bit). Where the
kernels are missing the same code runs on torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jllm.eagle3 import format as fmt
from jllm.eagle3.format import HeadConfig
from jllm.errors import JllmError
from jllm.gguf.reader import GGUFFile, read_gguf
from jllm.model.kv_cache import KVCache, kv_dtype
from jllm.model.transformer import Transformer, apply_rope, rms_norm
from jllm.model.weights import NATIVE, Embedding, _Builder


@dataclass
class Step:
    logits: torch.Tensor       # [Vd] float32 over the draft vocabulary (row i is target id head.target_id(i))
    state: torch.Tensor        # [D] the head's pre-norm output, the next step's hidden input


def rope_tables(cfg: HeadConfig, n_pos: int, factors: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_pos, rope_dim / 2]; factors (rope_freqs, llama3 scaling) divide the frequencies."""
    inv = 1.0 / (cfg.rope_base ** (torch.arange(0, cfg.rope_dim, 2, dtype=torch.int64).float() / cfg.rope_dim))
    if factors is not None:
        inv = inv / factors
    ang = torch.outer(torch.arange(n_pos, dtype=torch.float32), inv)
    return ang.cos().contiguous(), ang.sin().contiguous()


class Eagle3Head:
    def __init__(self, cfg: HeadConfig, gguf: GGUFFile, target: Transformer, precision: str | None = None,
                 max_tokens: int | None = None, use_cache: bool = True):
        self.cfg, self.gguf, self.target = cfg, gguf, target
        self.kernels = target.kernels
        self.device = target.device
        if precision is None:            # the target's kind of kernels: native on the CPU, the GGUF's blocks on a GPU
            precision = "native4" if self.kernels is not None else "blocks" if target.block_attention else "exact"
        if precision in NATIVE and self.kernels is None:
            precision = "exact"
        if precision == "blocks" and not target.block_attention:
            raise JllmError("an eagle3 head in the blocks precision needs its target in it too")
        self.blocks = precision == "blocks"
        b = _Builder(gguf, precision, target.device, use_cache)
        self.precision = precision
        self.fc = b.linear([fmt.FC])
        self.fc_norm = b.vector(fmt.FC_NORM) if cfg.norm_before_fc else None
        self.attn_norm, self.hidden_norm = b.vector(fmt.ATTN_NORM), b.vector(fmt.HIDDEN_NORM)
        self.qkv = b.linear([fmt.ATTN_Q, fmt.ATTN_K, fmt.ATTN_V])           # [2 D] -> [q + 2 kv]
        self.o = b.linear([fmt.ATTN_OUT])
        self.ffn_norm = b.vector(fmt.FFN_NORM)
        self.gate_up = b.linear([fmt.FFN_GATE, fmt.FFN_UP])
        self.down = b.linear([fmt.FFN_DOWN])
        self.output_norm = b.vector(fmt.OUTPUT_NORM)
        self.output = b.linear([fmt.OUTPUT]) if cfg.own_output else target.w.output
        self.embed = Embedding(gguf, fmt.TOKEN_EMBD, target.device) if cfg.own_embedding else target.w.embed
        self.d2t = fmt.read_d2t(gguf)
        self._d2t_list = self.d2t.tolist() if self.d2t is not None else None
        self._d2t_here = self.d2t.to(self.device) if self.d2t is not None else None
        n = max_tokens or target.rope_global[0].shape[0]
        factors = b.optional_vector(fmt.ROPE_FREQS)
        cos, sin = rope_tables(cfg, n, None if factors is None else factors.cpu())
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        # f16 where the target's kernels keep f16 (the native stack, the blocks precision), as the target does
        half = self.kernels is not None or self.blocks
        self.cache = KVCache(1, cfg.n_kv_heads, cfg.head_dim, n, dtype=kv_dtype(half), device=self.device)
        self.graphs = None          # on a GPU, the head's passes of up to 16 rows as CUDA graphs, as the target's
        if self.blocks and self.device.type == "cuda" and os.environ.get("JLLM_CUDA_GRAPHS", "1") != "0":
            from jllm.cuda.graphs import StepGraphs
            from jllm.cuda.linear import MATVEC_ROWS

            self.graphs = StepGraphs(self._blocks_body, MATVEC_ROWS)
        if b.writer is not None:
            try:
                b.writer.commit()
            except OSError:
                pass

    @classmethod
    def load(cls, path: str | os.PathLike | GGUFFile, target: Transformer, checked: bool = False,
             **kw) -> Eagle3Head:
        """Read, validate and check the head against the target (JllmError in one line), then build it.
        checked: the caller has run format.check_target on this file and target already (the engine does,
        before the target's weights load), so it is not run twice."""
        gguf = path if isinstance(path, GGUFFile) else read_gguf(path)
        cfg = fmt.read_head_config(gguf)
        target_gguf = getattr(target, "gguf", None)
        if target_gguf is None:
            raise JllmError("an eagle3 head needs its target loaded from a GGUF file (load_model)")
        if not checked:
            fmt.check_target(cfg, gguf, target.cfg, target_gguf, fmt.read_d2t(gguf))
        if not cfg.draft_vocab:
            from dataclasses import replace

            cfg = replace(cfg, draft_vocab=target.cfg.vocab_size)
        return cls(cfg, gguf, target, **kw)

    # ------------------------------------------------------------------------------------------- the API

    @property
    def target_layers(self) -> tuple[int, ...]:
        """What to pass as Transformer.forward's capture."""
        return self.cfg.target_layers

    @property
    def length(self) -> int:
        return self.cache.length

    def truncate(self, n: int) -> None:
        """Roll the head's context back to n positions (a length moves; nothing is copied)."""
        self.cache.truncate(n)

    def target_id(self, draft_id: int) -> int:
        return self._d2t_list[draft_id] if self._d2t_list is not None else draft_id

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] -> target-vocabulary logits [..., V], -inf where the head has no row."""
        if self.d2t is None:
            return logits
        out = torch.full((*logits.shape[:-1], self.target.cfg.vocab_size), float("-inf"), device=logits.device)
        out[..., self._d2t_here.to(logits.device)] = logits
        return out

    @torch.inference_mode()
    def fuse(self, hidden3: torch.Tensor) -> torch.Tensor:
        """hidden3 [T, 3 Dt] (the target's captured states) -> g [T, D]."""
        if hidden3.dim() != 2 or hidden3.shape[1] != 3 * self.cfg.target_hidden:
            raise ValueError(f"hidden states must be [T, {3 * self.cfg.target_hidden}], are {list(hidden3.shape)}")
        x = hidden3.float().contiguous()
        if self.fc_norm is not None:
            x = self._norm(x, self.fc_norm)
        return self.fc(x)

    @torch.inference_mode()
    def prefill(self, hidden3: torch.Tensor, tokens) -> Step:
        """The target's states at positions length .. length + T - 1 (hidden3 [T, 3 Dt]) and the token that
        followed each (tokens [T]) -> the cache advanced by T; the last row's draft logits and state."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        if tokens.shape[0] != hidden3.shape[0] or not tokens.shape[0]:
            raise ValueError(f"prefill: {hidden3.shape[0]} hidden rows but {tokens.shape[0]} tokens")
        logits, state = self.forward(tokens, self.fuse(hidden3), last_only=True)
        return Step(logits[-1], state[-1])

    @torch.inference_mode()
    def step(self, token: int, state: torch.Tensor) -> Step:
        """One draft step at position length: the token just drafted and the previous step's state."""
        logits, out = self.forward(torch.tensor([int(token)]), state.reshape(1, -1))
        return Step(logits[0], out[0])

    @torch.inference_mode()
    def tree_step(self, tokens: list[int], states: torch.Tensor, paths: list[list[tuple[torch.Tensor, torch.Tensor]]]
                  ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """One draft step of several branches of a tree at the same depth j >= 1: tokens [W] (target ids, as step()
        takes), states [W, D] (each branch's parent's output state), paths[w] the keys and values of its j - 1
        ancestors' steps (from earlier tree_step calls), in depth order. Row w stands at position length + j - 1 and
        sees the head's cache (positions 0 .. length - 1), its ancestors and itself; the cache's length does not
        move (its slots past it are scratch). -> (logits [W, Vd], out states [W, D], each row's own (key, value) for
        its children's paths).
        The matrices run once for all rows; attention, row by row."""
        c, kern = self.cfg, self.kernels
        W, j = len(tokens), len(paths[0]) + 1
        base = self.cache.length
        pos = base + j - 1
        if pos >= self.cos.shape[0]:
            raise JllmError(f"the eagle3 head's context is full ({self.cos.shape[0]} positions)")
        if any(len(p) != j - 1 for p in paths) or len(paths) != W:
            raise ValueError("tree_step: every row's path has the same depth")
        qk, v, g, gn = self._qkv(self.embed(torch.tensor(tokens, dtype=torch.int64)), states)
        H, Hk, hd = c.n_heads, c.n_kv_heads, c.head_dim
        kc, vc = self.cache.k[0], self.cache.v[0]                         # [Hk, L, hd]
        cos, sin = self.cos[pos:pos + 1], self.sin[pos:pos + 1]
        a = torch.empty(W, H * hd, device=qk.device)
        own = []
        for w in range(W):
            for i, (kp, vp) in enumerate(paths[w]):
                kc[:, base + i], vc[:, base + i] = kp, vp
            if kern is not None:
                q = kern.rope_store(qk[w:w + 1, :H], qk[w:w + 1, H:], v[w:w + 1], cos, sin, False, c.rope_dim, kc, vc,
                                    pos)
                a[w] = kern.attention(q, kc, vc, pos, 0, c.attn_scale)[0]
            else:
                r = apply_rope(qk[w:w + 1], cos, sin, False, c.rope_dim)
                kc[:, pos], vc[:, pos] = r[0, H:].to(kc.dtype), v[w].to(vc.dtype)
                o = F.scaled_dot_product_attention(r[:, :H].reshape(1, H, 1, hd), kc[None, :, :pos + 1].float(),
                                                   vc[None, :, :pos + 1].float(), scale=c.attn_scale,
                                                   enable_gqa=H != Hk)
                a[w] = o.reshape(H * hd)
            own.append((kc[:, pos].clone(), vc[:, pos].clone()))
        out = self._mlp(a, g, gn)
        return self._logits(out), out, own

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, g: torch.Tensor, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T], g [T, D] at positions length .. length + T - 1 -> (logits [T or 1, Vd], out [T, D]).
        One row's results depend on its own inputs and the cache before it only."""
        c, k = self.cfg, self.kernels
        T = tokens.shape[0]
        start = self.cache.reserve(T)
        if start + T > self.cos.shape[0]:
            raise JllmError(f"the eagle3 head's context is full ({self.cos.shape[0]} positions)")
        if self.blocks:                     # the GPU's layer: one CUDA graph replay a pass of up to 16 rows
            x = torch.cat([self.embed(tokens).to(self.device).float(), g.to(self.device).float()], dim=1)
            if self.graphs is not None and self.graphs.fits(T):
                logits, out = self.graphs.run(x, self.cache, start)
            else:
                logits, out = self._blocks_body(x, self.cache, torch.arange(start, start + T, device=self.device))
            self.cache.length = start + T
            return (logits[-1:] if last_only else logits), out
        qk, v, g, gn = self._qkv(self.embed(tokens), g)
        H = c.n_heads
        cos, sin = self.cos[start:start + T], self.sin[start:start + T]
        kc, vc = self.cache.k[0], self.cache.v[0]                         # [Hk, L, hd]
        if k is not None:
            q = k.rope_store(qk[:, :H], qk[:, H:], v, cos, sin, False, c.rope_dim, kc, vc, start)
            a = k.attention(q, kc, vc, start, 0, c.attn_scale)            # [T, qd]
        else:
            qk = apply_rope(qk, cos, sin, False, c.rope_dim)
            kc[:, start:start + T] = qk[:, H:].transpose(0, 1).to(kc.dtype)
            vc[:, start:start + T] = v.transpose(0, 1).to(vc.dtype)
            a = self._attention(qk[:, :H], kc, vc, start)
        out = self._mlp(a, g, gn)                                         # [T, D], fed back
        self.cache.length = start + T
        return self._logits(out[-1:] if last_only else out), out

    def _blocks_body(self, x: torch.Tensor, cache: KVCache, pos: torch.Tensor, capture=None):
        """The blocks precision's pass: x [T, 2 D] (the tokens' embedding rows as stored, then g), pos int64 [T]
        on the device -> (logits [T, Vd], out [T, D]); writes the rows' keys and values at pos. Nothing in it
        reads the host, so it runs as a CUDA graph (jllm.cuda.graphs.StepGraphs, the body's signature), and
        each row's results are its own (the target's GPU kernels: jllm.cuda.layers)."""
        from jllm.cuda import fused
        from jllm.cuda.attention import attention

        c, D = self.cfg, x.shape[1] // 2
        qk, v, g, gn = self._qkv(x[:, :D], x[:, D:])
        kc, vc = cache.k[0], cache.v[0]                                   # [Hk, L, hd]
        q = fused.rope_store(qk, v, pos, self.cos, self.sin, False, c.rope_dim, kc, vc)
        out = self._mlp(attention(q, kc, vc, pos, 0, c.attn_scale), g, gn)
        return self._logits(out), out

    # ------------------------------------------------------------------------------------------- internals

    def _qkv(self, e: torch.Tensor, g: torch.Tensor):
        """The layer before attention: e [T, D] (the tokens' embedding rows as stored, never scaled), g [T, D]
        -> q and k [T, H + Hk, hd] before RoPE, v [T, Hk, hd], g as float32 and its norm gn."""
        c = self.cfg
        e = self._norm(e.contiguous(), self.attn_norm)
        g = g.float().contiguous()
        gn = self._norm(g, self.hidden_norm)
        qkv = self.qkv(torch.cat([e, gn], dim=1))                         # [T, q + 2 kv]
        T, H, Hk, hd = qkv.shape[0], c.n_heads, c.n_kv_heads, c.head_dim
        split = (H + Hk) * hd
        return qkv[:, :split].reshape(T, H + Hk, hd), qkv[:, split:].reshape(T, Hk, hd), g, gn

    def _mlp(self, a: torch.Tensor, g: torch.Tensor, gn: torch.Tensor) -> torch.Tensor:
        """The layer after attention: a [T, H * hd] -> the output state [T, D]."""
        c, k = self.cfg, self.kernels
        h = self.o(a) + (gn if c.norm_before_residual else g)
        gu = self.gate_up(self._norm(h, self.ffn_norm))
        m = self.down(k.glu(gu, False)) if k is not None else self.down(F.silu(gu[:, :c.ffn]) * gu[:, c.ffn:])
        return h + m

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self._norm(x.contiguous(), self.output_norm))

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, w, self.cfg.rms_eps)
        return rms_norm(x, w, self.cfg.rms_eps)

    def _attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, start: int) -> torch.Tensor:
        """torch fallback, one query at a time: q [T, H, hd] -> [T, H * hd]."""
        c = self.cfg
        T = q.shape[0]
        out = torch.empty(T, c.n_heads, c.head_dim, device=q.device)
        for t in range(T):
            p = start + t + 1
            o = F.scaled_dot_product_attention(q[t].reshape(1, c.n_heads, 1, c.head_dim), kc[None, :, :p].float(),
                                               vc[None, :, :p].float(), scale=c.attn_scale,
                                               enable_gqa=c.n_heads != c.n_kv_heads)
            out[t] = o[0, :, 0]
        return out.reshape(T, c.n_heads * c.head_dim)
