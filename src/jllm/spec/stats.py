"""What speculation did, counted per generation and shown by `--verbose`, `--json`, the server and the bench."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    leaves: int = 0             # side leaves verified, and how many of them were taken
    leaves_taken: int = 0
    tree_rounds: int = 0        # rounds that verified a tree, and tokens accepted off its first chain
    off_chain: int = 0
    by_proposer: dict = field(default_factory=lambda: {"ngram": [0, 0, 0], "draft": [0, 0, 0]})  # rounds, drafted, accepted
    accept_hist: dict = field(default_factory=dict)      # accepted length -> rounds
    draft_s: float = 0.0
    verify_s: float = 0.0

    def record(self, proposer: str, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        row = self.by_proposer.setdefault(proposer, [0, 0, 0])
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
            "tree_rounds": self.tree_rounds, "off_chain": self.off_chain,
            "draft_ms": round(self.draft_s * 1000, 1), "verify_ms": round(self.verify_s * 1000, 1),
        }
