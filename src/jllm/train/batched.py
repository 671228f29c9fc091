"""Batched decoding for making training data: many prompts at once over a static KV cache, one CUDA graph
per decode step.

Why not transformers' `generate`: on the H200 it spent ~130 ms a step whatever the batch or context (the
first data run: 3.5k tok/s at batch 512, and three processes side by side together only 4k), so the GPU
mostly waited on Python. Here the weights are the Hugging Face model's own tensors, read once; the cache is
allocated once, [layers, batch, kv heads, prompt + max_new, head_dim]; a decode step is a fixed sequence of
kernels, captured once as a CUDA graph and replayed (on the CPU it runs eagerly, the same code).

Layout: prompts are left-padded to a common width W, so every row writes its step s at cache slot W + s;
row b's RoPE position is slot - pad[b] and its keys valid from slot pad[b]. The model math is the Hugging
Face Llama/Qwen2/Qwen3 decoder (rotate-halves RoPE, q/k biases where the model has them, Qwen3's per-head
q/k norms); tests/test_train_head.py checks greedy output token for token against `generate`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class BatchedDecoder:
    def __init__(self, hf_model, batch: int, max_len: int):
        m = hf_model.model
        cfg = hf_model.config
        self.dev = hf_model.lm_head.weight.device
        self.dtype = hf_model.lm_head.weight.dtype
        self.B, self.T = batch, max_len
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.hd, 2, device=self.dev, dtype=torch.float32)
                                         / self.hd))
        self.embed = m.embed_tokens.weight
        self.norm = m.norm.weight
        self.lm_head = hf_model.lm_head.weight
        self.layers = []
        for layer in m.layers:
            at, mlp = layer.self_attn, layer.mlp
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                q=at.q_proj.weight, qb=at.q_proj.bias, k=at.k_proj.weight, kb=at.k_proj.bias,
                v=at.v_proj.weight, vb=at.v_proj.bias, o=at.o_proj.weight,
                qn=getattr(getattr(at, "q_norm", None), "weight", None),
                kn=getattr(getattr(at, "k_norm", None), "weight", None),
                gate=mlp.gate_proj.weight, up=mlp.up_proj.weight, down=mlp.down_proj.weight))
        L = len(self.layers)
        self.k_cache = torch.zeros(L, batch, self.n_kv, max_len, self.hd, device=self.dev, dtype=self.dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        # the step's inputs, fixed tensors so that a captured graph reads them
        self.tok = torch.zeros(batch, dtype=torch.long, device=self.dev)
        self.slot = torch.zeros((), dtype=torch.long, device=self.dev)
        self.pad = torch.zeros(batch, dtype=torch.long, device=self.dev)
        self.logits = None
        self.graph = None

    # ----------------------------------------------------------------------------------------- the math

    def _rms(self, x, w):
        return F.rms_norm(x, w.shape, w, self.eps)

    def _rope(self, x, pos):
        """x [B, H, S, hd], pos [B, S] -> rotate-halves RoPE."""
        ang = pos.to(torch.float32)[:, None, :, None] * self.inv_freq          # [B, 1, S, hd/2]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        half = self.hd // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + rot.float() * sin).to(x.dtype)

    def _layers(self, x, pos, write, mask):
        """x [B, S, D] at RoPE positions pos [B, S]; write(l, k, v) stores the new keys and values and returns
        the keys and values to attend over; mask [B, 1, S, K] (True: attend)."""
        B, S, _ = x.shape
        for li, w in enumerate(self.layers):
            h = self._rms(x, w["ln1"])
            q = F.linear(h, w["q"], w["qb"]).view(B, S, self.n_heads, self.hd).transpose(1, 2)
            k = F.linear(h, w["k"], w["kb"]).view(B, S, self.n_kv, self.hd).transpose(1, 2)
            v = F.linear(h, w["v"], w["vb"]).view(B, S, self.n_kv, self.hd).transpose(1, 2)
            if w["qn"] is not None:
                q, k = self._rms(q, w["qn"]), self._rms(k, w["kn"])
            q, k = self._rope(q, pos), self._rope(k, pos)
            keys, values = write(li, k, v)
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                               enable_gqa=self.n_heads != self.n_kv)
            x = x + F.linear(a.transpose(1, 2).reshape(B, S, -1), w["o"])
            h = self._rms(x, w["ln2"])
            x = x + F.linear(F.silu(F.linear(h, w["gate"])) * F.linear(h, w["up"]), w["down"])
        return x

    def _step(self):
        """One decode step for every row: token self.tok at cache slot self.slot -> self.logits [B, V]."""
        slots = torch.arange(self.T, device=self.dev)
        pos = (self.slot - self.pad)[:, None]                                  # [B, 1]
        mask = ((slots[None, :] >= self.pad[:, None]) & (slots[None, :] <= self.slot))[:, None, None, :]

        def write(li, k, v):
            self.k_cache[li].index_copy_(2, self.slot[None], k)
            self.v_cache[li].index_copy_(2, self.slot[None], v)
            return self.k_cache[li], self.v_cache[li]

        x = self._layers(self.embed[self.tok][:, None, :], pos, write, mask)
        self.logits = F.linear(self._rms(x[:, 0], self.norm), self.lm_head)

    @torch.no_grad()
    def _prefill(self, ids: torch.Tensor, rows: slice) -> torch.Tensor:
        """Left-padded prompts ids [b, W] for cache rows `rows` -> the last position's logits [b, V]."""
        b, W = ids.shape
        pad = self.pad[rows]
        slots = torch.arange(W, device=self.dev)
        pos = (slots[None, :] - pad[:, None]).clamp(min=0)
        valid = slots[None, :] >= pad[:, None]
        mask = (slots[None, :, None] >= slots[None, None, :]) & valid[:, None, :]        # [b, W, W]
        mask = mask | ~valid[:, :, None]           # a pad row attends to all (its output is never used)

        def write(li, k, v):
            self.k_cache[li, rows, :, :W] = k
            self.v_cache[li, rows, :, :W] = v
            return k, v

        x = self._layers(self.embed[ids], pos, write, mask[:, None])
        return F.linear(self._rms(x[:, -1], self.norm), self.lm_head)

    # ----------------------------------------------------------------------------------------- decoding

    def _capture(self):
        if self.dev.type != "cuda" or self.graph is not None:
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new: int, stop_ids, sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, pad_id: int = 0,
                 prefill_tokens: int = 1 << 16) -> list[list[int]]:
        """Each prompt's continuation, stopping after a token in `stop_ids` (kept) or after max_new tokens;
        greedy unless `sample` (temperature, then nucleus top_p)."""
        n = len(prompts)
        W = max(len(p) for p in prompts)
        if n > self.B or W + max_new > self.T:
            raise ValueError(f"{n} prompts of up to {W} tokens + {max_new} exceed the decoder's "
                             f"{self.B} rows of {self.T} slots")
        ids = torch.full((self.B, W), pad_id, dtype=torch.long)
        pad = torch.full((self.B,), W - 1, dtype=torch.long)       # unused rows: one pad token
        for i, p in enumerate(prompts):
            ids[i, W - len(p):] = torch.tensor(p)
            pad[i] = W - len(p)
        ids = ids.to(self.dev)
        self.slot.fill_(self.T - 1)          # the capture's warm-up writes this slot, which no row reads yet
        self._capture()
        self.pad.copy_(pad)
        logits = torch.empty(self.B, self.lm_head.shape[0], device=self.dev, dtype=self.dtype)
        per = max(1, prefill_tokens // W)
        for r in range(0, self.B, per):
            rows = slice(r, min(self.B, r + per))
            logits[rows] = self._prefill(ids[rows], rows)
        gen = torch.Generator(device=self.dev).manual_seed(seed)
        stops = torch.tensor(sorted(stop_ids), device=self.dev)
        out = torch.empty(self.B, max_new, dtype=torch.long, device=self.dev)
        done = torch.zeros(self.B, dtype=torch.bool, device=self.dev)
        done[n:] = True
        steps = 0
        for s in range(max_new):
            tok = self._choose(logits, sample, temperature, top_p, gen)
            out[:, s] = tok
            steps = s + 1
            done |= torch.isin(tok, stops)
            if s + 1 == max_new or ((s + 1) % 16 == 0 and bool(done.all())):
                break
            self.tok.copy_(tok)
            self.slot.fill_(W + s)
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
            logits = self.logits
        result = []
        for row in out[:n, :steps].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))
            result.append(row[:cut])
        return result

    @staticmethod
    def _choose(logits, sample, temperature, top_p, gen):
        if not sample:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        if top_p >= 1.0:
            return torch.multinomial(probs, 1, generator=gen)[:, 0]
        p, idx = nucleus(probs, top_p)
        return idx.gather(-1, torch.multinomial(p, 1, generator=gen))[:, 0]


def nucleus(probs: torch.Tensor, top_p: float, k: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Nucleus (top-p) filtering of probs [B, V]: (p, idx) [B, K], each row's probabilities in descending order
    with those past the smallest prefix reaching top_p zeroed, and their token ids. The prefix is looked for
    among the k most probable tokens (one top-k, not a sort of the whole vocabulary); rows whose k most
    probable tokens hold less than top_p are sorted whole, so the nucleus is the same either way (K = V then)."""
    V = probs.shape[-1]
    p, idx = probs.topk(min(k, V), dim=-1)
    if k < V and not bool((p.sum(-1) >= top_p).all()):
        p, idx = probs.sort(dim=-1, descending=True)
    keep = p.cumsum(-1) - p < top_p                       # the smallest prefix reaching top_p
    return p * keep, idx
