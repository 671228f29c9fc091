"""A Sequence: one model's KV cache and the token ids it holds, kept in step.

Position i of the cache holds the keys and values of ids[i], always. Every change goes through a method
here, so the two cannot drift apart:
    sync(context)       make the sequence hold `context`, reusing the longest common prefix, evaluating the rest
    forward(tokens)     evaluate tokens after the held ones (a decode step, a verify block)
    keep(start, ids)    after a verify block: positions from `start` hold `ids`, the rest is dropped
    rollback(n)         hold only the first n tokens (a rejection moves a length; later writes overwrite)
    reset()             hold nothing
    load / export       the persistent KV cache's hydrate and save
The target, the draft model and the KV store's hydrate all use it (engine.py, spec/proposers.py).

With `capture` (an EAGLE-3 head's target layers) every forward also keeps the captured hidden states of its
rows by position in `features` [max_tokens, len(capture) * hidden], the head's input. They are valid from
`features_from` on: positions loaded from the persistent store were never computed here.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

PREFILL_CHUNK = 256     # tokens per prefill call on the CPU: bounds the activations' memory, costs nothing in speed
CUDA_PREFILL_CHUNK = 512    # on the GPU: fewer launches and passes over the f16 matrices; 1,024 would put a
                            # Qwen3-4B past the 3.5 GB of the origin document's budget (BENCHMARKS.md, session 24)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Sequence:
    def __init__(self, model, max_tokens: int, capture: tuple[int, ...] | None = None):
        """model: a jllm.model.transformer.Transformer (anything with new_cache, forward and device)."""
        self.model = model
        self.cache = model.new_cache(max_tokens)
        self.ids: list[int] = []
        self.evaluated = 0          # tokens the latest sync() ran through the model
        self.capture = tuple(capture) if capture else None
        self.features = None
        self.features_from = 0
        self.epoch = 0              # bumped by every change but a greedy chain's own (chain_tokens)
        if self.capture:            # bf16: the head only proposes, and the residual stream's range needs its exponent
            self.features = torch.zeros(max_tokens, len(self.capture) * model.cfg.hidden, dtype=torch.bfloat16,
                                        device=model.device)      # where the head runs: the target's device

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def max_tokens(self) -> int:
        return self.cache.max_tokens

    def sync(self, context: list[int]) -> torch.Tensor:
        """Hold exactly `context` (non-empty): cut back to the longest common prefix, but at least one token
        short of it, and evaluate the rest in chunks. Returns the logits after context[-1] [vocab]."""
        keep = min(common_prefix(self.ids, context), len(context) - 1)
        self.rollback(keep)
        logits = None
        chunk = getattr(self.model, "prefill_chunk", PREFILL_CHUNK)
        for s in range(keep, len(context), chunk):
            logits = self.forward(context[s:s + chunk], last_only=True)[-1]
        self.evaluated = len(context) - keep
        return logits

    def forward(self, tokens: list[int], last_only: bool = False, tree: list[int] | None = None) -> torch.Tensor:
        """Evaluate `tokens` after the held ones and hold them too -> logits [T, vocab] ([1, vocab] with
        last_only). tree: see Transformer.forward (the last len(tree) tokens are tree rows with these parents;
        a side leaf is a tree of one row). Until keep(), position start + row holds row's token whatever its
        depth."""
        start = len(self.ids)
        self.epoch += 1
        x = torch.tensor(tokens)            # on the host: the embedding looks rows up there (no device sync)
        if self.capture is None:
            logits = self.model.forward(x, self.cache, last_only=last_only, tree=tree)
        else:
            logits, hidden = self.model.forward(x, self.cache, last_only=last_only, capture=self.capture, tree=tree)
            self.features[start:start + len(tokens)] = hidden
        self.ids.extend(tokens)
        return logits

    def step(self, token: int) -> torch.Tensor:
        """One decode step -> logits after `token` [vocab]."""
        return self.forward([token])[-1]

    def chains(self) -> bool:
        """Whether greedy steps can run chained on the device (chain_tokens)."""
        return getattr(self.model, "chain", None) is not None

    def chain_tokens(self, token: int, limit: int) -> Iterator[int]:
        """Greedy decoding after `token` on the device (jllm.cuda.chain): the next tokens, at most `limit`, held
        as device_tokens holds them."""
        return self.device_tokens(token, lambda owned: self.model.chain.tokens(
            token, self.cache, len(self.ids), limit, self.capture, self.features))

    def device_tokens(self, token: int, source: Callable[[Callable[[], bool]], Iterator[int]]) -> Iterator[int]:
        """Tokens after `token` computed on the device ahead of the host (jllm.cuda.chain, jllm.cuda.rounds):
        source(owned) iterates them, having written their positions past the held ones; owned() says whether
        the sequence is still this generator's (for the source's own state beside it, as a head's). Once t_j
        is yielded the sequence holds `token` .. t_(j-1), what step() would hold; the cache has been computed
        further, and when the generator ends (closed, or run out) the source is closed and the positions past
        the held ones are dropped. Unless the sequence has changed since (a generation dropped unclosed, finalised
        during another one): then it is not this generator's to touch."""
        if self.cache.length != len(self.ids):
            raise ValueError(f"device_tokens: a cache of {self.cache.length} positions holds {len(self.ids)} ids")
        self.epoch += 1
        mine = self.epoch
        prev = token
        tokens = source(lambda: self.epoch == mine)
        try:
            for t in tokens:
                self.ids.append(prev)
                prev = t
                yield t
        finally:
            if hasattr(tokens, "close"):
                tokens.close()
            if self.epoch == mine:
                self.rollback(len(self.ids))

    def keep(self, start: int, ids: list[int], rows: list[int] | None = None) -> None:
        """After a forward over a verify block that began at `start`: positions start.. now hold `ids`, and
        everything past them is dropped. rows: the block rows ids were evaluated in (a tree's accepted path or a
        taken side leaf; increasing, rows[j] >= j), each moved to start + j; None: rows 0, 1, ... (a chain)."""
        end = start + len(ids)
        self.epoch += 1
        if end > len(self.ids):
            raise ValueError(f"cannot keep {len(ids)} tokens from {start} in a sequence of {len(self.ids)}")
        moves = []
        if rows is not None:
            if len(rows) != len(ids) or any(r < j or start + r >= len(self.ids) for j, r in enumerate(rows)):
                raise ValueError(f"rows {rows} do not place {len(ids)} tokens of a block at {start}")
            moves = [(start + r, start + j) for j, r in enumerate(rows) if r != j]
        for src, dst in moves:              # increasing: a source is never a slot already written (rows[j] >= j)
            self.cache.move(src, dst)
            if self.features is not None:
                self.features[dst] = self.features[src]
        self.cache.truncate(end)
        self.ids[start:] = ids

    def rollback(self, n: int) -> None:
        """Hold only the first n tokens."""
        self.epoch += 1
        self.cache.truncate(n)
        del self.ids[n:]
        self.features_from = min(self.features_from, n)

    def reset(self) -> None:
        self.rollback(0)

    def load(self, ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Hold `ids`, whose keys and values are k, v [n_layers, n_kv_heads, len(ids), head_dim] (export's)."""
        if k.shape[2] != len(ids):
            raise ValueError(f"{len(ids)} ids for a state of {k.shape[2]} positions")
        self.epoch += 1
        self.cache.load(k.to(self.model.device), v.to(self.model.device))
        self.ids = list(ids)
        self.features_from = len(ids)

    def export(self, n: int | None = None) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The first n held tokens (all by default) with copies of their keys and values, on the CPU."""
        n = len(self.ids) if n is None else n
        k, v = self.cache.export(n)
        return list(self.ids[:n]), k.cpu(), v.cpu()
