"""Proposers: each answers one question, "given the accepted context, propose up to k tokens", with a
Proposal (the tokens, and the distributions they were drawn from or None for point masses).

- NgramProposer: prompt lookup (ngram.py), free; its match length says how far to trust it.
- DraftModelProposer: a smaller model with the target's tokenizer, on its own Sequence.
- HeadProposer: an EAGLE-3 head (jllm/eagle3) over the target's own hidden states.
The loop (loop.py) asks them in turn and verifies whatever comes back the same way (verify.py); the
policy (policy.py) decides how far they draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from jllm.sampling import SamplingParams, draw, probs
from jllm.eagle3.head import Step
from jllm.sequence import Sequence, common_prefix
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
    tree: list[int] | None = None           # greedy: a tree of drafts, the block row of each token's parent (row 0
                                            # the token before them, tokens[j] at row j + 1); its first chain
                                            # comes first (tree[j] == j). None: a chain


@dataclass
class Limits:
    """What a round asks of a proposer beyond k."""
    params: SamplingParams = field(default_factory=SamplingParams)
    gen: torch.Generator | None = None
    k_min: int = 1                          # draft at least this many (when the proposer can)
    p_min: float = 0.0                      # a draft model drafts on while its chain's probability is above
    leaf_p: float = 0.0                     # greedy: propose a side leaf where a token's probability is below
    extend: Callable[..., bool] | None = None   # policy: whether an n-th token pays, given the chain (and
                                                # free=True: a token that costs no draft step)
    draft_tau: float = 1.0                  # sampled: drafts are drawn at this times the sampling temperature
    tree: tuple[int, int, int, float] | None = None  # greedy, a head: draft a tree of (children per expanded
                                                # node, nodes expanded per depth, nodes at most, the least
                                                # probability of a node's path); None: a chain


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


def draft_chain(logits: torch.Tensor, step, k: int, limits: Limits, context: list[int], choose) -> Proposal:
    """The drafting loop shared by the model proposers. logits: the proposer's prediction of the first token;
    step(token) -> the prediction of the next one (one forward pass); choose(logits, params, gen, history) ->
    (token, its probability, the distribution it was drawn from or None). Drafting goes on while the
    product of the probabilities (`chain`) stays >= p_min (against half of it when sampling) and the
    policy's `extend` agrees (policy.draft_goes_on). Greedy with leaf_p > 0: a side leaf, the second choice
    at the least confident position (policy.leaf_position)."""
    params = limits.params
    threshold = limits.p_min if params.greedy else limits.p_min * 0.5
    tokens, qs, ps, logits_at, chain = [], [], [], [], 1.0
    step_s, forwards = None, 0
    while True:
        tok, p, q = choose(logits, params, limits.gen, context + tokens, limits.draft_tau)
        tokens.append(tok)
        ps.append(p)
        logits_at.append(logits)
        if q is not None:
            qs.append(q)
        chain *= p
        if not draft_goes_on(len(tokens), k, limits.k_min, chain, threshold, limits.extend):
            break
        t = time.perf_counter()
        logits = step(tok)
        step_s = time.perf_counter() - t
        forwards += 1
    leaf = None
    if params.greedy and limits.leaf_p > 0:
        i = leaf_position(ps, limits.leaf_p)
        if i is not None:
            leaf = (i, choose.second(logits_at[i], tokens[i]))
    return Proposal(tokens, torch.stack(qs) if qs else None, leaf=leaf, forwards=forwards, step_s=step_s)


@dataclass
class _Node:
    token: int                  # a target id
    parent: int                 # the parent node's index, -1: the root (the context)
    depth: int
    p: float                    # the product of the proposer's probabilities along its path
    kv: tuple | None = None     # after its expansion: its own step's key and value, and its output state
    state: torch.Tensor | None = None


def draft_tree(logits: torch.Tensor, state: torch.Tensor, expand, k: int, limits: Limits, to_target) -> Proposal:
    """Greedy drafting of a tree (EAGLE-2's kind, cost-gated): the root's children are the proposer's `width`
    most likely tokens; depth by depth, candidates (each expanded node's `width` best children, with the
    product of probabilities along their paths, p) are added best first while one more verify row pays for
    its p (limits.extend with free=True: a row, no draft step: a depth's nodes share one batched step) and
    the node count allows; then the `branches` best nodes just added are expanded by one batched step while
    their p keeps the chain rule (>= p_min and limits.extend paying a draft step and a row, as a chain's next
    token). With width 1 and branches 1 this is the chain of draft_chain. expand(nodes, parents' states,
    paths) -> (logits [W, V'], states [W, D], own keys and values); to_target maps a logits index to a
    target id. The tokens come out first chain first (each node's most likely child), then by depth."""
    width, branches, max_nodes, p_node = limits.tree
    extend = limits.extend
    nodes: list[_Node] = []
    frontier = [(-1, logits, 1.0)]
    forwards, step_s = 0, None
    for depth in range(1, k + 1):
        cands = []
        for ni, lg, p in frontier:
            q, ids = torch.softmax(lg.float(), -1).topk(width)
            cands += [(p * qq, ni, ii) for qq, ii in zip(q.tolist(), ids.tolist())]
        cands.sort(key=lambda c: -c[0])
        added = []
        for p, ni, ii in cands:
            n = len(nodes)
            forced = depth <= limits.k_min and not added        # the first chain reaches k_min whatever it costs
            if n >= max_nodes or not forced and (p < p_node or extend is not None and not extend(n + 1, p, True)):
                break
            nodes.append(_Node(to_target(ii), ni, depth, p))
            added.append(n)
        if not added or depth == k or len(nodes) >= max_nodes:      # no room for children: no step for them
            break
        grow = [i for j, i in enumerate(added[:branches])
                if j == 0 and depth < limits.k_min or
                nodes[i].p >= limits.p_min and (extend is None or extend(len(nodes) + 1, nodes[i].p))]
        if not grow:
            break
        t = time.perf_counter()
        out, states, own = expand([nodes[i] for i in grow],
                                  torch.stack([state if nodes[i].parent < 0 else nodes[nodes[i].parent].state
                                               for i in grow]),
                                  [_path(nodes, nodes[i].parent) for i in grow])
        step_s, forwards = time.perf_counter() - t, forwards + 1
        for r, i in enumerate(grow):
            nodes[i].kv, nodes[i].state = own[r], states[r]
        frontier = [(i, out[r], nodes[i].p) for r, i in enumerate(grow)]
    order = _chain_first(nodes)
    row = {ni: r + 1 for r, ni in enumerate(order)}
    parents = [row.get(nodes[ni].parent, 0) for ni in order]
    tree = parents if any(p != j for j, p in enumerate(parents)) else None
    return Proposal([nodes[ni].token for ni in order], kind="head", tree=tree, forwards=forwards, step_s=step_s)


def _path(nodes: list[_Node], i: int) -> list:
    """The keys and values of node i's steps and its ancestors', root first (i = -1: none)."""
    out = []
    while i >= 0:
        out.append(nodes[i].kv)
        i = nodes[i].parent
    return out[::-1]


def _chain_first(nodes: list[_Node]) -> list[int]:
    """Node indices: the first chain (from the root, each node's most likely child), then the rest by depth
    and likelihood (parents before children)."""
    best: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n.parent not in best or n.p > nodes[best[n.parent]].p:
            best[n.parent] = i
    chain, at = [], -1
    while at in best:
        at = best[at]
        chain.append(at)
    on = set(chain)
    rest = sorted((i for i in range(len(nodes)) if i not in on), key=lambda i: (nodes[i].depth, -nodes[i].p))
    return chain + rest


class Chooser:
    """Picks a draft token from a proposer's logits over `vocab_ids` (None: the target's ids themselves)."""

    def __init__(self, kernels=None, vocab_ids: list[int] | None = None, to_target=None, target_vocab: int = 0):
        self.top_prob = kernels.top_prob if kernels is not None else None   # argmax and its probability, native
        self.ids = vocab_ids
        self.to_target = to_target          # draft-vocabulary logits -> target-vocabulary logits (sampling)
        self.target_vocab = target_vocab
        self._ids_t = torch.tensor(vocab_ids, dtype=torch.int64) if vocab_ids is not None else None

    def __call__(self, logits: torch.Tensor, params: SamplingParams, gen, history: list[int], tau: float = 1.0):
        """-> (token, its probability, the distribution it was drawn from or None when greedy). tau: sampled, the
        draft is drawn from the logits at tau times the sampling temperature (the verify's rule takes any
        distribution q it was drawn from, so the output's distribution is the target's whatever tau is)."""
        if params.greedy:
            if self.top_prob is not None:
                tok, p = self.top_prob(logits.float())
            else:
                top_p, tok = torch.softmax(logits.float(), -1).max(-1)
                tok, p = int(tok), top_p.item()
            return (self.ids[tok] if self.ids is not None else tok), p, None
        if tau != 1.0:
            logits = logits.float() / tau
        if self._ids_t is not None and self.target_vocab and params.repeat_penalty == 1.0:
            # Sampled over the draft vocabulary itself, then placed among the target's ids: those outside it
            # get 0 either way, and no draft step pays for a softmax, top-p and a CDF over the whole target
            # vocabulary (BENCHMARKS.md, "The head's sampled drafts"). A repeat penalty, which reads the
            # history's target ids, takes the full path below.
            qd = probs(logits, params, ())
            i = int(draw(qd[None], gen)[0])
            if self._ids_t.device != qd.device:              # once: where the head's logits are
                self._ids_t = self._ids_t.to(qd.device)
            q = torch.zeros(self.target_vocab, dtype=qd.dtype, device=qd.device)
            q[self._ids_t] = qd
            return self.ids[i], qd[i].item(), q
        q = probs(self.to_target(logits) if self.to_target is not None else logits, params, history)
        tok = int(draw(q[None], gen)[0])
        return tok, q[tok].item(), q

    def second(self, logits: torch.Tensor, first: int) -> int:
        """The best token other than `first` (a target id)."""
        top = logits.float().topk(2).indices.tolist()
        ids = [self.ids[t] for t in top] if self.ids is not None else top
        return [t for t in ids if t != first][0]


class DraftModelProposer:
    """A draft model on its own Sequence, kept equal to a prefix of the target's context.

    The model proposers keep state that the engine prepares, resets, saves and restores alike: prepare
    (evaluate a prompt), reset, export (the KV state for a context the target holds) and load; `lag` is how
    many positions their state runs behind the tokens (0 here)."""

    kind = "draft"
    lag = 0

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.choose = Chooser(getattr(seq.model, "kernels", None))

    def prepare(self, context: list[int]) -> None:
        self.seq.sync(context)

    def reset(self) -> None:
        self.seq.reset()

    def export(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's state for `tokens`: its keys and values, one position per token."""
        self.seq.sync(tokens)
        _, k, v = self.seq.export(len(tokens))
        return k, v

    def load(self, tokens: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        self.seq.load(tokens, k, v)

    def propose(self, context: list[int], k: int, limits: Limits) -> Proposal:
        t = time.perf_counter()
        logits = self.seq.sync(context)
        sync_s = time.perf_counter() - t
        p = draft_chain(logits, self.seq.step, k, limits, context, self.choose)
        p.kind, p.forwards = "draft", p.forwards + 1
        if p.step_s is None and self.seq.evaluated == 1:      # the sync was a one-token step itself
            p.step_s = sync_s
        return p


class HeadProposer:
    """An EAGLE-3 head (jllm.eagle3.head) drafting from the target's captured hidden states.

    Head position P pairs the token at P + 1 with the target's states at P (format.py), so for a context of
    n tokens (the target holds n - 1 of them, the newest is still to be evaluated) the head covers positions
    0 .. n - 2 before drafting; `paired` lists the tokens its positions hold. The first draft comes from the
    last of those rows, each later one from a step fed the head's own output state; the steps' positions
    are dropped again at the next round's catch-up."""

    kind = "head"
    lag = 1

    def __init__(self, head, target: Sequence):
        self.head, self.target = head, target
        self.paired: list[int] = []
        ids = head._d2t_list
        self.choose = Chooser(head.kernels, ids, head.target_logits if ids is not None else None,
                              head.target.cfg.vocab_size)

    def prepare(self, context: list[int]) -> None:
        self.catch_up(context)

    def reset(self) -> None:
        self.head.truncate(0)
        self.paired = []

    def load(self, tokens: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Hold the stored head state k, v [1, Hk, n, hd] of positions 0 .. n - 1, paired with tokens[1:]
        (n + 1 tokens)."""
        if len(tokens) != k.shape[2] + 1:
            raise ValueError(f"{len(tokens)} tokens for a head state of {k.shape[2]} positions")
        self.head.cache.load(k, v)
        self.paired = list(tokens[1:])

    def export(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The head's state for a context of `tokens`, all held by the target: its len(tokens) - 1 positions,
        padded with one zero position so that it has one per token (the store's shape); None if the target's
        states for rows it lacks are not here."""
        if len(tokens) < 2 or self.catch_up(tokens) is None:
            return None
        n = len(tokens) - 1
        k, v = self.head.cache.export(n)
        pad = torch.zeros_like(k[:, :, :1])
        return torch.cat([k, pad], 2).cpu(), torch.cat([v, pad], 2).cpu()

    def adopt(self, context: list[int], n: int) -> None:
        """The head's cache holds rows 0 .. n - 1 for `context`, computed elsewhere (jllm.cuda.rounds): keep
        them (and drop any past them)."""
        self.head.truncate(min(n, self.head.length))
        self.paired = list(context[1:self.head.length + 1])

    def catch_up(self, context: list[int]) -> Step | None:
        """Cover positions 0 .. len(context) - 2 -> the last row's prediction (None: the target's states
        for the missing rows are not here, as right after a hydrate without the head's state)."""
        n = len(context) - 1
        if n < 1:                         # a one-token prompt: no (state, next token) pair to cover yet
            self.reset()
            return None
        keep = min(common_prefix(self.paired, context[1:]), n - 1, self.head.length)
        self.head.truncate(keep)
        del self.paired[keep:]
        if keep < self.target.features_from:
            return None
        step = self.head.prefill(self.target.features[keep:n], context[keep + 1:n + 1])
        self.paired.extend(context[keep + 1:n + 1])
        return step

    def propose(self, context: list[int], k: int, limits: Limits) -> Proposal:
        t = time.perf_counter()
        first = self.catch_up(context)
        if first is None:
            return Proposal([], kind="head")
        rows = self.head.length
        state = [first.state]

        def step(token: int) -> torch.Tensor:
            s = self.head.step(token, state[0])
            state[0] = s.state
            return s.logits

        catch_s = time.perf_counter() - t
        if limits.tree is not None and limits.params.greedy:
            def expand(nodes, states, paths):
                return self.head.tree_step([n.token for n in nodes], states, paths)

            p = draft_tree(first.logits, first.state, expand, k, limits, self.head.target_id)
        else:
            p = draft_chain(first.logits, step, k, limits, context, self.choose)
        self.head.truncate(rows)                 # the drafted positions are the next round's to recompute
        p.kind, p.forwards = "head", p.forwards + 1
        if p.step_s is None:
            p.step_s = catch_s
        return p
