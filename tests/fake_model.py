"""A model without weights for the loop's tests: its logits at a position are a fixed function of the two
tokens ending there, so its greedy text is known in advance and every row is independent of the others in
its call (the batch invariance the real forward guarantees). Keys hold the token ids, so a rollback that
forgets to move a length, or a side leaf put in the wrong place, changes what it computes next."""

from __future__ import annotations

import torch

from jllm.model.kv_cache import KVCache


class FakeModel:
    def __init__(self, vocab: int = 50, seed: int = 0):
        self.vocab = vocab
        self.device = torch.device("cpu")
        self.stack = object()            # the loop verifies side leaves only on a native stack
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, vocab, generator=g)    # (previous, current) -> logits
        self.calls: list[int] = []       # tokens per forward call

    def new_cache(self, max_tokens: int) -> KVCache:
        return KVCache(1, 1, 1, max_tokens)

    def logits_after(self, prev: int, tok: int) -> torch.Tensor:
        return self.table[prev, tok]

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False,
                tree: list[int] | None = None) -> torch.Tensor:
        T = tokens.shape[0]
        start = cache.reserve(T)
        cache.k[0, 0, start:start + T, 0] = tokens.float()
        cache.length = start + T
        self.calls.append(T)
        held = cache.k[0, 0, :cache.length, 0].long().tolist()
        rows = []
        tree = tree or []
        for i in range(T):
            pos = start + i
            if i >= T - len(tree):                       # a tree row follows its parent row
                pos_prev = start + tree[i - (T - len(tree))]
            else:
                pos_prev = pos - 1
            prev = held[pos_prev] if pos_prev >= 0 else 0
            rows.append(self.logits_after(prev, held[pos]))
        out = torch.stack(rows)
        return out[-1:] if last_only else out

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """The plain greedy continuation, computed directly from the table."""
        ids = list(prompt)
        for _ in range(n):
            prev = ids[-2] if len(ids) > 1 else 0
            ids.append(int(self.logits_after(prev, ids[-1]).argmax()))
        return ids[len(prompt):]
