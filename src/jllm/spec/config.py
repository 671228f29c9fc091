"""The speculative decoder's settings, built and validated in one place (the CLI, the server and the Python
API all make a SpecConfig). No torch here: the CLI imports this to print its help."""

from __future__ import annotations

from dataclasses import dataclass

from jllm.spec import DRAFT_MAX, DRAFT_MIN, DRAFT_VOCAB, HEAD_TAU, LEAF_P, P_MIN

MODES = ("auto", "draft", "ngram", "draft+ngram", "none")
TREE_WIDTH_MAX = 8


@dataclass
class SpecConfig:
    mode: str = "auto"          # auto: draft+ngram with a draft model or head, ngram without; "draft" means the
                                # model proposer, whichever -md loaded
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
    tree_width: int = 0         # greedy with an EAGLE-3 head on the native stack: draft a tree, each expanded
                                # node's this many best children (0 or 1: a chain), where rows pay for them
    tree_branches: int = 2      # ... expanding this many nodes a depth (one batched head step)
    tree_nodes: int = 8         # ... of at most this many nodes (verify rows)
    tree_p: float = 0.0         # ... each node's path at least this likely by the head (and paying for its row)
    head_tau: float = HEAD_TAU  # sampled: an EAGLE-3 head's drafts are drawn at this times the sampling
                                # temperature (its distribution is flatter than the target's; see jllm/spec)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"speculation mode {self.mode!r} is not one of {', '.join(MODES)}")
        if not 1 <= self.draft_min <= self.draft_max:
            raise ValueError(f"need 1 <= draft_min <= draft_max, got {self.draft_min}, {self.draft_max}")
        if not 0 <= self.tree_width <= TREE_WIDTH_MAX or self.tree_branches < 1 or self.tree_nodes < 1:
            raise ValueError(f"need 0 <= tree_width <= {TREE_WIDTH_MAX}, tree_branches >= 1 and tree_nodes >= 1, got "
                             f"{self.tree_width}, {self.tree_branches}, {self.tree_nodes}")
        if not 0.05 <= self.head_tau <= 4.0:
            raise ValueError(f"head_tau must be between 0.05 and 4, got {self.head_tau}")

    def proposers(self, has_draft: bool) -> tuple[bool, bool]:
        """(use the n-gram proposer, use the draft model) for this mode."""
        mode = self.mode if self.mode != "auto" else ("draft+ngram" if has_draft else "ngram")
        return mode in ("ngram", "draft+ngram"), has_draft and mode in ("draft", "draft+ngram")


def check_tree(width: int) -> None:
    """--draft-tree's value, refused in one line."""
    if not 0 <= width <= TREE_WIDTH_MAX:
        from jllm.errors import JllmError

        raise JllmError(f"--draft-tree must be between 0 and {TREE_WIDTH_MAX} (got {width})")


def draft_precision_for(target_precision: str, choice: str = "auto") -> str:
    if choice != "auto":
        return choice
    return {"native": "native4", "int8": "int8-fast"}.get(target_precision, target_precision)
