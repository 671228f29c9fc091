"""Sampling: turn one row of logits into a token id. Pure functions of tensors plus a seeded generator.

Order of the filters follows llama.cpp's default chain: repetition penalty, top-k, top-p, min-p, temperature.
`probs()` exposes the final distribution so speculative decoding's rejection sampler can use exactly the
distribution plain sampling draws from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from jllm.errors import JllmError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    min_p: float = 0.0                # 0 = off
    repeat_penalty: float = 1.0       # 1 = off
    repeat_last_n: int = 64           # tokens of history penalized; 0 = off, -1 = all (llama.cpp)
    seed: int | None = None           # None = a fresh random seed
    max_tokens: int = 256
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        # written as `not (ok)` so that NaN fails every check
        if not (0.0 <= self.temperature < math.inf):
            raise JllmError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k < 0:
            raise JllmError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise JllmError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise JllmError(f"min-p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repeat_penalty < math.inf):
            raise JllmError(f"repeat penalty must be > 0 and finite, got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise JllmError(f"repeat-last-n must be >= -1, got {self.repeat_last_n}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise JllmError(f"seed must be in 0..2^64-1, got {self.seed} (leave it out for a random seed)")
        if self.max_tokens < 0:
            raise JllmError(f"max tokens must be >= 0, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """Greedy without a repeat penalty: the next token is the logits' own argmax, which needs no history
        (what trees of drafts and the GPU's chained steps decide on)."""
        return self.greedy and self.repeat_penalty == 1.0


def apply_repeat_penalty(logits: torch.Tensor, history: list[int], penalty: float, last_n: int) -> torch.Tensor:
    """logits: [V]. Divide positive / multiply negative logits of recently seen tokens (llama.cpp, CTRL).

    last_n: how many of the most recent tokens count; 0 = none, -1 = the whole history.
    """
    if penalty == 1.0 or not history or last_n == 0:
        return logits
    recent = history[-last_n:] if last_n > 0 else history
    v = logits.shape[-1]                     # a draft's logits may cover only a vocabulary prefix
    ids = torch.tensor(sorted(i for i in set(recent) if i < v), dtype=torch.long, device=logits.device)
    vals = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def probs(logits: torch.Tensor, p: SamplingParams, history: list[int] = ()) -> torch.Tensor:
    """logits: [V] -> the distribution [V] float32 that `sample` draws from (one-hot at the argmax if greedy).

    Top-k, top-p and min-p choose the candidates on the distribution before temperature; temperature then
    reshapes the candidates' probabilities (llama.cpp's order, so a temperature never changes the set).
    """
    logits = apply_repeat_penalty(logits.float(), list(history), p.repeat_penalty, p.repeat_last_n)
    if p.greedy:
        return torch.nn.functional.one_hot(torch.argmax(logits), logits.shape[-1]).float()
    if not p.top_k and p.top_p == 1.0 and p.min_p == 0.0:
        return torch.softmax(logits / p.temperature, dim=-1)
    keep = None                                               # None: every id (no pass over a mask of all)
    if p.top_k and p.top_k < logits.shape[-1]:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[torch.topk(logits, p.top_k).indices] = True       # exactly k, even with ties
    pr = torch.softmax(logits if keep is None else logits.masked_fill(~keep, float("-inf")), dim=-1)
    if p.top_p < 1.0:
        keep = nucleus(pr, p.top_p) if keep is None else keep & nucleus(pr, p.top_p)
    if p.min_p > 0.0:
        likely = pr >= p.min_p * pr.max()
        keep = likely if keep is None else keep & likely
    kept = logits if keep is None else logits.masked_fill(~keep, float("-inf"))
    return torch.softmax(kept / p.temperature, dim=-1)


NUCLEUS_TRIES = (256, 4096)      # candidates looked at before sorting the whole distribution


def nucleus(pr: torch.Tensor, top_p: float) -> torch.Tensor:
    """pr: [V] a distribution -> [V] bool, top-p's set: in the order of falling probability (ties by id), the
    tokens before which the mass is still below top_p (the smallest prefix whose mass reaches top_p), the mass
    before a token being (running sum in double up to and including it) - (its own).

    The native kernels' nucleus where they are loaded (one pass gathers the likely ids, only those are sorted),
    else nucleus_torch: the same set either way (tests/test_sampling.py)."""
    from jllm.kernels import loaded

    native = loaded()
    if native is not None and pr.device.type == "cpu" and pr.dtype == torch.float32:
        return native.nucleus(pr, float(top_p))              # the same set in one pass (kernels/sampling.cpp)
    return nucleus_torch(pr, top_p)


def nucleus_torch(pr: torch.Tensor, top_p: float) -> torch.Tensor:
    """nucleus without the native kernels, and without sorting all of pr where it can: the K most likely
    probabilities (torch.topk, ~0.2 ms for 256 of 151,936 against ~11 ms for a sort) are the sort's first K
    values in its order, ties being equal values, so their running mass is the sort's; if the set ends inside
    them it ends at a value v, every token above v is in it and of those at v the first by id fill it up. Only
    where the K most likely hold less than top_p (a flat distribution) does it try more, then sort all."""
    n = pr.shape[-1]
    for k in NUCLEUS_TRIES:
        if k >= n:
            break
        vals = torch.topk(pr, k).values                      # falling
        m = int(((torch.cumsum(vals.double(), 0) - vals) < top_p).sum())   # the set's size, if it ends inside
        if m < k:
            v = vals[m - 1]
            keep = pr > v
            tied = (pr == v).nonzero()[:, 0]                 # by id
            keep[tied[:m - int(keep.sum())]] = True
            return keep
    keep = torch.zeros_like(pr, dtype=torch.bool)
    ids, some = None, pr > 0
    if int(some.sum()) * 2 < n:              # top-k's or a head's zeros: sort only the rest (a third the time
        ids = some.nonzero()[:, 0]           # for a head's 28,672 of 151,936), the zeros last as in the sort
        pr = pr[ids]
    sp, si = torch.sort(pr, descending=True, stable=True)
    before = torch.cumsum(sp.double(), 0) - sp               # the mass of the more likely tokens
    si = si[before < top_p]
    keep[si if ids is None else ids[si]] = True
    if ids is not None and float(before[-1] + sp[-1]) < top_p:   # the whole mass below top_p: the zeros too
        keep[:] = True
    return keep


def draw(weights: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """weights: [B, V] non-negative, unnormalised, each row with mass -> [B] one id per row drawn in proportion.

    Inverse CDF in float64: one uniform per row and a binary search. torch.multinomial draws the same
    distribution but takes ~15 ms for one row of 151,936 on this machine (cumsum + search: ~0.2 ms).
    A zero-weight id is never drawn: searchsorted(right=True) returns the first id whose cdf exceeds x.
    """
    cdf = torch.cumsum(weights.cpu().double(), 1)                                        # [B, V]
    x = torch.rand(cdf.shape[0], 1, generator=gen, dtype=torch.float64) * cdf[:, -1:]    # [B, 1] in [0, total)
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()                  # a fresh random seed for this generator only
    else:
        g.manual_seed(seed)
    return g


def argmax(logits: torch.Tensor) -> list[int]:
    """logits: [R, V] or [V] -> each row's argmax (first index on ties, NaN largest: torch.argmax's rules).
    On the CPU through jllm's kernel where it is built (faster than torch's on a verify pass's rows of
    151,936 logits; BENCHMARKS.md, "A forward pass in one native call"), else torch."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        from jllm.kernels import qgemm

        k = qgemm()
        if k is not None:
            return k.argmax_rows(logits)
    return torch.argmax(logits, -1).reshape(-1).tolist()


def sample(logits: torch.Tensor, p: SamplingParams, history: list[int], gen: torch.Generator) -> int:
    """logits: [V] -> token id."""
    if p.greedy:
        logits = apply_repeat_penalty(logits.float(), history, p.repeat_penalty, p.repeat_last_n)
        return argmax(logits)[0]
    return int(draw(probs(logits, p, history)[None], gen)[0])
