"""Huge-page memory for weights and KV cache: correct tensors, and really on huge pages where Linux offers them."""

from pathlib import Path

import pytest
import torch

from jllm.model import hugepages
from jllm.model.hugepages import HUGE, HugePages
from jllm.model.kv_cache import KVCache

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_offered() -> bool:
    return _THP.exists() and "[never]" not in _THP.read_text()


def _anon_huge_kb() -> int:
    return hugepages.resident_huge_bytes() >> 10


def test_tensors_are_distinct_aligned_and_writable():
    pages = HugePages()
    sizes = [100, 4096, 5000, 3 << 20, 40 << 20, 1]
    ts = [pages.empty(n) for n in sizes]
    for t, n in zip(ts, sizes):
        assert t.numel() == n and t.dtype == torch.uint8
        assert t.data_ptr() % 4096 == 0
    for i, t in enumerate(ts):
        t.fill_(i + 1)
    for i, t in enumerate(ts):                       # no tensor overlaps another
        assert bool((t == i + 1).all())


def test_adopt_copies_dtype_shape_and_values():
    src = torch.randn(3, 1000)
    out = HugePages().adopt(src)
    assert out.dtype == src.dtype and out.shape == src.shape
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()


def test_region_outlives_the_allocator():
    t = HugePages().empty(1 << 20)
    t.fill_(7)
    import gc

    gc.collect()
    assert int(t.sum()) == 7 << 20


def test_kv_cache_is_zeroed():
    c = KVCache(2, 2, 8, 16)
    assert c.k.shape == (2, 2, 16, 8) and not c.k.any() and not c.v.any()
    c.k.fill_(1)
    assert not c.v.any()


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists() or not _thp_offered(),
                    reason="transparent huge pages not offered here")
def test_memory_is_backed_by_huge_pages():
    before = _anon_huge_kb()
    big = hugepages.zeros(((64 << 20) // 4,), torch.float32)       # 64 MiB
    assert _anon_huge_kb() - before < 4 << 10                    # not touched yet: not resident
    big.fill_(1.0)
    small = HugePages().empty(8 << 20)
    small.fill_(1)
    gained = _anon_huge_kb() - before
    assert gained >= (64 << 10) + (8 << 10) - 2 * (HUGE >> 10), f"only {gained} kB on huge pages"
    del big, small


def test_opt_out_gives_ordinary_memory(monkeypatch):
    monkeypatch.setenv("JLLM_NO_HUGEPAGES", "1")
    t = hugepages.zeros((1000,), torch.float32)
    assert not t.any() and t.shape == (1000,)
    assert HugePages().empty(5000).numel() == 5000
