"""Speculative decoding: propose tokens cheaply, verify them with one batched target pass, keep the accepted
prefix plus one target token, roll the caches back to it.

The target's Sequence holds every token but the newest one (`last`), exactly as in plain decoding. A round:
    proposal = proposer.propose(context, k)              # proposers.py: n-gram, the draft model or a head
    logits   = target.forward([last, d1..dk])            # [k+1, V], one pass (batch-invariant: linear.py)
    verdict  = verify_block(...)                         # verify.py: accepted tokens, then recovered/bonus
    target.keep(before, [last] + accepted)               # rollback moves a length, never copies
    emit accepted, then last = verdict.next
A tree proposal (greedy, Proposal.tree) verifies every node in the same pass, each row a decode step along
its path (Transformer.forward's tree); verify_tree follows the target's argmax through the branches and keep()
moves the accepted path into place.
Greedy output is identical to plain decoding because the target's logits at every position are bitwise the
ones plain decoding computes. Sampled output follows the target's distribution exactly (verify.py). How far
to draft and whether to use the draft model at all is policy.py's, and changes only speed.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from jllm.sampling import SamplingParams, make_generator, sample
from jllm.sequence import Sequence
from jllm.spec.config import SpecConfig
from jllm.spec.policy import FIXED_DRAFT_STEP, FIXED_ROW, DraftGate, FixedCostGate, ngram_keep, next_length
from jllm.spec.proposers import Limits, NgramProposer, Proposal
from jllm.spec.stats import SpecStats
from jllm.spec.verify import Verdict, verify_block, verify_tree


class SpeculativeDecoder:
    """A token source for Engine.stream: yields the target's tokens, several per target pass."""

    def __init__(self, target: Sequence, draft, cfg: SpecConfig, eot_ids, gate: DraftGate | None = None):
        """draft: the draft proposer (DraftModelProposer), or None; gate: the draft gate of earlier
        generations (a chat's previous turns), whose cost estimates carry over; a fresh one when None."""
        self.target, self.cfg, self.eot_ids = target, cfg, eot_ids
        use_ngram, use_draft = cfg.proposers(draft is not None)
        self.ngram = NgramProposer() if use_ngram else None
        self.draft = draft if use_draft else None
        # side leaves are verified by the target's native layer stack (Transformer.forward)
        self.leaves = getattr(target.model, "stack", None) is not None and cfg.leaf_p > 0
        # and so are trees, which only a head drafts (proposers.draft_tree)
        self.trees = getattr(target.model, "stack", None) is not None and getattr(self.draft, "kind", "") == "head"
        self.k = {"ngram": cfg.draft_max, "draft": cfg.draft_max}     # each proposer's length limit
        self.ngram_held = [0, 0]      # n-gram tokens accepted, n-gram rounds cut short by a rejection
        self.gate = gate if gate is not None else DraftGate()
        self.gate.new_generation()
        self.stats = SpecStats()

    def tokens(self, logits: torch.Tensor, params: SamplingParams, budget: int) -> Iterator[int]:
        target, gen = self.target, make_generator(params.seed)
        if not params.greedy:                       # the same seed, the same draws: no clock in the policy
            self.gate = fixed_cost_gate(target, self.draft)
        history = list(target.ids)                  # the accepted context, `last` included once emitted
        last = sample(logits, params, history, gen)
        emitted = 0
        while True:
            history.append(last)
            yield last
            emitted += 1
            if emitted >= budget or last in self.eot_ids:
                return
            room = min(budget - emitted - 1, target.max_tokens - len(target) - 2)
            proposal = self._propose(history, room, params, gen)
            t0 = time.perf_counter()
            before, leaf, tree = len(target), proposal.leaf, proposal.tree
            block = [last] + proposal.tokens + ([leaf[1]] if leaf else [])
            try:
                if tree is not None:                # greedy only: rows past the first chain are tree rows
                    if not params.argmax_only:
                        raise ValueError("a tree of drafts is verified greedily only; this generation samples")
                    chain = next((j for j, p in enumerate(tree) if p != j), len(tree))
                    out = target.forward(block, tree=tree[chain:])
                    verdict = verify_tree(proposal.tokens, tree, out)
                else:
                    out = target.forward(block, tree=[leaf[0]] if leaf else None)  # the leaf's parent: row leaf[0]
                    verdict = verify_block(proposal.tokens, proposal.probs, leaf, out, params, history, gen)
                kept = _until_end_of_turn(verdict.accepted, self.eot_ids)   # the cache never holds an EOT token
                target.keep(before, [last] + kept,
                            rows=None if verdict.rows is None else [0] + verdict.rows[:len(kept)])
            except BaseException:
                # stopped inside a round (Ctrl-C): between the pass and keep() the sequence lists the block's
                # tokens while tree and leaf rows are not where their tokens are; a later prompt reusing that
                # prefix would read them, so the round is undone
                target.rollback(before)
                raise
            self._observe(proposal, verdict, len(block) - 1, time.perf_counter() - t0)
            for tok in verdict.accepted:
                history.append(tok)
                yield tok
                emitted += 1
                if tok in self.eot_ids:
                    return
            last = verdict.next

    def _propose(self, context: list[int], room: int, params: SamplingParams, gen) -> Proposal:
        """The n-gram proposal where its match is long enough (any match without a draft model), else the
        draft model's while the gate says it pays, else nothing (a plain step)."""
        if room <= 0:
            return Proposal([])
        cfg, t0 = self.cfg, time.perf_counter()
        try:
            if self.ngram is not None:
                p = self.ngram.propose(context, min(self.k["ngram"], room))
                if p.tokens and (p.match >= cfg.ngram_min_match or self.draft is None):
                    # greedy only: the cut follows measured times, and a sampled generation must draw the
                    # same random numbers for the same seed
                    if params.greedy and cfg.cost_stop and cfg.ngram_cut:
                        pays = lambda k, chain: self.gate.extend_pays(k, chain, free=True)   # noqa: E731
                        p.tokens = p.tokens[:ngram_keep(len(p.tokens), *self.ngram_held, pays)]
                    return p
            if self.draft is not None and self.gate.choose() == "draft":
                greedy = params.argmax_only
                leaf_p = cfg.leaf_p if self.leaves and greedy and (not cfg.leaf_gate or self.gate.leaf_pays()) \
                    else 0.0
                tree = (cfg.tree_width, cfg.tree_branches, min(cfg.tree_nodes, room), cfg.tree_p) \
                    if self.trees and greedy and cfg.tree_width > 1 else None
                limits = Limits(params, gen, k_min=cfg.draft_min, p_min=cfg.p_min, leaf_p=leaf_p,
                                extend=self.gate.extend_pays if cfg.cost_stop else None, tree=tree,
                                draft_tau=cfg.head_tau if self.draft.kind == "head" else 1.0)
                return self.draft.propose(context, min(self.k["draft"], room), limits)
            return Proposal([])
        finally:
            self.stats.draft_s += time.perf_counter() - t0

    def _observe(self, proposal: Proposal, verdict: Verdict, rows: int, verify_s: float) -> None:
        """Feed a round's outcome to the statistics, the gate's cost model and the length rules."""
        kind, drafted, n = proposal.kind, len(proposal.tokens), len(verdict.accepted)
        self.stats.verify_s += verify_s
        is_draft = kind != "ngram"                  # a model drafted: the draft model or the head
        self.gate.observe(verify_s, rows, proposal.step_s if is_draft else None)
        if is_draft:
            self.gate.record(n + 1, proposal.forwards, rows)
        if not drafted:
            return
        self.stats.record(kind, drafted, n - verdict.leaf_taken)      # the chain's; leaves apart
        if proposal.tree is not None:
            self.stats.tree_rounds += 1
            self.stats.off_chain += sum(r != j + 1 for j, r in enumerate(verdict.rows))
        if proposal.leaf is not None:
            self.stats.leaves += 1
            self.stats.leaves_taken += verdict.leaf_taken
            self.gate.observe_leaf(verdict.leaf_taken)
        key = "draft" if is_draft else "ngram"
        self.k[key] = next_length(kind, self.k[key], drafted, n, self.cfg.draft_min, self.cfg.draft_max)
        if kind == "ngram":
            self.ngram_held[0] += n
            self.ngram_held[1] += n < drafted


def fixed_cost_gate(target: Sequence, draft) -> FixedCostGate:
    """A fresh gate over this machine kind's and this proposer's fixed costs (policy.FIXED_ROW, FIXED_DRAFT_STEP)."""
    from jllm.kernels import isa

    where = "cuda" if target.model.device.type == "cuda" else (isa() or "avx2")
    kind = "head" if getattr(draft, "kind", "") == "head" else "draft"
    return FixedCostGate(row=FIXED_ROW.get(where, 0.1), draft_step=FIXED_DRAFT_STEP[kind])


def _until_end_of_turn(tokens: list[int], eot_ids) -> list[int]:
    for j, t in enumerate(tokens):
        if t in eot_ids:
            return tokens[:j]
    return tokens
