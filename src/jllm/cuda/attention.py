"""Attention on the GPU with the CPU kernel's contract: each (query, head) over exactly its own keys, in one
fixed order, so a query's output is bitwise the same whatever other queries share the call (a verify pass
over k + 1 tokens gives each the output of a decode step of it; exact speculation needs that).

A query t sees the keys at positions lo..p (p = pos[t], read from a device tensor so that a CUDA graph of the
step replays at any position; lo = p - window + 1 with a sliding window, else 0). A decode step is one query,
so to have work for the whole GPU the keys are split (as flash-decoding does) into chunks of absolute positions
whose size depends on the cache's length alone (chunk_size): one program per (query, head, chunk) runs an online
softmax (running max and sum, float32) over its chunk's keys in blocks of BLOCK_T, and one per (query, head)
merges the chunks' parts in a fixed order. Nothing in it depends on how many queries the call has. The cache may
be float16 or float32.

A call of more than QUERIES queries (a prefill's chunk: its matrices already go another way, jllm.cuda.linear)
has work enough in its queries: there one program takes a tile of BLOCK_M queries of a head over blocks of
BLOCK_N keys, so that each block of keys and values is read once for the tile, not once for every query (as
flash attention does), in one launch a layer (a 256-token chunk of a 28-layer model: 28 launches, where the
16-query path would take 896; eager launches of ~30-70 us each are most of a prefill's time). Its products are
float32 (`input_precision="ieee"`, no TF32), so a row keeps the reference's accuracy, and a key block past a
row's own keys adds an exact zero to it; but the products' summing order may move with a row's place in its
tile, so a prefill row is the same to rounding, not bitwise, whatever shares its call (as a prefill's matrices
are already: cuBLAS picks its kernels by the call's shape). A verify pass (at most 16 rows) never takes this
path: exact speculation is untouched.
TILED is off until the tiles are measured on a GPU (they are tested in Triton's interpreter only): such calls
then run each (query, head) over all its keys as one chunk; benchmarks/cuda_profile.py --chunks times both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jllm.cuda.layout import QUERIES, chunk_size, n_chunks
from jllm.cuda.ready import pointers, prep_block

TILED = False     # the tiles' path for prefill: tested in the interpreter, not yet timed on a GPU
BLOCK_M, BLOCK_N = 32, 32


@triton.jit
def _attention_chunk(q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, pos_ptr, window, scale, H, GROUP, MAX_T, NCH,
                     HD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr):
    """(query t, head h, chunk c): softmax statistics and the weighted values of its keys in chunk c."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    kvh = h // GROUP
    p = tl.load(pos_ptr + t).to(tl.int32)
    lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (t * H + h) * HD + d).to(tl.float32)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc = tl.zeros((HD,), tl.float32)
    first = tl.maximum(c * CHUNK, (lo // BLOCK_T) * BLOCK_T)
    for j0 in range(first, tl.minimum((c + 1) * CHUNK, p + 1), BLOCK_T):     # none: a chunk past the query
        j = j0 + tl.arange(0, BLOCK_T)
        live = (j >= lo) & (j <= p)
        base = (kvh * MAX_T + j)[:, None] * HD + d[None, :]
        k = tl.load(k_ptr + base, mask=live[:, None], other=0.0).to(tl.float32)
        s = tl.where(live, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m_i - m_new))
        e = tl.where(live, tl.exp(s - m_new), 0.0)
        v = tl.load(v_ptr + base, mask=live[:, None], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(e, axis=0)
        acc = acc * alpha + tl.sum(e[:, None] * v, axis=0)
        m_i = m_new
    at = (t * H + h) * NCH + c
    tl.store(part_ptr + at * HD + d, acc)
    tl.store(ml_ptr + at * 2, m_i)
    tl.store(ml_ptr + at * 2 + 1, l_i)


@triton.jit
def _combine_head(part_ptr, ml_ptr, t, h, p, window, H, NCH, HD: tl.constexpr, NCH_P2: tl.constexpr,
                  CHUNK: tl.constexpr):
    """(query t at position p, head h): its chunks' parts merged in one fixed order -> [HD]."""
    lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)
    c = tl.arange(0, NCH_P2)
    used = (c >= lo // CHUNK) & (c <= p // CHUNK) & (c < NCH)
    at = (t * H + h) * NCH + c
    m_c = tl.load(ml_ptr + at * 2, mask=used, other=float("-inf"))
    l_c = tl.load(ml_ptr + at * 2 + 1, mask=used, other=0.0)
    m = tl.max(m_c, axis=0)
    w = tl.where(used & (m_c > float("-inf")), tl.exp(m_c - m), 0.0)
    d = tl.arange(0, HD)
    part = tl.load(part_ptr + at[:, None] * HD + d[None, :], mask=used[:, None], other=0.0)
    return tl.sum(w[:, None] * part, axis=0) / tl.sum(w * l_c, axis=0)


@triton.jit
def _attention_combine(part_ptr, ml_ptr, o_ptr, pos_ptr, window, H, NCH, HD: tl.constexpr, NCH_P2: tl.constexpr,
                       CHUNK: tl.constexpr):
    """(query t, head h): the chunks' parts merged in one fixed order (a tile over all chunks)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.load(pos_ptr + t).to(tl.int32)
    out = _combine_head(part_ptr, ml_ptr, t, h, p, window, H, NCH, HD, NCH_P2, CHUNK)
    tl.store(o_ptr + (t * H + h) * HD + tl.arange(0, HD), out)


@triton.jit
def _attention_combine_prep(part_ptr, ml_ptr, o_ptr, pos_ptr, window, H, NCH, xh4, xl4, sh, sl, xh6, xl6, inv,
                            xq4, s4, xq6, s6, HD: tl.constexpr, NCH_P2: tl.constexpr, CHUNK: tl.constexpr,
                            Q4: tl.constexpr, Q6: tl.constexpr, I4: tl.constexpr, I6: tl.constexpr,
                            USE_ASM: tl.constexpr):
    """(query t, super-block kb of its output: 256 / HD heads): each head merged as _attention_combine merges
    it, then the super-block made ready for the products over it (jllm.cuda.ready)."""
    t = tl.program_id(0)
    kb = tl.program_id(1)
    p = tl.load(pos_ptr + t).to(tl.int32)
    for j in tl.static_range(256 // HD):
        h = kb * (256 // HD) + j
        out = _combine_head(part_ptr, ml_ptr, t, h, p, window, H, NCH, HD, NCH_P2, CHUNK)
        tl.store(o_ptr + (t * H + h) * HD + tl.arange(0, HD), out)
    tl.debug_barrier()                   # this program's stores, seen by all its threads
    prep_block(o_ptr, t, kb, H * HD, xh4, xl4, sh, sl, xh6, xl6, inv, xq4, s4, xq6, s6, Q4, Q6, I4, I6, USE_ASM)


@triton.jit
def _attention_tiled(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, T, window, scale, H, GROUP, MAX_T,
                     HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(tile of BLOCK_M queries, head h): an online softmax over the blocks of keys that any of its queries
    sees, each query masked to its own keys lo..p. Keys are read only at positions that some query of the
    tile sees (written ones: a cache's unwritten slots are never touched)."""
    mb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T
    p = tl.load(pos_ptr + rows, mask=rmask, other=-1).to(tl.int32)          # -1: a padding row, no keys
    lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)
    lo_min = tl.min(tl.where(rmask, lo, MAX_T), axis=0)
    p_max = tl.max(p, axis=0)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (rows[:, None] * H + h) * HD + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HD), tl.float32)
    for j0 in range((lo_min // BLOCK_N) * BLOCK_N, p_max + 1, BLOCK_N):     # blocks at multiples of BLOCK_N
        j = j0 + tl.arange(0, BLOCK_N)
        seen = (j >= lo_min) & (j <= p_max)
        base = (kvh * MAX_T + j)[:, None] * HD + d[None, :]
        k = tl.load(k_ptr + base, mask=seen[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        live = (j[None, :] >= lo[:, None]) & (j[None, :] <= p[:, None])
        s = tl.where(live, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m_i - m_new))
        e = tl.where(live, tl.exp(s - m_new[:, None]), 0.0)
        v = tl.load(v_ptr + base, mask=seen[:, None], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(e, axis=1)
        acc = acc * alpha[:, None] + tl.dot(e, v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]                          # a padding row: 0, not 0 / 0
    tl.store(o_ptr + (rows[:, None] * H + h) * HD + d[None, :], out, mask=rmask[:, None])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int | torch.Tensor, window: int,
              scale: float, block_t: int = 64, prep=None) -> torch.Tensor:
    """q [T, H, hd]; pos: the queries' positions, int64 [T] on q's device (graph-safe: the caller checks them
    against the cache), or an int `start` for start..start+T-1 (checked here); k, v the layer's cache
    [Hk, max, hd] (keys up to each query's position written) -> [T, H * hd] float32. hd: a power of two.
    prep (jllm.cuda.ready.empty, up to QUERIES queries, hd <= 256): filled from the output as it is merged."""
    T, H, hd = q.shape
    hk, max_t, _ = k.shape
    if hd & (hd - 1) or H % hk:
        raise ValueError(f"head size {hd} must be a power of two and {H} heads a multiple of {hk}")
    if isinstance(pos, int):
        if pos + T > max_t:
            raise ValueError(f"positions up to {pos + T - 1} in a cache of {max_t}")
        pos = torch.arange(pos, pos + T, device=q.device)
    out = torch.empty(T, H, hd, dtype=torch.float32, device=q.device)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if prep is not None and (T > QUERIES or hd > 256 or H * hd % 256):
        raise ValueError(f"attention prepares x for the products over it for up to {QUERIES} queries of whole "
                         f"super-blocks of heads, not {T} of {H} x {hd}")
    if T > QUERIES and TILED and hd >= 16:   # a prefill's chunk: tiles of queries (tl.dot: 16 at least)
        _attention_tiled[(triton.cdiv(T, BLOCK_M), H)](q, k, v, out, pos, T, window, scale, H, H // hk, max_t,
                                                       HD=hd, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        return out.view(T, H * hd)
    if T > QUERIES:                      # the older way: all keys as one chunk, all queries in one launch
        chunk, nch, per = triton.next_power_of_2(max_t), 1, T
    else:
        chunk, nch, per = chunk_size(max_t), n_chunks(max_t), QUERIES
    part = torch.empty(min(per, T), H, nch, hd, dtype=torch.float32, device=q.device)
    ml = torch.empty(min(per, T), H, nch, 2, dtype=torch.float32, device=q.device)
    for s in range(0, T, per):           # the chunks' parts of QUERIES queries at a time bound the scratch
        n = min(per, T - s)
        _attention_chunk[(n, H, nch)](q[s:], k, v, part, ml, pos[s:], window, scale, H, H // hk, max_t, nch,
                                      HD=hd, CHUNK=chunk, BLOCK_T=min(block_t, chunk))
        combine = dict(HD=hd, NCH_P2=max(2, triton.next_power_of_2(nch)), CHUNK=chunk)
        if prep is None:
            _attention_combine[(n, H)](part, ml, out[s:], pos[s:], window, H, nch, **combine)
        else:                                # s is 0: one round of at most QUERIES queries
            ptrs, flags = pointers(prep, out)
            _attention_combine_prep[(n, H * hd // 256)](part, ml, out, pos, window, H, nch, *ptrs, **combine,
                                                         **flags)
    return out.view(T, H * hd)
