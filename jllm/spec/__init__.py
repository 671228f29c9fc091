"""Speculative decoding: proposers, verification rules, the draft/target compatibility gate, the bench corpus."""

# Drafting defaults, shared by SpecConfig and the CLI (which must not import torch to print its help).
# p_min 0.8: replaying the corpus's recorded traces (benchmarks/spec_sim.py) gave 1.48x at 0.8 against
# 1.45x at 0.6 and 1.42x at 0.4, with the measured draft and verify costs.
DRAFT_MAX = 8
DRAFT_MIN = 1
P_MIN = 0.8
