"""The small operations of a GPU layer fused into single Triton kernels (issue 23): a decode step is hundreds
of launches, and the profile (benchmarks/cuda_profile.py) put the norms, RoPE, the cache writes and the adds at
a third of its kernels' time before these. Each kernel works row by row, one program a row (or a row's head,
or a part of a row), so a row's result never depends on the other rows of its call, as everywhere in the blocks
precision.

    rms_norm(x, w, eps)                    one program a row (with prep: a row and super-block)
    add_rms_norm(x, a, w, eps)             x + a, and its norm: the residual add and the next norm in one pass
    rope_store(qk, v, pos, cos, sin, ...)  RoPE on q and k, k and v written into the cache at pos: q out
    glu(gu, gelu)                          silu(gate) * up (or GELU's tanh form): half the columns out

The norms and the GLU also make their output ready for the products over it when given `prep`
(jllm.cuda.ready.empty: the tensor cores' f16 halves, the dp4a kernels' int8 codes), so that no launch of its
own does it. Then a program prepares one super-block of 256 values (each a reduction and its stores), so that a
row's super-blocks are prepared side by side rather than one after another in its one program: the norm runs a
program a (row, super-block), each summing the whole row as the one program a row does (h bitwise the same) and
storing its own super-block of it; the GLU runs blocks of 256.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jllm.cuda.ready import Ready, pointers, prep_block


@triton.jit
def _rms_norm(x_ptr, a_ptr, w_ptr, xo_ptr, h_ptr, D, eps, xh4, xl4, sh, sl, xh6, xl6, inv, xq4, s4, xq6, s6,
              HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, Q4: tl.constexpr, Q6: tl.constexpr, I4: tl.constexpr,
              I6: tl.constexpr, USE_ASM: tl.constexpr):
    r = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    live = i < D
    own = live
    if Q4 or Q6 or I4 or I6:             # a program a super-block (program_id 1): the whole row's sum, its own stores
        own = live & (i // 256 == tl.program_id(1))
    x = tl.load(x_ptr + r * D + i, mask=live, other=0.0)
    if HAS_ADD:
        x += tl.load(a_ptr + r * D + i, mask=live, other=0.0)
        tl.store(xo_ptr + r * D + i, x, mask=own)
    ms = tl.sum(x * x, axis=0) / D
    w = tl.load(w_ptr + i, mask=live, other=0.0)
    tl.store(h_ptr + r * D + i, x * tl.rsqrt(ms + eps) * w, mask=own)
    if Q4 or Q6 or I4 or I6:             # its super-block again, as stored, for the products over it (jllm.cuda.ready)
        tl.debug_barrier()               # this program's stores, seen by all its threads
        prep_block(h_ptr, r, tl.program_id(1), D, xh4, xl4, sh, sl, xh6, xl6, inv, xq4, s4, xq6, s6, Q4, Q6, I4, I6,
                   USE_ASM)


def _norm(x: torch.Tensor, a: torch.Tensor | None, w: torch.Tensor, eps: float, prep: Ready | None):
    x = x.contiguous()
    T, D = x.shape
    xo, h = (x if a is None else torch.empty_like(x)), torch.empty_like(x)
    if prep is not None and D % 256:
        raise ValueError(f"the norm's rows of {D} values are not whole super-blocks of 256 to fill prep")
    ptrs, flags = pointers(prep, h)
    # With prep a row's super-blocks are prepared side by side, a program each (each sums the whole row, the same
    # code on the same shape as the one program a row without prep, so h is bitwise the same); without, a row a
    # program.
    grid = (T, D // 256) if prep is not None else (T,)
    _rms_norm[grid](x, x if a is None else a.contiguous(), w, xo, h, D, eps, *ptrs,
                    HAS_ADD=a is not None, BLOCK=triton.next_power_of_2(D), **flags)
    return xo, h


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, prep: Ready | None = None) -> torch.Tensor:
    """x [T, D] float32 -> x / rms(x) * w (and `prep` filled from it)."""
    return _norm(x, None, w, eps, prep)[1]


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float,
                 prep: Ready | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, a [T, D] float32 -> (x + a, rms_norm(x + a) * w) (and `prep` filled from the norm)."""
    return _norm(x, a, w, eps, prep)


@triton.jit
def _rope_store(qk_ptr, QK_STRIDE, v_ptr, V_STRIDE, pos_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr,
                H, HK, MAX_T, HD: tl.constexpr, ROPE: tl.constexpr, NEOX: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)              # 0..H-1: q heads, H..H+HK-1: k heads, then v heads
    d = tl.arange(0, HD)
    p = tl.load(pos_ptr + t)
    if head < H + HK:
        row = qk_ptr + t * QK_STRIDE + head * HD
        x = tl.load(row + d)
        half: tl.constexpr = ROPE // 2
        if NEOX:                         # pairs (i, i + ROPE / 2)
            partner = tl.where(d < half, d + half, d - half)
            sign = tl.where(d < half, -1.0, 1.0)
            f = d % half
        else:                            # pairs (2i, 2i + 1)
            partner = d ^ 1
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
            f = d // 2
        rot = d < ROPE
        xp = tl.load(row + partner, mask=rot, other=0.0)
        c = tl.load(cos_ptr + p * half + f, mask=rot, other=1.0)
        s = tl.load(sin_ptr + p * half + f, mask=rot, other=0.0)
        y = tl.where(rot, x * c + sign * xp * s, x)
        if head < H:
            tl.store(q_ptr + (t * H + head) * HD + d, y)
        else:
            tl.store(kc_ptr + ((head - H) * MAX_T + p) * HD + d, y.to(kc_ptr.dtype.element_ty))
    else:
        kvh = head - H - HK
        x = tl.load(v_ptr + t * V_STRIDE + kvh * HD + d)
        tl.store(vc_ptr + (kvh * MAX_T + p) * HD + d, x.to(vc_ptr.dtype.element_ty))


def rope_store(qk: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               neox: bool, rope_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """qk [T, H + Hk, hd], v [T, Hk, hd] (float32 views whose rows may be further apart, heads contiguous);
    pos int64 [T] on the device; cos, sin [n_pos, rope_dim / 2]; the layer's caches [Hk, max, hd] ->
    q [T, H, hd] rotated; k rotated and v written into the caches at pos."""
    T, heads, hd = qk.shape
    hk, max_t, _ = k_cache.shape
    if qk.stride(2) != 1 or qk.stride(1) != hd or v.stride(2) != 1 or v.stride(1) != hd:
        raise ValueError("rope_store needs each row's heads contiguous")
    H = heads - hk
    q = torch.empty(T, H, hd, dtype=torch.float32, device=qk.device)
    _rope_store[(T, H + 2 * hk)](qk, qk.stride(0), v, v.stride(0), pos, cos, sin, q, k_cache, v_cache, H, hk, max_t,
                                 HD=hd, ROPE=rope_dim, NEOX=neox)
    return q


@triton.jit
def _glu(gu_ptr, o_ptr, F, xh4, xl4, sh, sl, xh6, xl6, inv, xq4, s4, xq6, s6, GELU: tl.constexpr,
         BLOCK: tl.constexpr, Q4: tl.constexpr, Q6: tl.constexpr, I4: tl.constexpr, I6: tl.constexpr,
         USE_ASM: tl.constexpr):
    r = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < F
    g = tl.load(gu_ptr + r * 2 * F + i, mask=live, other=0.0)
    u = tl.load(gu_ptr + r * 2 * F + F + i, mask=live, other=0.0)
    if GELU:                             # the tanh approximation, as F.gelu(approximate="tanh")
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    else:
        act = g / (1.0 + tl.exp(-g))
    tl.store(o_ptr + r * F + i, act * u, mask=live)
    if Q4 or Q6 or I4 or I6:             # this program's super-blocks again, for the products over them
        tl.debug_barrier()
        first = tl.program_id(1) * (BLOCK // 256)
        for kb in range(first, tl.minimum(F // 256, first + BLOCK // 256)):
            prep_block(o_ptr, r, kb, F, xh4, xl4, sh, sl, xh6, xl6, inv, xq4, s4, xq6, s6, Q4, Q6, I4, I6, USE_ASM)


def glu(gu: torch.Tensor, gelu: bool, block: int | None = None, prep: Ready | None = None) -> torch.Tensor:
    """gu [T, 2F] (gate | up) float32 -> act(gate) * up [T, F] (and `prep` filled from it). block: the values a
    program; by default 1024, or 256 with prep (a program a super-block, so a row's preparation spreads over
    F / 256 programs rather than running a program's super-blocks one after another); a multiple of 256 with
    prep."""
    gu = gu.contiguous()
    T, f = gu.shape[0], gu.shape[1] // 2
    if block is None:
        block = 256 if prep is not None else 1024
    if prep is not None and block % 256:
        raise ValueError(f"glu's block {block} must be a multiple of 256 to fill prep (whole super-blocks a program)")
    out = torch.empty(T, f, dtype=torch.float32, device=gu.device)
    ptrs, flags = pointers(prep, out)
    _glu[(T, triton.cdiv(f, block))](gu, out, f, *ptrs, GELU=gelu, BLOCK=block, **flags)
    return out
