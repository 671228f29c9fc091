"""Speculative decoding: proposers, verification rules, the draft/target compatibility gate, the bench corpus."""

# Drafting defaults, shared by SpecConfig and the CLI (which must not import torch to print its help).
# p_min: the draft drafts on while the product of its probabilities stays above it. Replaying the corpus's
# recorded traces with the measured draft and verify costs (benchmarks/spec_sim.py) gave 1.50x at 0.7,
# 1.49x at 0.6, 1.46x at 0.5.
DRAFT_MAX = 8
DRAFT_MIN = 1
P_MIN = 0.7
# FR-Spec: the draft scores only the first DRAFT_VOCAB token ids (BPE ids rise with merge rank, roughly
# falling frequency). Replay of the corpus traces, draft 0.5B: 32,768 ids agree with the target's token at
# 75.6 % of positions (1.49x), 65,536 at 79.0 % (1.52x, +7.6 % draft bytes), all 151,936 at 80.9 % (1.47x).
DRAFT_VOCAB = 65536
# Side leaf: with a greedy draft, the verify pass also carries the draft's second choice at its least
# confident drafted position when that position's probability is < LEAF_P. Replay of the corpus traces with
# the engine's gate (benchmarks/spec_sim.py sim, costs measured in the loop): 1.67x -> 1.74x where rows are
# cheap (slow memory phase, 0.5: 1.71x, 0.9: 1.74x), 1.40x -> 1.41x where they are not (fast phase).
LEAF_P = 0.7
# The share of side leaves taken, assumed until the decoder has seen some (269 of 1,086 in a corpus run);
# with the measured cost of a row it decides whether leaves pay on this machine (DraftGate.leaf_pays).
LEAF_TAKEN = 0.25
