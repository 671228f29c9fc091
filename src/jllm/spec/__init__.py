"""Speculative decoding: a cheap proposer drafts tokens, the target verifies them in one batched pass.

    config.py     SpecConfig: the settings, validated in one place
    proposers.py  NgramProposer, DraftModelProposer: propose(context, k) -> Proposal
    verify.py     the rejection rules (accepted, recovered, bonus tokens), greedy and sampled
    policy.py     how far to draft and whether drafting pays (pure; benchmarks/spec_sim.py replays it)
    loop.py       SpeculativeDecoder: the loop itself
    stats.py      what a generation's speculation did
    compat.py     the draft/target tokenizer gate;  ngram.py  prompt lookup;  corpus.json, bench.py  the bench

The drafting defaults below are shared by SpecConfig and the CLI, which must not import torch to print its
help. Each was chosen by replaying the corpus's traces (benchmarks/spec_sim.py; BENCHMARKS.md,
"Speculative decoding").
"""

DRAFT_MAX = 8           # most tokens a round proposes
DRAFT_MIN = 1           # fewest
P_MIN = 0.7             # the draft drafts on while the product of its probabilities stays above this
# FR-Spec: the draft scores only the first DRAFT_VOCAB token ids (BPE ids rise with merge rank, so roughly
# with falling frequency); the target still verifies over all of them, so exactness holds
DRAFT_VOCAB = 65536
# Side leaf: greedy rounds also verify the draft's second choice at its least confident drafted position when
# that position's probability is below LEAF_P
LEAF_P = 0.7
# Sampled drafting with an EAGLE-3 head: its drafts are drawn at HEAD_TAU times the sampling temperature. The
# head's distribution q is flatter than the target's p, and the verify accepts a sampled draft with probability
# sum min(p, q): the shipped head's first draft on the corpus at T 1.0, 0.565 at tau 1 and 0.597 at 0.6-0.7; at
# T 0.7, 0.604 and 0.616 (BENCHMARKS.md, "The head's drafts at a lower temperature"). Any q keeps the output's
# distribution the target's.
HEAD_TAU = 0.65
# The share of side leaves taken, assumed until the decoder has measured it; with the measured cost of a row
# it decides whether leaves pay on this machine (DraftGate.leaf_pays)
LEAF_TAKEN = 0.25
