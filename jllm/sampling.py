"""Sampling: turn one row of logits into a token id. Pure functions of tensors plus a seeded generator.

Order of the filters follows llama.cpp's default chain: repetition penalty, top-k, top-p, min-p, temperature.
`probs()` exposes the final distribution so speculative decoding's rejection sampler can use exactly the
distribution plain sampling draws from.
"""

from __future__ import annotations

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
    repeat_last_n: int = 64
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise JllmError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise JllmError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise JllmError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise JllmError(f"min-p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise JllmError(f"repeat penalty must be > 0, got {self.repeat_penalty}")
        if self.max_tokens < 0:
            raise JllmError(f"max tokens must be >= 0, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repeat_penalty(logits: torch.Tensor, history: list[int], penalty: float, last_n: int) -> torch.Tensor:
    """logits: [V]. Divide positive / multiply negative logits of recently seen tokens (llama.cpp, CTRL)."""
    if penalty == 1.0 or not history:
        return logits
    recent = history[-last_n:] if last_n > 0 else history
    ids = torch.tensor(sorted(set(recent)), dtype=torch.long, device=logits.device)
    vals = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def probs(logits: torch.Tensor, p: SamplingParams, history: list[int] = ()) -> torch.Tensor:
    """logits: [V] -> the sampling distribution [V] float32 (for temperature > 0)."""
    logits = apply_repeat_penalty(logits.float(), list(history), p.repeat_penalty, p.repeat_last_n)
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logits = logits / p.temperature
    pr = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(pr, descending=True)
        cum = torch.cumsum(sp, dim=-1)
        drop = cum - sp > p.top_p          # keep the smallest prefix whose mass reaches top_p
        pr = pr.clone()
        pr[si[drop]] = 0.0
    if p.min_p > 0.0:
        pr = torch.where(pr < p.min_p * pr.max(), torch.zeros_like(pr), pr)
    return pr / pr.sum()


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else torch.seed())
    return g


def sample(logits: torch.Tensor, p: SamplingParams, history: list[int], gen: torch.Generator) -> int:
    """logits: [V] -> token id."""
    if p.greedy:
        logits = apply_repeat_penalty(logits.float(), history, p.repeat_penalty, p.repeat_last_n)
        return int(torch.argmax(logits))
    return int(torch.multinomial(probs(logits, p, history).cpu(), 1, generator=gen))
