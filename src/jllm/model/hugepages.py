"""Memory on 2 MiB pages for what every decode step streams through: the packed weights and the KV cache.

Why: a decode step of the 1.5B reads ~1.2 GB of weights. On 4 KiB pages that is ~290,000 pages a token, a
TLB miss for each, and the hardware prefetchers stop at every page boundary. Linux backs anonymous memory
with transparent huge pages only where a region asks for them (the default mode, "madvise"), and glibc gives
each large allocation a private mapping that does not ask. So this module maps 2 MiB-aligned regions
itself and advises them MADV_HUGEPAGE: a step's matrices then stream faster, the draft's small ones most.

Cost: loading takes longer, since the kernel hands out and zeroes whole 2 MiB pages. Both are measured in
BENCHMARKS.md, "Huge pages" (benchmarks/hugepages_bench.py). Where huge pages are not offered (another OS, THP
set to "never"), or with JLLM_NO_HUGEPAGES=1 set, the same calls return ordinary memory.
"""

from __future__ import annotations

import mmap
import os

import torch

HUGE = 2 << 20
CHUNK = 64 << 20                  # small tensors share regions of this size; larger ones get their own
_ALIGN = 4096


def _region(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of nbytes starting on a 2 MiB boundary, its whole huge pages asked to be
    backed by huge pages; plain memory where that cannot be had. Pages are faulted in when first touched
    (anonymous memory comes zeroed), so an unused tail of a KV cache costs no RAM."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    private = getattr(mmap, "MAP_PRIVATE", None)
    if advice is None or private is None or os.environ.get("JLLM_NO_HUGEPAGES"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    size = -(-nbytes // HUGE) * HUGE
    try:
        mm = mmap.mmap(-1, size + HUGE, flags=private | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.zeros(nbytes, dtype=torch.uint8)
    whole = torch.frombuffer(mm, dtype=torch.uint8)          # the tensor keeps the mapping alive
    start = -whole.data_ptr() % HUGE
    try:
        mm.madvise(advice, start, size)
    except OSError:
        pass                                                  # THP disabled: ordinary pages, same memory
    return whole[start:start + nbytes]


class HugePages:
    """Hands out uint8 tensors from huge-page regions: tensors up to half a CHUNK share regions, larger ones
    get their own. Memory is returned to the OS when the last tensor of a region is gone."""

    def __init__(self):
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def empty(self, nbytes: int) -> torch.Tensor:
        if nbytes > CHUNK // 2:
            return _region(nbytes)
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk, self._used = _region(CHUNK), 0
        t = self._chunk[self._used:self._used + nbytes]
        self._used += -(-nbytes // _ALIGN) * _ALIGN
        return t

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of the contiguous CPU tensor t in huge-page memory (same dtype and shape)."""
        out = self.empty(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        out.copy_(t)
        return out


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor in a huge-page region of its own (a KV cache)."""
    n = 1
    for s in shape:
        n *= s
    return _region(n * torch.empty(0, dtype=dtype).element_size()).view(dtype).view(shape)


def resident_huge_bytes() -> int:
    """Bytes of this process's memory on transparent huge pages (0 where the kernel does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0
