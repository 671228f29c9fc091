"""Proposers: each answers one question, "given the accepted context, propose up to k tokens", with a
Proposal (the tokens, and the distributions they were drawn from or None for point masses).

- NgramProposer: prompt lookup (ngram.py), free; its match length says how far to trust it.
- DraftModelProposer: a smaller model with the target's tokenizer, on its own Sequence.
The loop (loop.py) asks them in turn and verifies whatever comes back the same way (verify.py); the
policy (policy.py) decides how far they draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from jllm.sampling import SamplingParams, draw, probs
from jllm.sequence import Sequence
from jllm.spec.ngram import NgramIndex
from jllm.spec.policy import draft_goes_on, leaf_position


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None       # [n, V'] the distributions the tokens were drawn from; None: point
                                            # masses (greedy, n-gram). V' <= V: a draft scoring fewer ids
    kind: str = "ngram"                     # which proposer: "ngram", "draft"
    leaf: tuple[int, int] | None = None     # a side leaf to verify too: (index i, an alternative to tokens[i])
    forwards: int = 0                       # the proposer's forward passes
    step_s: float | None = None             # the time of its latest one-token step (None: none was run)
    match: int = 0                          # n-gram: the length of the matched suffix


@dataclass
class Limits:
    """What a round asks of a proposer beyond k."""
    params: SamplingParams = field(default_factory=SamplingParams)
    gen: torch.Generator | None = None
    k_min: int = 1                          # draft at least this many (when the proposer can)
    p_min: float = 0.0                      # a draft model drafts on while its chain's probability is above
    leaf_p: float = 0.0                     # greedy: propose a side leaf where a token's probability is below
    extend: Callable[[int, float], bool] | None = None   # policy: whether an n-th token pays, given the chain


class NgramProposer:
    """Prompt lookup over the accepted context. The index follows the context itself: tokens appended since
    the last call are indexed, and a context that is not an extension of the last one starts it over."""

    kind = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        self.index = NgramIndex(max_ngram, min_ngram)

    def propose(self, context: list[int], k: int, limits: Limits | None = None) -> Proposal:
        held = self.index.tokens
        if len(context) < len(held) or context[:len(held)] != held:
            self.index.reset(context)
        else:
            self.index.extend(context[len(held):])
        tokens = self.index.propose(k)
        return Proposal(tokens, kind="ngram", match=self.index.last_match_len)


class DraftModelProposer:
    """A draft model on its own Sequence, kept equal to a prefix of the target's context. Drafting goes on
    while the product of the draft's probabilities of its tokens stays >= p_min (its top probability when
    greedy; q of the drawn token when sampling, against half the threshold) and the policy's `extend` agrees
    (policy.draft_goes_on)."""

    kind = "draft"

    def __init__(self, seq: Sequence):
        self.seq = seq
        kernels = getattr(seq.model, "kernels", None)
        self.top_prob = kernels.top_prob if kernels is not None else None   # argmax and its probability, native

    def propose(self, context: list[int], k: int, limits: Limits) -> Proposal:
        params = limits.params
        t = time.perf_counter()
        logits = self.seq.sync(context)
        step_s = time.perf_counter() - t if self.seq.evaluated == 1 else None
        forwards = 1
        threshold = limits.p_min if params.greedy else limits.p_min * 0.5
        tokens, qs, ps, logits_at, chain = [], [], [], [], 1.0
        while True:
            tok, p, q = self._choose(logits, params, limits.gen, context + tokens)
            tokens.append(tok)
            ps.append(p)
            logits_at.append(logits)
            if q is not None:
                qs.append(q)
            chain *= p
            if not draft_goes_on(len(tokens), k, limits.k_min, chain, threshold, limits.extend):
                break
            t = time.perf_counter()
            logits = self.seq.step(tok)
            step_s = time.perf_counter() - t
            forwards += 1
        leaf = None
        if params.greedy and limits.leaf_p > 0:
            i = leaf_position(ps, limits.leaf_p)
            if i is not None:
                alt = [a for a in logits_at[i].float().topk(2).indices.tolist() if a != tokens[i]][0]
                leaf = (i, alt)
        return Proposal(tokens, torch.stack(qs) if qs else None, kind="draft", leaf=leaf, forwards=forwards,
                        step_s=step_s)

    def _choose(self, logits: torch.Tensor, params: SamplingParams, gen, history: list[int]):
        """-> (token, its probability, the distribution it was drawn from or None when greedy)."""
        if params.greedy and self.top_prob is not None:
            tok, p = self.top_prob(logits.float())
            return tok, p, None
        if params.greedy:
            top_p, tok = torch.softmax(logits.float(), -1).max(-1)
            return int(tok), top_p.item(), None
        q = probs(logits, params, history)
        tok = int(draw(q[None], gen)[0])
        return tok, q[tok].item(), q
