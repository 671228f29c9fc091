"""What one more row of a verify pass costs, measured from the passes themselves.

A verify pass over k drafts takes about a + b k seconds: a is a step's stream of the weights, b the compute
of one more row. b / a is the row's cost in target steps, and it is a property of the machine, not of the
model: ~0.03 on a Zen 4 with AVX-512 VNNI while memory is slow, ~0.15 while it is fast, ~0.25 on a Zen 3
with AVX2 only (every vector op of a row takes a slot of the same four FP pipes; BENCHMARKS.md). Rows past the
fourth cost more again there; DraftGate keeps the cost per draft count for that. Whether an extra row pays, as
the side leaf does (spec/decode.py), depends on it, so the decoder measures it instead of assuming one figure.

The fit is least squares over the rounds with weights decaying by `decay` a round: the host's memory speed
drifts over minutes, and the recent rounds are the ones that tell what the next will cost.
"""

from __future__ import annotations


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
