"""The chi-square check that speculative sampling follows the target: the joint distribution of the first
two sampled tokens (top-k 3: up to 9 outcomes), counted over many seeds, against the exact p(t1) p(t2 | t1)
computed from the target itself."""

from __future__ import annotations

import math

import torch

from jllm.sampling import SamplingParams, probs

PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=2)
CRITICAL = {8: 26.12, 7: 24.32, 6: 22.46, 5: 20.52, 4: 18.47}     # chi-square at p = 0.001


def exact_joint(plain, ids: list[int]) -> dict[tuple[int, int], float]:
    """plain: an Engine without speculation over the target."""
    logits, _ = plain.prefill(ids)
    p1 = probs(logits, PARAMS, ids)
    exact = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        plain.target.rollback(len(ids))
        p2 = probs(plain.step(t1), PARAMS, ids + [t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            exact[(t1, t2)] = p1[t1].item() * p2[t2].item()
    return exact


def check(spec, ids: list[int], exact: dict, n: int = 1500) -> int:
    """Sample n times with `spec` (a speculative Engine) and assert the chi-square bound; returns the number
    of tokens drafted. Three tokens a run: t1 from the prefill, t2 drafted and verified, t3 a by-product."""
    counts, drafted = dict.fromkeys(exact, 0), 0
    for seed in range(n):
        spec.reset()                           # and a fresh gate: its first rounds always draft
        res = spec.generate(ids, SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=seed))
        out = tuple(res.token_ids[:2])
        assert out in counts, f"sampled {out}, impossible under the target"
        counts[out] += 1
        drafted += res.spec_stats.drafted
    chi2 = sum((counts[o] - n * pr) ** 2 / (n * pr) for o, pr in exact.items())
    dof = len(exact) - 1
    critical = CRITICAL.get(dof, dof + 5 * math.sqrt(2 * dof))
    assert chi2 < critical, f"chi2 {chi2:.1f} >= {critical} (dof {dof}): {counts} vs {exact}"
    return drafted
