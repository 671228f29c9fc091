"""Speculative decoding: proposers, verification rules, the draft/target compatibility gate, the bench corpus."""

# Drafting defaults, shared by SpecConfig and the CLI (which must not import torch to print its help).
# p_min: the draft drafts on while the product of its probabilities stays above it. Replaying the corpus's
# recorded traces with the measured draft and verify costs (benchmarks/spec_sim.py) gave 1.50x at 0.7,
# 1.49x at 0.6, 1.46x at 0.5.
DRAFT_MAX = 8
DRAFT_MIN = 1
P_MIN = 0.7
