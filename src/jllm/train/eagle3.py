"""The EAGLE-3 draft head and its training-time test (Li et al., 2025, "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test"), computed as llama.cpp's eagle3 graph runs it
(src/models/eagle3.cpp), so that the trained weights mean the same there.

The head, for the row at position P (llama.cpp's input convention: the pair (token[P+1], g_P), RoPE at P):
    g_P  = fc(concat(target layer inputs low, mid, high at P))          # [3 Dt] -> [D]; a drafted row's g
                                                                         #   is the previous row's output h
    x    = concat(rms(embed(token[P+1])) * attn_norm, rms(g_P) * attn_norm_2)           # [2 D]
    a    = attention(q(x), k(x), v(x)) over the head's own rows 0..P (interleaved-pair RoPE, as llama.cpp's
           LLAMA_ROPE_TYPE_NORM: no permutation at export), then o(a)
    h    = g_P + a;  h = h + down(silu(gate(n)) * up(n)), n = rms(h) * ffn_norm          # the pre-norm state
    logits over the draft vocabulary = output(rms(h) * output_norm); draft id i is target id d2t[i]
It predicts token[P+2].

Training-time test (TTT), `steps` unrolled draft steps over every position t of a sequence at once:
step 0 feeds g_t from the target; step j > 0 feeds the head's own h of step j - 1 at t, with token[t+1+j]
and RoPE position t + j, which is what the j-th drafted row after position t sees at run time. Its query
attends to step 0's keys at positions <= t (the accepted context, causal) and to the keys of steps 1..j at
t alone (its own chain): the per-step "diagonal" of the authors' mask, written here as one causal score
matrix plus j diagonal columns. Loss at step j, position t: cross-entropy from the target's distribution
for token[t+2+j], restricted to the draft vocabulary and renormalised, where that token is a reply token and
the target's top token lies in the draft vocabulary; steps weighted decay**j (0.8 in the authors' code).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class HeadConfig:
    hidden: int                  # D (= the target's hidden size here)
    target_hidden: int           # Dt
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    draft_vocab: int
    target_vocab: int
    rms_eps: float
    rope_base: float
    context_length: int
    target_layers: tuple[int, int, int]

    def __post_init__(self):
        if len(self.target_layers) != 3:
            raise ValueError("EAGLE-3 reads exactly three target layers")
        if self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ValueError(f"bad head shape: {self.n_heads} heads, {self.n_kv_heads} kv heads, "
                             f"head_dim {self.head_dim}")

    @classmethod
    def for_target(cls, cfg, draft_vocab: int, ffn: int | None = None, layers=None) -> "HeadConfig":
        """The target's attention shape and hidden size (jllm ModelConfig `cfg`); the head's own FFN width."""
        from jllm.eagle3.format import default_target_layers

        return cls(hidden=cfg.hidden, target_hidden=cfg.hidden, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                   head_dim=cfg.head_dim, ffn=ffn or cfg.ffn, draft_vocab=min(draft_vocab, cfg.vocab_size),
                   target_vocab=cfg.vocab_size, rms_eps=cfg.rms_eps, rope_base=cfg.rope_base,
                   context_length=cfg.context_length,
                   target_layers=tuple(layers or default_target_layers(cfg.n_layers)))


def rope_interleaved(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """x: [B, T, H, hd], pos: [T] -> x rotated in adjacent pairs (ggml's normal RoPE, all dims)."""
    hd = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = pos.to(torch.float32)[:, None] * inv[None, :]                       # [T, hd / 2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2).to(x.dtype)


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """q: [B, H, T, hd]; ks[i], vs[i]: [B, H, T, hd], step i's keys and values -> [B, H, T, hd].

    Query t sees step 0's keys at positions <= t and, for each later step i, that step's key at t."""
    T = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    s0 = (q @ ks[0].transpose(-1, -2)) * scale                                # [B, H, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [((q * k).sum(-1, keepdim=True)) * scale for k in ks[1:]]          # [B, H, T, 1] each
    p = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = p[..., :T] @ vs[0]
    for i, v in enumerate(vs[1:]):
        out = out + p[..., T + i:T + i + 1] * v
    return out


def reply_rows(lengths: torch.Tensor, reply_start: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, t0): the rows t0 of sequence b whose drafted token, t0 + 2, is a reply token (right-padded to T).
    The target's prediction of that token is its row t0 + 1: the only rows whose logits training reads."""
    pred = torch.arange(T, device=lengths.device)[None, :] + 2
    return ((pred < lengths[:, None]) & (pred >= reply_start[:, None])).nonzero(as_tuple=True)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n] along dim 1, `fill` past the end."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


class Eagle3Head(nn.Module):
    def __init__(self, c: HeadConfig, embedding: torch.Tensor):
        super().__init__()
        self.c = c
        D, q_dim, kv_dim = c.hidden, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.register_buffer("embed", embedding.detach().clone(), persistent=False)   # frozen: the target's
        self.fc = nn.Linear(3 * c.target_hidden, D, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(D))        # over the token embedding
        self.hidden_norm = nn.Parameter(torch.ones(D))      # over g (llama.cpp's attn_norm_2)
        self.q = nn.Linear(2 * D, q_dim, bias=False)
        self.k = nn.Linear(2 * D, kv_dim, bias=False)
        self.v = nn.Linear(2 * D, kv_dim, bias=False)
        self.o = nn.Linear(q_dim, D, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(D))
        self.gate = nn.Linear(D, c.ffn, bias=False)
        self.up = nn.Linear(D, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, D, bias=False)
        self.output_norm = nn.Parameter(torch.ones(D))
        self.lm_head = nn.Linear(D, c.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.arange(c.draft_vocab), persistent=True)

    @torch.no_grad()
    def init_from_target(self, lm_head: torch.Tensor, final_norm: torch.Tensor, d2t: torch.Tensor) -> None:
        """lm_head rows and the output norm from the target's (its rows d2t), d2t itself."""
        self.d2t.copy_(d2t)
        self.lm_head.weight.copy_(lm_head[d2t.to(lm_head.device)].to(self.lm_head.weight))
        self.output_norm.copy_(final_norm.to(self.output_norm))

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, w.shape, w.to(x.dtype), self.c.rms_eps)

    def block(self, tok: torch.Tensor, g: torch.Tensor, pos: torch.Tensor, ks: list, vs: list) -> torch.Tensor:
        """One row per (batch, position): tok [B, T], g [B, T, D], pos [T]; appends this step's keys and
        values to ks / vs (TTT layout) and returns the pre-norm state h [B, T, D]."""
        c = self.c
        B, T = tok.shape
        e = self.embed[tok].to(g.dtype)
        x = torch.cat([self._norm(e, self.attn_norm), self._norm(g, self.hidden_norm)], dim=-1)   # [B, T, 2D]
        q = rope_interleaved(self.q(x).view(B, T, c.n_heads, c.head_dim), pos, c.rope_base)
        k = rope_interleaved(self.k(x).view(B, T, c.n_kv_heads, c.head_dim), pos, c.rope_base)
        v = self.v(x).view(B, T, c.n_kv_heads, c.head_dim)
        rep = c.n_heads // c.n_kv_heads               # query head h reads kv head h // rep, as ggml does
        ks.append(k.transpose(1, 2).repeat_interleave(rep, dim=1))
        vs.append(v.transpose(1, 2).repeat_interleave(rep, dim=1))
        a = ttt_attention(q.transpose(1, 2), ks, vs).transpose(1, 2).reshape(B, T, -1)
        h = g + self.o(a)
        n = self._norm(h, self.ffn_norm)
        return h + self.down(F.silu(self.gate(n)) * self.up(n))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._norm(h, self.output_norm))

    def unroll(self, feats: torch.Tensor, ids: torch.Tensor, steps: int):
        """Yields each TTT step's pre-norm state h [B, T, D]: row t of step j drafts token[t + 2 + j]."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        g = self.fc(feats)
        ks, vs = [], []
        for j in range(steps):
            g = self.block(shift_left(ids, 1 + j), g, pos + j, ks, vs)          # token[t + 1 + j]
            yield g

    def ttt(self, feats, ids, lengths, reply_start, target_logits, target_top, steps: int = 7,
            decay: float = 0.8, rows=None) -> tuple[torch.Tensor, list[float], list[float]]:
        """The weighted TTT loss over a batch, with each step's loss and top-1 agreement.

        feats [B, T, 3 Dt]: the target's layer inputs; ids [B, T] right-padded; lengths, reply_start [B];
        target_logits [B, T, Vd]: the target's logits at each position over the draft vocabulary (d2t);
        target_top [B, T]: the target's top token id over its whole vocabulary. With rows = reply_rows(...)
        given, only those rows' are: target_logits [R, Vd] and target_top [R], row r's being position
        rows[1][r] + 1 of sequence rows[0][r] (the target's prediction of the reply token it drafts).
        Agreement: the head's top token (as a target id) equals the target's, over reply positions
        (a top token outside the draft vocabulary counts as a miss)."""
        t2d = torch.zeros(self.c.target_vocab, dtype=torch.bool, device=ids.device)
        t2d[self.d2t] = True
        T = ids.shape[1]
        # Every step drafts the same tokens: step j's row t0 - j drafts token t0 + 2 (from a chain begun j rows
        # before t0 + 1), against the target's distribution at row t0 + 1. So the rows whose token is a reply
        # token are found once (one read back a batch: their count) and each step scores only those, gathered:
        # the output matrix, the softmax and the loss run over the reply rows alone, not over the prompt and
        # the padding as well, and the target's distribution is made once for all steps.
        if rows is None:
            b, t0 = reply_rows(lengths, reply_start, T)
            target_logits, top = target_logits[b, t0 + 1], target_top[b, t0 + 1]
        else:
            (b, t0), top = rows, target_top
        target_p = torch.softmax(target_logits.float(), dim=-1)              # [R, Vd]; top [R]
        countable = t2d[top]                                                 # the target's top token is draftable
        total = feats.new_zeros((), dtype=torch.float32)
        scores = []
        for j, h in enumerate(self.unroll(feats, ids, steps)):
            if j > T - 3:                          # no row has a token j + 2 on (t0 <= T - 3)
                scores.append(torch.zeros(3, device=ids.device))
                continue
            t = t0 - j
            live = t >= 0                          # the chain begins inside the sequence
            logp = torch.log_softmax(self.logits(h[b, t.clamp(min=0)]), dim=-1, dtype=torch.float32)  # [R, Vd]
            mask = live & countable
            ce = -(target_p * logp).sum(-1)                                    # [R]
            loss = (ce * mask).sum() / mask.sum().clamp(min=1)
            total = total + decay ** j * loss
            with torch.no_grad():
                hit = (self.d2t[logp.argmax(-1)] == top) & live
                scores.append(torch.stack([loss.detach().float(), hit.sum().float(), live.sum().float()]))
        # read back once a batch, not twice a step: each read waits for the GPU to finish all before it
        rows = torch.stack(scores).tolist()
        losses = [r[0] for r in rows]
        accs = [r[1] / max(r[2], 1) for r in rows]
        return total, losses, accs
