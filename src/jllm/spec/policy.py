"""The drafting policy: how far to draft, whether a draft round pays, and what a verify row costs. Pure
functions of measured costs and probabilities, so that benchmarks/spec_sim.py replays the corpus with this
very code.

Costs are in units of one target decode step. A verify pass over k drafts takes about a + b k seconds: a is
one stream of the weights, b the compute of one more row; b / a, a row's cost in steps, is a property of the
machine rather than of the model (small where vector units are wide and memory is slow, large on AVX2, where
rows past the fourth cost more again; BENCHMARKS.md). The decoder measures it (RowCost) instead of assuming
one figure, and DraftGate keeps the cost of each draft count.

The rules:
- a draft model drafts on while the product of its probabilities (`chain`) stays >= p_min, and while one
  more token is expected to bring at least what it costs (`draft_goes_on`, `DraftGate.extend_pays`);
- an n-gram proposal is cut where its next token stops paying for its verify row (`ngram_keep`);
- the next round's length limit follows what the last round got accepted (`next_length`);
- a side leaf (the draft's second choice at its least confident position) is verified in the same pass
  where that position was uncertain and rows are cheap enough (`leaf_position`, `DraftGate.leaf_pays`);
- DraftGate turns the draft model off while its rounds bring fewer tokens per unit of cost than plain
  decoding, with trials to turn it back on.
Only the choice of what to propose depends on these; what is emitted never does, so exactness holds. A sampled
generation is the exception to "measured": how many drafts a round makes decides how many random numbers it
draws, so a gate fed by the clock would make the same seed give another text each run. It gets a FixedCostGate,
fresh each generation: the same rules over fixed costs of this machine kind and proposer.
"""

from __future__ import annotations

from jllm.spec import LEAF_TAKEN


def draft_goes_on(n: int, k: int, k_min: int, chain: float, threshold: float, extend=None) -> bool:
    """After n drafted tokens (of at most k) whose probabilities multiply to `chain`: draft one more?
    At least k_min, at most k; in between while chain >= threshold and extend(n + 1, chain) says the
    next token pays (None: always). The test comes before the draft's next forward pass, so no pass is paid
    for a token then dropped for low confidence."""
    if n >= k:
        return False
    if n < k_min:
        return True
    return chain >= threshold and (extend is None or extend(n + 1, chain))


def ngram_keep(n: int, held: int, broke: int, pays) -> int:
    """How many of an n-token n-gram proposal to verify (at least 1). The j-th token holds with about c^j,
    c = (held + 1) / (held + broke + 2) being the share of n-gram tokens that held after the ones before them
    (held: n-gram tokens accepted so far; broke: n-gram rounds cut short by a rejection); keep the j-th
    while pays(j, c^j) (DraftGate.extend_pays with free=True: an n-gram token costs no draft step)."""
    c = (held + 1) / (held + broke + 2)
    keep = 1
    while keep < n and pays(keep + 1, c ** (keep + 1)):
        keep += 1
    return keep


def next_length(kind: str, k: int, drafted: int, accepted: int, k_min: int, k_max: int) -> int:
    """The next round's length limit for this proposer, k being this round's. A draft model: 2 past what
    this round got accepted (its confidence decides within that), so a draft wrong from its first token is
    not trusted with k_max steps next round however confident it is. n-gram: one more after a fully accepted
    round; after a copied span broke off, only as far as it held."""
    if kind != "ngram":
        return max(k_min, min(k_max, accepted + 2))
    if accepted == drafted:
        return min(k_max, k + 1)
    return max(k_min, accepted + 1)


def leaf_position(probs: list[float], leaf_p: float) -> int | None:
    """The drafted position whose token the draft was least sure of (the first such), if its probability
    is below leaf_p: where a side leaf goes."""
    if not probs:
        return None
    i = min(range(len(probs)), key=probs.__getitem__)
    return i if probs[i] < leaf_p else None

class RowCost:
    def __init__(self, prior: float = 0.1, decay: float = 0.95, min_spread: float = 0.25):
        """prior: the row cost assumed until the rounds' draft counts have varied enough to fit one (their
        weighted variance at least min_spread)."""
        self.prior, self.decay, self.min_spread = prior, decay, min_spread
        self.w = self.sk = self.skk = self.st = self.skt = 0.0

    def add(self, k: int, seconds: float) -> None:
        """One verify pass: k rows beyond the first, and its time."""
        d = self.decay
        self.w = d * self.w + 1.0
        self.sk = d * self.sk + k
        self.skk = d * self.skk + k * k
        self.st = d * self.st + seconds
        self.skt = d * self.skt + k * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds, or None before the draft counts have varied enough."""
        if self.w == 0.0:
            return None
        mk, mt = self.sk / self.w, self.st / self.w
        var = self.skk / self.w - mk * mk
        if var < self.min_spread:
            return None
        b = (self.skt / self.w - mk * mt) / var
        return mt - b * mk, b

    @property
    def value(self) -> float:
        """b / a, in target steps a row (the prior until it can be fitted; within [0, 2])."""
        f = self.fit()
        if f is None or f[0] <= 0.0:
            return self.prior
        return min(2.0, max(0.0, f[1] / f[0]))


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
        """The defaults were chosen by replaying the corpus traces with this gate in the loop
        (BENCHMARKS.md, "Speculative decoding")."""
        self.explore, self.max_explore, self.give_up, self.trial_rounds = explore, max_explore, give_up, trial_rounds
        self.decay, self.row_cost, self.warmup, self.off_below = decay, row_cost, warmup, off_below
        self.stats = None            # moving averages per draft round: [tokens, draft forwards, drafts k]
        self.draft_step = None       # seconds per draft forward pass of one token
        self.target_step = None      # seconds per target step, from verify passes: time / (1 + row_cost * k)
        self.evidence = 0            # draft rounds seen
        self.lost = 0                # trials lost in a row
        self.rows = RowCost()        # what one more row of a verify pass costs, measured (RowCost)
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
        (value() tokens a step). So where rows are cheap (wide vector units, slow memory) leaves run, and
        where a row costs a quarter of a step (AVX2) they do not."""
        return self.leaf_rate >= self.rows.value * (self.value() or 1.0)

    def extend_pays(self, k: int, chain: float, free: bool = False) -> bool:
        """Whether the draft should go on to a k-th token this round, the tokens so far holding with
        probability `chain` (the product of the draft's own probabilities). The k-th token is accepted with
        about that probability, and costs a draft step plus the verify pass's k-th row. That pays while the
        tokens it is expected to bring per step of cost reach the rate draft rounds already get (value(), at
        least plain decoding's 1 a step). A row's cost is the measured difference between verify passes over
        k and k - 1 drafts, since rows do not cost alike: on AVX2 a 5th row starts a second pass over every
        tile (BENCHMARKS.md). Until both are measured, the fitted cost of a row (rows.value).
        free: the token costs no draft step (n-gram)."""
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
        # the gate's own cost model keeps its fixed row_cost, not rows.value: the fitted cost made it drop
        # marginal drafts that paid (BENCHMARKS.md, "AVX2-only CPU")
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
        return moving_average(old, new, self.decay)


def moving_average(old: float | None, new: float, decay: float) -> float:
    """An exponential moving average's next value (the first value as it is)."""
    return new if old is None else decay * old + (1 - decay) * new


class RoundGate:
    """Whether greedy decoding on a GPU runs speculative rounds on the device (jllm.cuda.rounds) or plain steps
    chained there (jllm.cuda.chain), stretch by stretch, from the seconds a token each has taken (moving
    averages). Rounds draft k tokens every round whatever the head's confidence, so with a head that the text
    does not suit they cost more than they bring. Unlike DraftGate it compares times: a lent GPU is not shared
    as the CPU's cores are, so its times hold still from one stretch to the next (a stretch in which a CUDA
    graph was captured is not observed: the caller skips it).

    Rounds go first; after their first stretch, steps get one to be measured; then the faster mode runs
    stretches of `stretch` tokens and the other gets one of `probe` tokens every `probe_every` stretches, since
    a head's acceptance moves with the text (code against prose)."""

    def __init__(self, stretch: int = 48, probe: int = 16, probe_every: int = 6, decay: float = 0.7,
                 fixed: str | None = None):
        """fixed: always this mode (a measurement of one mode's own speed)."""
        self.stretch, self.probe, self.probe_every, self.decay = stretch, probe, probe_every, decay
        self.fixed = fixed
        self.per_token = {"rounds": None, "steps": None}     # seconds a token, moving averages
        self.stretches = 0

    def next(self) -> tuple[str, int]:
        """The next stretch: its mode ("rounds" or "steps") and its length in tokens."""
        self.stretches += 1
        if self.fixed is not None:
            return self.fixed, self.stretch
        r, s = self.per_token["rounds"], self.per_token["steps"]
        if r is None:
            return "rounds", self.stretch
        if s is None:
            return "steps", self.probe
        best, other = ("rounds", "steps") if r <= s else ("steps", "rounds")
        if self.stretches % self.probe_every == 0:
            return other, self.probe
        return best, self.stretch

    def observe(self, mode: str, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self.per_token[mode] = moving_average(self.per_token[mode], seconds / tokens, self.decay)


# a sampled generation's costs, in target steps: a verify row by the CPU's kernels (BENCHMARKS.md: ~0.04-0.06 with
# AVX-512, a round ~1.3 steps with AVX2; the GPU's float kernels ~0.1), and a drafting step by the proposer
FIXED_ROW = {"avx512": 0.05, "avx2": 0.15, "cuda": 0.1}
FIXED_DRAFT_STEP = {"head": 0.05, "draft": 0.25}


class FixedCostGate(DraftGate):
    """DraftGate's rules over fixed costs instead of measured times: `row` target steps a verify row, `draft_step`
    a drafting step. Its decisions then follow only the rounds' outcomes, which a seed fixes, so a sampled
    generation repeats for the same seed whatever the clock says (the clock's gate would draft a token more or
    less when a step ran slow, and draw one more or one less random number)."""

    def __init__(self, row: float, draft_step: float, **kw):
        super().__init__(**kw)
        self.fixed_row, self.fixed_draft_step = row, draft_step

    def observe(self, verify_s: float, k: int, draft_step_s: float | None = None) -> None:
        super().observe(1.0 + self.fixed_row * k, k, None if draft_step_s is None else self.fixed_draft_step)
