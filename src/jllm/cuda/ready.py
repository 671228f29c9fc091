"""x made ready once for every product over it in a pass: the tensor cores' f16 halves (jllm.cuda.mma) and the
int8 codes of the dp4a kernels (jllm.cuda.dp4a), for whichever of a layer's parts run there. Either the layer
makes it with one launch (`prepare`), or the kernel that writes x fills it as it writes (`empty`'s room, given
to the norms, the GLU and the attention's merge: jllm.cuda.fused, jllm.cuda.attention), so that no launch of
its own does it. Each family reads only its own part; a block type runs in one family at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jllm.cuda import dp4a, mma
from jllm.cuda.codes import ASM

_both = set(mma.TYPES) & set(dp4a.TYPES)
if _both:
    raise ValueError(f"JLLM_MATVEC_MMA and JLLM_MATVEC_DP4A both ask for {sorted(t.__name__ for t in _both)}")


@dataclass
class Ready:
    """x made ready for the tensor cores (mma) and for the dp4a kernels (dp4a); None where no part runs there."""
    mma: mma.Prepared | None
    dp4a: dp4a.Prepared | None


def pointers(prep: Ready | None, fallback: torch.Tensor) -> tuple[tuple, dict]:
    """A producer's arguments: the eleven tensors prep_block writes (the tensor cores' seven, then dp4a's four;
    `fallback` where a family is not asked for, or prep is None: its stores are compiled out) and its flags."""
    cores = prep.mma if prep is not None else None
    ints = prep.dp4a if prep is not None else None
    a, q4, q6 = cores.pointers() if cores is not None else ((fallback,) * 7, False, False)
    b, i4, i6 = ints.pointers() if ints is not None else ((fallback,) * 4, False, False)
    return (*a, *b), dict(Q4=q4, Q6=q6, I4=i4, I6=i6, USE_ASM=ASM)


def _families(x: torch.Tensor, parts) -> tuple[list, list]:
    """The parts whose products over x run on the tensor cores, and those on the dp4a kernels."""
    return [p for p in parts if mma.handles(x, p)], [p for p in parts if dp4a.handles(x, p)]


def empty(x: torch.Tensor, k: int, parts) -> Ready | None:
    """Room for x [T, k] made ready for the products of `parts` over it, for its producer to fill; None where
    none of them needs it."""
    cores, ints = _families(x, parts)
    if not cores and not ints:
        return None
    m = x.shape[0]
    return Ready(mma.empty(m, k, *mma.kinds(cores), x.device) if cores else None,
                 dp4a.empty(m, k, *dp4a.kinds(ints), x.device) if ints else None)


def prepare(x: torch.Tensor, parts) -> Ready | None:
    """x [T, K] float32 (contiguous) made ready for the products of `parts` over it: one launch a family."""
    cores, ints = _families(x, parts)
    if not cores and not ints:
        return None
    return Ready(mma.prepare(x, cores) if cores else None, dp4a.prepare(x, ints) if ints else None)


@triton.jit
def prep_block(x_ptr, r, kb, K, xh4, xl4, sh, sl, xh6, xl6, inv, xq4, s4, xq6, s6, Q4: tl.constexpr,
               Q6: tl.constexpr, I4: tl.constexpr, I6: tl.constexpr, USE_ASM: tl.constexpr):
    """Super-block kb of row r of x [M, K] (as stored) made ready for the families asked for: the tensor cores'
    Q4_K and Q6_K halves (Q4, Q6: mma._prep_block), dp4a's Q4_K- and Q6_K-ordered codes (I4, I6)."""
    if Q4 or Q6:
        mma._prep_block(x_ptr, r, kb, K, K // 256, xh4, xl4, sh, sl, xh6, xl6, inv, Q4, Q6)
    if I4 or I6:
        dp4a.prep_block(x_ptr, r, kb, K, xq4, s4, xq6, s6, I4, I6, USE_ASM)
