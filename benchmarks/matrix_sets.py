"""Shared by the weight-format benchmarks: run sets of QLinear matrices (every matrix of a step) for M rows,
the sets interleaved round by round so the host's memory phases fall on all of them alike; print medians."""

from __future__ import annotations

import statistics
import time

import torch


def inputs(mats, M: int, made: dict) -> list[torch.Tensor]:
    """Random [M, in_features] inputs for each matrix, made once per shape (outside any timed loop)."""
    for m in mats:
        if (M, m.in_features) not in made:
            made[M, m.in_features] = torch.randn(M, m.in_features)
    return [made[M, m.in_features] for m in mats]


def timed_pass(mats, M: int, made: dict) -> float:
    """Seconds for one pass of M rows over the matrices."""
    xs = inputs(mats, M, made)
    t = time.perf_counter()
    for m, x in zip(mats, xs):
        m(x)
    return time.perf_counter() - t


def interleaved(sets: dict, rows=(1, 3), rounds: int = 15) -> None:
    """sets: label -> list of QLinear. Prints one line per M: median ms of a pass over each set."""
    made: dict = {}
    print(f"{'M':>2} " + " ".join(f"{k:>12}" for k in sets) + f"   (ms, medians of {rounds})")
    for M in rows:
        times = {k: [] for k in sets}
        for _ in range(rounds):
            for k, ms in sets.items():
                times[k].append(timed_pass(ms, M, made))
        print(f"{M:>2} " + " ".join(f"{statistics.median(v) * 1000:>12.2f}" for v in times.values()), flush=True)
