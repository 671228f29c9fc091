"""Batched decoding for making training data: many prompts at once over a static KV cache, one CUDA graph
per decode step.

Why not transformers' `generate`: on the H200 it spent ~130 ms a step whatever the batch or context (the
first data run: 3.5k tok/s at batch 512, and three processes side by side together only 4k), so the GPU
mostly waited on Python. Here the weights are the Hugging Face model's own tensors, read once; the cache is
allocated once, [layers, batch, kv heads, prompt + max_new, head_dim]; a decode step is a fixed sequence of
kernels, captured as a CUDA graph and replayed (on the CPU it runs eagerly, the same code), one graph for each
span of slots a step attends over (the first multiple of SPAN that holds every row's keys).

Layout: each row has its own write slot slot[b] and first valid slot start[b]: a group of prompts prefilled
together is left-padded to its width W (start = W - len), and its rows then write their steps at W, W + 1, ...
Row b's RoPE position is slot[b] - start[b]. More prompts than rows stream through: every REFILL steps the
rows whose reply ended hand it in and take the next prompts (prefilled together), so a batch does not run on
part-empty until its longest reply ends. The model math is the Hugging Face Llama/Qwen2/Qwen3 decoder
(rotate-halves RoPE, q/k biases where the model has them, Qwen3's per-head q/k norms);
tests/test_train_head.py checks greedy output token for token against `generate`, with and without refills.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REFILL = 16          # decode steps between looks at which rows have ended (each look waits for the GPU)
SPAN = 256           # a step attends over the first multiple of SPAN slots that holds every row's keys


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
        self.slot = torch.zeros(batch, dtype=torch.long, device=self.dev)       # where row b writes its token
        self.start = torch.zeros(batch, dtype=torch.long, device=self.dev)      # row b's first valid slot
        self.logits = None
        self.graphs = {}                     # slots attended -> (the CUDA graph of a step, its logits)

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

    def _step(self, span: int):
        """One decode step for every row: token tok[b] at cache slot slot[b] -> self.logits [B, V]. The
        attention reads the first `span` slots of the cache, which hold every row's keys (slot[b] < span):
        a step's cost then grows with the rows' lengths, not with the cache's."""
        slots = torch.arange(span, device=self.dev)
        pos = (self.slot - self.start)[:, None]                                # [B, 1]
        mask = ((slots[None, :] >= self.start[:, None]) & (slots[None, :] <= self.slot[:, None]))[:, None, None, :]

        at = self.slot[:, None, None, None].expand(self.B, self.n_kv, 1, self.hd)

        def write(li, k, v):                                                   # k, v [B, Hk, 1, hd]
            self.k_cache[li].scatter_(2, at, k)
            self.v_cache[li].scatter_(2, at, v)
            return self.k_cache[li][:, :, :span], self.v_cache[li][:, :, :span]

        x = self._layers(self.embed[self.tok][:, None, :], pos, write, mask)
        return F.linear(self._rms(x[:, 0], self.norm), self.lm_head)

    @torch.no_grad()
    def _prefill(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Left-padded prompts ids [b, W] for cache rows `rows` (ids [b], their start already set) -> the last
        position's logits [b, V]."""
        b, W = ids.shape
        pad = self.start[rows]
        slots = torch.arange(W, device=self.dev)
        pos = (slots[None, :] - pad[:, None]).clamp(min=0)
        valid = slots[None, :] >= pad[:, None]
        mask = (slots[None, :, None] >= slots[None, None, :]) & valid[:, None, :]        # [b, W, W]
        mask = mask | ~valid[:, :, None]           # a pad row attends to all (its output is never used)

        def write(li, k, v):
            self.k_cache[li][rows, :, :W] = k
            self.v_cache[li][rows, :, :W] = v
            return k, v

        x = self._layers(self.embed[ids], pos, write, mask[:, None])
        return F.linear(self._rms(x[:, -1], self.norm), self.lm_head)

    # ----------------------------------------------------------------------------------------- decoding

    def _decode(self, span: int) -> torch.Tensor:
        """Run one step over `span` slots -> the logits [B, V]: on CUDA by the graph of that span, captured the
        first time it is needed (its warm-up runs the same step on the same inputs, so the cache it writes is
        the step's own), eagerly elsewhere."""
        if self.dev.type != "cuda":
            return self._step(span)
        if span not in self.graphs:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    self._step(span)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._step(span)
            self.graphs[span] = (graph, logits)
        graph, logits = self.graphs[span]
        graph.replay()
        return logits

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new: int, stop_ids, sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, pad_id: int = 0,
                 prefill_tokens: int = 1 << 16) -> list[list[int]]:
        """Each prompt's continuation, stopping after a token in `stop_ids` (kept) or after max_new tokens;
        greedy unless `sample` (temperature, then nucleus top_p). Any number of prompts: they take the B rows
        in order, and a row whose reply has ended takes the next prompt at the next look (every REFILL steps)."""
        if not prompts:
            return []
        W = max(len(p) for p in prompts)
        if W + max_new > self.T:
            raise ValueError(f"prompts of up to {W} tokens + {max_new} exceed the decoder's {self.T} slots")
        B, dev = self.B, self.dev
        gen = torch.Generator(device=dev).manual_seed(seed)
        stops = torch.tensor(sorted(stop_ids), device=dev)
        every = torch.arange(B, device=dev)
        out = torch.zeros(B, max_new, dtype=torch.long, device=dev)    # row b's reply so far: out[b, :n[b]]
        n = torch.zeros(B, dtype=torch.long, device=dev)
        done = torch.ones(B, dtype=torch.bool, device=dev)            # no prompt, or its reply has ended
        tok = torch.zeros(B, dtype=torch.long, device=dev)            # the token each row feeds next
        owner = [-1] * B                                               # the prompt each row works on
        result: list[list[int]] = [[] for _ in prompts]
        taken = 0

        def refill(free: list[int]) -> None:
            """Rows `free` take the next prompts: prefilled together (in parts of about prefill_tokens), their
            first tokens chosen."""
            nonlocal taken
            free = free[:len(prompts) - taken]
            if not free:
                return
            group = prompts[taken:taken + len(free)]
            for b in free:
                owner[b] = taken
                taken += 1
            w = max(len(p) for p in group)
            ids = torch.full((len(free), w), pad_id, dtype=torch.long)
            for i, p in enumerate(group):
                ids[i, w - len(p):] = torch.tensor(p)
            rows = torch.tensor(free, device=dev)
            self.start[rows] = torch.tensor([w - len(p) for p in group], device=dev)
            self.slot[rows] = w
            ids = ids.to(dev)
            per = max(1, prefill_tokens // w)
            for r in range(0, len(free), per):
                part = rows[r:r + per]
                first = self._choose(self._prefill(ids[r:r + per], part), sample, temperature, top_p, gen)
                tok[part] = first
                out[part, 0] = first
                n[part] = 1
                done[part] = torch.isin(first, stops) | (max_new <= 1)

        refill(list(range(B)))
        step = top = 0
        while True:
            if step % REFILL == 0:
                ended = [b for b in done.nonzero()[:, 0].tolist() if owner[b] >= 0]
                if ended:
                    for b, row, k in zip(ended, out[ended].tolist(), n[ended].tolist()):
                        result[owner[b]] = row[:k]
                        owner[b] = -1
                    refill(ended)
                if taken == len(prompts) and bool(done.all()):
                    break
                top = int(self.slot.max()) - step           # + step: a bound on every row's slot until the next look
            self.tok.copy_(tok)
            self.logits = self._decode(min(self.T, -(-(top + step + 1) // SPAN) * SPAN))
            new = self._choose(self.logits, sample, temperature, top_p, gen)
            live = ~done
            tok = torch.where(live, new, tok)
            at = n.clamp(max=max_new - 1)
            out[every, at] = torch.where(live, new, out[every, at])
            n += live.long()
            done |= live & (torch.isin(new, stops) | (n >= max_new))
            self.slot += live.long()         # an ended row stays where it is until a refill moves it
            step += 1
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
