"""Speculative decoding: propose k tokens cheaply, verify them with one batched target pass, keep the longest
accepted prefix plus one target token, roll both KV caches back to it.

The target's cache holds every token but the newest one (`last`), exactly as in plain decoding. A round:
    drafts  = proposer(context, k)                       # n-gram lookup and/or the draft model
    logits  = target.forward([last, d1..dk])             # [k+1, V], one pass (batch-invariant: see linear.py)
    n, nxt  = verify(drafts, logits)                     # rejection.py: accepted, then recovered/bonus token
    cache.truncate(before + 1 + n)                       # rollback moves a length, never copies
    emit d1..dn, nxt;  last = nxt
Greedy output is identical to plain decoding because the target's logits at every position are bitwise the
ones plain decoding computes. Sampled output follows the target's distribution exactly (rejection.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from jllm.engine import common_prefix, fill_cache
from jllm.model.transformer import Transformer
from jllm.sampling import SamplingParams, make_generator, probs, sample
from jllm.sampling import argmax as greedy_ids
from jllm.spec import DRAFT_MAX, DRAFT_MIN, DRAFT_VOCAB, LEAF_P, LEAF_TAKEN, P_MIN
from jllm.spec.costs import RowCost
from jllm.spec.ngram import NgramProposer
from jllm.spec.rejection import draw, verify_greedy, verify_sampled

MODES = ("auto", "draft", "ngram", "draft+ngram", "none")


@dataclass
class SpecConfig:
    mode: str = "auto"          # auto: draft+ngram with a draft model, ngram without
    draft_max: int = DRAFT_MAX  # most tokens proposed per round
    draft_min: int = DRAFT_MIN  # fewest tokens a round may propose (adaptive k stays within [min, max])
    p_min: float = P_MIN        # the draft model drafts on while the product of its probabilities stays above
    ngram_min_match: int = 3    # with a draft model, n-gram proposals need a suffix match this long to be used
    draft_vocab: int = DRAFT_VOCAB  # FR-Spec: the draft scores only the first N token ids (see jllm/spec);
                                    # the target still verifies over all of them, so exactness holds
    draft_precision: str = "auto"   # auto: native4 for a native target, int8-fast for an int8 one (the draft
                                    # only proposes: fewer bytes beat precision), else the target's own
    leaf_p: float = LEAF_P      # greedy: also verify the draft's second choice at its least confident drafted
                                # position when the draft gave its own token less than this (0: never)
    leaf_gate: bool = True      # ... and only while the measured cost of a row says leaves pay (False: always)
    cost_stop: bool = True      # the draft also stops where one more token would cost more than it is likely
                                # to bring, by the verify passes' measured costs (DraftGate.extend_pays)
    ngram_cut: bool = True      # ... and n-gram proposals are cut the same way (with cost_stop)


def draft_precision_for(target_precision: str, choice: str = "auto") -> str:
    if choice != "auto":
        return choice
    return {"native": "native4", "int8": "int8-fast"}.get(target_precision, target_precision)


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    leaves: int = 0             # side leaves verified, and how many of them were taken
    leaves_taken: int = 0
    by_proposer: dict = field(default_factory=lambda: {"ngram": [0, 0, 0], "draft": [0, 0, 0]})  # rounds, drafted, accepted
    accept_hist: dict = field(default_factory=dict)      # accepted length -> rounds
    draft_s: float = 0.0
    verify_s: float = 0.0

    def record(self, proposer: str, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        row = self.by_proposer[proposer]
        row[0] += 1
        row[1] += drafted
        row[2] += accepted
        self.accept_hist[accepted] = self.accept_hist.get(accepted, 0) + 1

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "mean_accepted_per_verify": round(self.accepted / self.rounds, 3) if self.rounds else 0.0,
            "tokens_per_verify": round((self.accepted + self.leaves_taken + self.rounds) / self.rounds, 3)
            if self.rounds else 0.0,
            "accept_histogram": dict(sorted(self.accept_hist.items())),
            "by_proposer": {k: {"rounds": v[0], "drafted": v[1], "accepted": v[2]} for k, v in self.by_proposer.items()},
            "leaves": self.leaves, "leaves_taken": self.leaves_taken,
            "draft_ms": round(self.draft_s * 1000, 1), "verify_ms": round(self.verify_s * 1000, 1),
        }


class DraftRunner:
    """The draft model with its own KV cache, kept equal to a prefix of the target's context."""

    def __init__(self, model: Transformer, ctx_size: int):
        self.model = model
        self.cache = model.new_cache(ctx_size)
        self.ids: list[int] = []
        self.device = model.device
        self.forwards, self.step_s, self.synced = 0, None, 0      # of the latest propose() and sync()
        self.leaf: tuple[int, int] | None = None     # of the latest propose(): (draft index, its alternative)
        kernels = getattr(model, "kernels", None)
        self.top_prob = kernels.top_prob if kernels is not None else None   # argmax and its probability

    def sync(self, context: list[int]) -> torch.Tensor:
        """Make the cache hold `context`; returns the logits after its last token."""
        keep = min(common_prefix(self.ids, context), len(context) - 1)
        self.synced = len(context) - keep                 # tokens the pass ran
        return fill_cache(self.model, self.cache, self.ids, context, keep)

    def propose(self, context: list[int], k: int, p_min: float, params: SamplingParams,
                gen: torch.Generator | None, k_min: int = 1, leaf_p: float = 0.0,
                extend=None) -> tuple[list[int], torch.Tensor | None]:
        """Up to k tokens (at least k_min); with sampling also their distributions q [n, V].
        extend(n, chain): whether drafting an n-th token is worth its cost when the chain so far holds with
        probability chain (DraftGate.extend_pays); None: always, within p_min.
        Greedy, leaf_p > 0: afterwards `leaf` is (i, t) when the draft's least confident token, drafts[i], had
        probability < leaf_p, t being its second choice there (else None).

        Drafting goes on while the chain is likely to hold: the product of the draft's probabilities of its
        tokens so far (its top probability when greedy, q of the drawn token when sampling, against half the
        threshold) must stay >= p_min. The test comes before the next forward pass, not after it: a pass
        whose token is then thrown away for low confidence costs a draft step for nothing, which replaying
        the corpus traces showed costs more than it saves (1.34x against 1.50x, benchmarks/spec_sim.py).
        Afterwards `forwards` is the number of forward passes made and `step_s` the time of the last
        one-token step (None if none)."""
        t = time.perf_counter()
        logits = self.sync(context)
        self.forwards = 1
        self.step_s = time.perf_counter() - t if self.synced == 1 else None
        threshold = p_min if params.greedy else p_min * 0.5
        drafts, qs, chain = [], [], 1.0
        self.leaf, weakest = None, (leaf_p, None, None)           # (probability, index, logits)
        for i in range(k):
            if params.greedy and self.top_prob is not None:
                tok, p = self.top_prob(logits.float())
            elif params.greedy:
                top_p, tok = torch.softmax(logits.float(), -1).max(-1)
                tok, p = int(tok), top_p.item()
            else:
                q = probs(logits, params, context + drafts)
                tok = int(draw(q[None], gen)[0])
                p = q[tok].item()
                qs.append(q)
            drafts.append(tok)
            if params.greedy and p < weakest[0]:
                weakest = (p, i, logits)
            chain *= p
            if i + 1 == k or (i + 1 >= k_min and (chain < threshold or (extend and not extend(i + 2, chain)))):
                break
            t = time.perf_counter()
            logits = self.model.forward(torch.tensor([tok], device=self.device), self.cache)[-1]
            self.step_s = time.perf_counter() - t
            self.forwards += 1
            self.ids.append(tok)
        if weakest[1] is not None:
            i = weakest[1]
            alt = [t for t in weakest[2].float().topk(2).indices.tolist() if t != drafts[i]][0]
            self.leaf = (i, alt)
        return drafts, (torch.stack(qs) if qs else None)


class SpeculativeDecoder:
    """A token source for Engine.stream: yields target tokens, several per target pass."""

    def __init__(self, engine, draft: DraftRunner | None, cfg: SpecConfig, gate: "DraftGate | None" = None):
        """gate: the draft gate of earlier generations (a chat's previous turns), whose cost estimates carry
        over; a fresh one when None."""
        self.engine, self.draft, self.cfg = engine, draft, cfg
        mode = cfg.mode if cfg.mode != "auto" else ("draft+ngram" if draft is not None else "ngram")
        self.use_draft = draft is not None and mode in ("draft", "draft+ngram")
        # side leaves: the target's layer stack verifies them (Transformer.forward); greedy rounds only
        self.leaf_p = cfg.leaf_p if engine.model.stack is not None else 0.0
        self.use_ngram = mode in ("ngram", "draft+ngram")
        self.ngram = NgramProposer(max_ngram=4, min_ngram=1)
        self.ngram_rounds = [0, 0]      # n-gram tokens accepted, n-gram rounds cut short by a rejection
        self.stats = SpecStats()
        # n-gram proposals adapt their length; the draft's length is set by its confidence (propose), within
        # a cap of 2 past what its previous round got accepted: a draft wrong from its first token is not
        # trusted with 8 steps next round however confident it is (trace replay: an always-wrong draft
        # 0.92x -> 0.95x of plain in draft-only mode, good drafts unchanged)
        self.k = {"ngram": cfg.draft_max, "draft": cfg.draft_max}
        self.gate = gate if gate is not None else DraftGate()
        self.gate.new_generation()

    def _propose(self, context: list[int], room: int, params: SamplingParams, gen) -> tuple[str, list[int], object]:
        t0 = time.perf_counter()
        try:
            if self.use_ngram:
                d = self.ngram.propose(min(self.k["ngram"], room))
                if d and (self.ngram.last_match_len >= self.cfg.ngram_min_match or not self.use_draft):
                    return "ngram", self._ngram_worth(d) if params.greedy else d, None
            if self.use_draft and self.gate.choose() == "draft":
                greedy = params.greedy and params.repeat_penalty == 1.0
                leaf_p = self.leaf_p if greedy and (not self.cfg.leaf_gate or self.gate.leaf_pays()) else 0.0
                extend = self.gate.extend_pays if self.cfg.cost_stop else None
                d, q = self.draft.propose(context, min(self.k["draft"], room), self.cfg.p_min, params, gen,
                                          k_min=self.cfg.draft_min, leaf_p=leaf_p, extend=extend)
                return "draft", d, q
            return "ngram", [], None
        finally:
            self.stats.draft_s += time.perf_counter() - t0

    def _ngram_worth(self, drafts: list[int]) -> list[int]:
        """The n-gram proposal cut where its next token is not worth its verify row (cost_stop): the j-th
        token holds with about c^j, c being the share of n-gram tokens that held after the ones before them
        (accepted / (accepted + rounds cut short), from this generation's rounds). Replay with the AVX2
        Zen 3's costs: 1.44x -> 1.47x; where rows are cheap 1.61x -> 1.62x (spec_sim.py, "ngram_cost").
        Greedy decoding only: the cut follows measured times, and a sampled generation must draw the same
        random numbers for the same seed (n-gram proposals otherwise depend on the text alone)."""
        if not (self.cfg.cost_stop and self.cfg.ngram_cut):
            return drafts
        held, broke = self.ngram_rounds
        c = (held + 1) / (held + broke + 2)
        keep = 1
        while keep < len(drafts) and self.gate.extend_pays(keep + 1, c ** (keep + 1), free=True):
            keep += 1
        return drafts[:keep]

    def tokens(self, logits: torch.Tensor, params: SamplingParams, budget: int) -> Iterator[int]:
        eng, cfg = self.engine, self.cfg
        gen = make_generator(params.seed)
        history = list(eng.cached_ids)
        self.ngram.reset(history)
        last = sample(logits, params, history, gen)
        emitted = 0
        while True:
            history.append(last)
            self.ngram.append(last)
            yield last
            emitted += 1
            if emitted >= budget or last in eng.tokenizer.eot_ids:
                return
            room = min(budget - emitted - 1, eng.ctx_size - eng.cache.length - 2)
            kind, drafts, q = self._propose(history, room, params, gen) if room > 0 else ("ngram", [], None)
            leaf = self.draft.leaf if kind == "draft" and drafts else None       # (draft index, alternative)
            t0 = time.perf_counter()
            before = eng.cache.length
            block = torch.tensor([last] + drafts + ([leaf[1]] if leaf else []), device=eng.device)
            out = eng.model.forward(block, eng.cache, leaf=before + 1 + leaf[0] if leaf else None)   # [k+1(+1), V]
            if params.greedy:
                if params.repeat_penalty == 1.0:               # no history to apply: one call for all rows
                    argmax = greedy_ids(out)
                else:
                    argmax = [sample(out[i], params, history + drafts[:i], gen) for i in range(len(drafts) + 1)]
                n, nxt = verify_greedy(drafts, argmax[:len(drafts) + 1])
                taken = leaf is not None and n == leaf[0] and argmax[n] == leaf[1]
                if taken:                      # the chain broke where the leaf is, on the leaf's token
                    n, nxt = n + 1, argmax[-1]
                accepted = drafts[:n - 1] + [leaf[1]] if taken else drafts[:n]
            else:
                taken = False
                p = torch.stack([probs(out[i], params, history + drafts[:i]) for i in range(len(drafts) + 1)])
                if kind == "draft" and q is not None and q.shape[-1] < p.shape[-1]:
                    q = torch.nn.functional.pad(q, (0, p.shape[-1] - q.shape[-1]))   # subset vocab: zeros beyond
                n, nxt = verify_sampled(drafts, q if kind == "draft" else None, p, gen)
                accepted = drafts[:n]
            stop = next((j for j in range(n) if accepted[j] in eng.tokenizer.eot_ids), None)
            keep = n if stop is None else stop        # like plain decoding, never keep an end-of-turn token
            if taken and keep == n:                   # the leaf's key and value move to its position
                eng.cache.move(before + len(block) - 1, before + n)
            eng.cache.truncate(before + 1 + keep)
            eng.cached_ids = eng.cached_ids[:before] + [last] + accepted[:keep]
            verify_s = time.perf_counter() - t0
            self.stats.verify_s += verify_s
            drafted = kind == "draft"
            self.gate.observe(verify_s, len(block) - 1, self.draft.step_s if drafted else None)
            if drafted:
                self.gate.record(n + 1, self.draft.forwards, len(block) - 1)
            if drafts:
                self.stats.record(kind, len(drafts), n - taken)      # the chain's; leaves apart
                self.stats.leaves += leaf is not None
                self.stats.leaves_taken += taken
                if leaf is not None:
                    self.gate.observe_leaf(taken)
                self._adapt(kind, len(drafts), n)
                if kind == "ngram":
                    self.ngram_rounds[0] += n
                    self.ngram_rounds[1] += n < len(drafts)
            for tok in accepted[:n]:
                history.append(tok)
                self.ngram.append(tok)
                yield tok
                emitted += 1
                if tok in eng.tokenizer.eot_ids:
                    return
            last = nxt

    def _adapt(self, kind: str, drafted: int, accepted: int) -> None:
        """Next round's length limit. n-gram: grow after a fully accepted round; after a copied span broke
        off, propose only as far as it held (matches that keep failing, as in translation, shrink to
        draft_min). Draft: 2 past what this round got accepted (its confidence decides within that)."""
        cfg = self.cfg
        if kind == "draft":
            self.k["draft"] = max(cfg.draft_min, min(cfg.draft_max, accepted + 2))
        elif accepted == drafted:
            self.k["ngram"] = min(cfg.draft_max, self.k["ngram"] + 1)
        else:
            self.k["ngram"] = max(cfg.draft_min, accepted + 1)


class DraftGate:
    """Decides, round by round, whether running the draft model pays. It judges the draft by a cost model in
    units of one target step, from the rounds' outcomes, not by comparing seconds per token of draft rounds
    with those of plain rounds: on a shared host a step's time swings by a third from one minute to the next,
    and the timing comparison gave up on drafts that paid. A draft round that emits t tokens after f draft
    forward passes and a verify pass over k drafts costs
        f * d + 1 + row_cost * k        target steps,
    d being the draft step's time over the target step's, both measured in the same rounds (they drift
    together, so their ratio is steady). The draft runs while the moving averages give tokens per cost >=
    off_below (a little under 1: the estimate is noisy, and wrongly stopping a good draft costs more than
    running a marginal one).

    When it loses, decoding goes plain and the draft gets a trial of `trial_rounds` rounds every `interval`
    rounds, since acceptance drifts with the text; the interval doubles up to `max_explore` while trials keep
    losing (each trial costs its draft steps and the draft's catch-up on the tokens emitted since its last
    use), and after `give_up` lost trials in a row the draft rests for the rest of the generation. Only the
    choice of proposer changes, never what is emitted, so exactness is untouched."""

    def __init__(self, explore: int = 12, max_explore: int = 96, give_up: int = 3, trial_rounds: int = 2,
                 decay: float = 0.9, row_cost: float = 0.1, warmup: int = 3, off_below: float = 0.95):
        """Defaults chosen by replaying the corpus traces with this gate in the loop (decay 0.9 and
        off_below 0.95 lose 0.3 % to an always-on draft there, decay 0.8 and 1.0 lost 3 %; an always-wrong
        draft gets the same protection either way)."""
        self.explore, self.max_explore, self.give_up, self.trial_rounds = explore, max_explore, give_up, trial_rounds
        self.decay, self.row_cost, self.warmup, self.off_below = decay, row_cost, warmup, off_below
        self.stats = None            # moving averages per draft round: [tokens, draft forwards, drafts k]
        self.draft_step = None       # seconds per draft forward pass of one token
        self.target_step = None      # seconds per target step, from verify passes: time / (1 + row_cost * k)
        self.evidence = 0            # draft rounds seen
        self.lost = 0                # trials lost in a row
        self.rows = RowCost()        # what one more row of a verify pass costs, measured (spec/costs.py)
        self.verify = {}             # k -> verify pass over k drafts, in target steps (moving averages)
        self.leaf_rate = LEAF_TAKEN  # share of side leaves taken, a moving average
        self.new_generation()

    def new_generation(self) -> None:
        """Start a generation (a new turn). The estimates are kept, so a draft that lost last turn gets no
        free rounds again, but the trial schedule restarts and a given-up draft gets one more trial (the new
        text may suit it)."""
        self.rounds = 0
        self.interval = self.explore
        self.next_trial = self.explore
        self.lost = min(self.lost, self.give_up - 1)
        self.trial_left, self.trial = 0, []
        self.drafting = not self._losing()

    def value(self) -> float | None:
        """Expected tokens per unit of cost of a draft round (> 1: drafting beats plain decoding)."""
        if self.stats is None or self.draft_step is None or self.target_step is None:
            return None
        tokens, forwards, k = self.stats
        d = self.draft_step / self.target_step
        return tokens / (forwards * d + 1 + self.row_cost * k)

    def choose(self) -> str:
        self.rounds += 1
        if self.drafting or self.trial_left:
            return "draft"
        if self.rounds >= self.next_trial and self.lost < self.give_up:
            self.trial_left, self.trial = self.trial_rounds, []
            return "draft"
        return "plain"

    def leaf_pays(self) -> bool:
        """Whether a side leaf is worth its row: it costs one row (rows.value target steps) and brings one
        token when taken, so it pays while its take rate beats what the row's time yields in draft rounds
        (value() tokens a step). Cheap rows (AVX-512 while memory is slow): on; a Zen 3's AVX2 rows at ~0.25
        of a step: off (trace replay with that machine's costs: 1.28x with leaves, 1.31x without)."""
        return self.leaf_rate >= self.rows.value * (self.value() or 1.0)

    def extend_pays(self, k: int, chain: float, free: bool = False) -> bool:
        """Whether the draft should go on to a k-th token this round, the tokens so far holding with
        probability `chain` (the product of the draft's own probabilities). The k-th token is accepted with
        about that probability, and costs a draft step plus the verify pass's k-th row. That pays while the
        tokens it is expected to bring per step of cost reach the rate draft rounds already get (value(), at
        least plain decoding's 1 a step). A row's cost is the measured difference between verify passes over
        k and k - 1 drafts, since rows do not cost alike: on AVX2 a 5th row starts a second pass over every
        tile (BENCHMARKS.md). Until both are measured, the fitted cost of a row (rows.value).
        Trace replay with the AVX2 Zen 3's verify costs: 1.40x -> 1.42x; where rows are cheap, unchanged
        (benchmarks/spec_sim.py sim, "cost rate=gate"). free: the token costs no draft step (n-gram)."""
        if self.target_step is None or (self.draft_step is None and not free):
            return True
        now, before = self.verify.get(k), self.verify.get(k - 1)
        row = now - before if now is not None and before is not None else self.rows.value
        cost = (0.0 if free else self.draft_step / self.target_step) + max(0.0, row)
        return chain >= max(1.0, self.value() or 1.0) * cost

    def observe_leaf(self, taken: bool) -> None:
        self.leaf_rate = self._avg(self.leaf_rate, float(taken))

    def observe(self, verify_s: float, k: int, draft_step_s: float | None = None) -> None:
        """Times of one round: its verify pass over k rows past the first, and the draft's one-token step if it
        ran one."""
        self.rows.add(k, verify_s)
        # the gate's own cost model keeps its fixed row_cost, not rows.value: replayed, the fitted cost made it
        # drop marginal drafts and lost 0.013-0.017x (BENCHMARKS.md, "AVX2-only CPU")
        self.target_step = self._avg(self.target_step, verify_s / (1 + self.row_cost * k))
        self.verify[k] = self._avg(self.verify.get(k), verify_s / self.target_step)
        if draft_step_s is not None:
            self.draft_step = self._avg(self.draft_step, draft_step_s)

    def record(self, tokens: int, forwards: int, k: int) -> None:
        """A draft round's outcome: tokens emitted (accepted + 1), draft forward passes, drafts verified."""
        row = [float(tokens), float(forwards), float(k)]
        self.evidence += 1
        if self.trial_left:
            self.trial.append(row)
            self.trial_left -= 1
            if self.trial_left:
                return
            self.stats = [sum(c) / len(c) for c in zip(*self.trial)]      # fresh evidence replaces the old
            if not self._losing():
                self.drafting, self.lost, self.interval = True, 0, self.explore
            else:
                self.lost += 1
                self.interval = min(2 * self.interval, self.max_explore)
                self.next_trial = self.rounds + self.interval
            return
        self.stats = row if self.stats is None else [self._avg(a, b) for a, b in zip(self.stats, row)]
        if self.evidence >= self.warmup and self._losing():
            self.drafting = False
            self.next_trial = self.rounds + self.interval

    def _losing(self) -> bool:
        value = self.value()
        return value is not None and value < self.off_below

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new
