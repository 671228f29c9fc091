"""Speculative decoding: proposers, verification rules, the draft/target compatibility gate, the bench corpus."""
