"""Attention on the GPU with the CPU kernel's contract: each (query, head) over exactly its own keys, in one
fixed order, so a query's output is bitwise the same whatever other queries share the call (a verify pass
over k + 1 tokens gives each the output of a decode step of it; exact speculation needs that).

One program per (query t, head h): its keys are positions lo..p (p = start + t; lo = p - window + 1 with a
sliding window, else 0), read in blocks of BLOCK_T keys aligned to absolute positions, with an online softmax
(running max and sum) in float32. Nothing in it depends on how many queries the call has.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _attention(q_ptr, k_ptr, v_ptr, o_ptr, start, window, scale, H, GROUP, MAX_T,
               HD: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    p = start + t
    lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (t * H + h) * HD + d).to(tl.float32)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc = tl.zeros((HD,), tl.float32)
    for j0 in range((lo // BLOCK_T) * BLOCK_T, p + 1, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        live = (j >= lo) & (j <= p)
        base = (kvh * MAX_T + j)[:, None] * HD + d[None, :]
        k = tl.load(k_ptr + base, mask=live[:, None], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(live, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        e = tl.exp(s - m_new)
        v = tl.load(v_ptr + base, mask=live[:, None], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(e, axis=0)
        acc = acc * alpha + tl.sum(e[:, None] * v, axis=0)
        m_i = m_new
    tl.store(o_ptr + (t * H + h) * HD + d, acc / l_i)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int, scale: float,
              block_t: int = 64) -> torch.Tensor:
    """q [T, H, hd] at positions start..start+T-1; k, v the layer's cache [Hk, max, hd] (keys up to
    start + T - 1 written) -> [T, H * hd] float32. hd: a power of two."""
    T, H, hd = q.shape
    hk, max_t, _ = k.shape
    if hd & (hd - 1) or H % hk:
        raise ValueError(f"head size {hd} must be a power of two and {H} heads a multiple of {hk}")
    if start + T > max_t:
        raise ValueError(f"positions up to {start + T - 1} in a cache of {max_t}")
    out = torch.empty(T, H, hd, dtype=torch.float32, device=q.device)
    _attention[(T, H)](q.contiguous(), k.contiguous(), v.contiguous(), out, start, window, scale, H, H // hk,
                       max_t, HD=hd, BLOCK_T=block_t)
    return out.view(T, H * hd)
