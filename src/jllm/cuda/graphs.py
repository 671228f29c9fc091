"""CUDA graphs of a forward pass: a step of 1..max_rows rows replays as one launch instead of ~500 (issue 23).

A decode or verify step of the blocks precision is hundreds of small kernels (matvecs, norms, RoPE, the
cache writes, attention); launched one by one from Python the GPU idles between them and a step takes
milliseconds whatever the model's size. Captured once per (KV cache, row count) into a graph, a step is a copy
of its inputs into the graph's buffers and one replay.

What makes a pass capturable: its inputs are device tensors at fixed addresses (the embedded rows x and their
positions pos, int64), every position-dependent operation reads pos on the device (RoPE and the cache writes:
jllm.cuda.fused.rope_store; attention's key ranges: jllm.cuda.attention), and nothing in it synchronises
with the host. The graph bakes in the KV cache's addresses, so graphs are kept per cache object and dropped
with it (a weak reference), and the first call of each shape runs eagerly (compiling the kernels) before the
capture. A replay runs the same kernels on the same shapes as the eager pass, so its logits are bitwise the
eager ones, and a verify pass's rows stay those of single steps.

A prefill's chunks are graphs too (PrefillGraphs): launched eagerly a chunk of any length is ~950 launches,
~40 ms of the host's time on the H200 against ~17 ms of GPU time for 512 tokens (BENCHMARKS.md, "Session 24 on
the GPU"). A chunk is padded to the next of a few lengths (BUCKETS), so that a handful of graphs serve every
chunk, and only its last real row goes through the output layer. The padding rows sit after the real ones,
so causal attention keeps them out of the real rows; their keys and values land past the cache's length,
where the next tokens overwrite them. Their matrix products change the f16 GEMMs' row count, so a padded
chunk's values equal the unpadded chunk's to rounding, not bitwise (a prefill's chunking already does so).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch


class StepGraphs:
    """body(x [T, D], cache, pos [T] int64, capture) -> (logits [T, V], the captured layers' inputs [T, F] or
    None), run as CUDA graphs for T <= max_rows (one per row count and capture: an EAGLE-3 head's verify
    passes capture its target layers)."""

    def __init__(self, body: Callable, max_rows: int):
        self.body, self.max_rows = body, max_rows
        self.pool = torch.cuda.graph_pool_handle()           # the graphs' buffers, shared: they never overlap
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # cache -> {T: captured}

    def fits(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    def run(self, x: torch.Tensor, cache, start: int, capture: tuple[int, ...] | None = None):
        """(logits, hidden or None) of rows x at positions start..start+T-1 (cache.reserve checked them),
        fresh tensors."""
        T = x.shape[0]
        per_cache = self._graphs.setdefault(cache, {})
        captured = per_cache.get((T, capture))
        if captured is None:
            per_cache[(T, capture)], out = self._capture(x, cache, start, capture)
            return out
        graph, x_in, pos_in, out = captured
        x_in.copy_(x)
        torch.arange(start, start + T, out=pos_in)          # on the device: no copy from the host
        graph.replay()
        logits, hidden = out                      # the next replay overwrites them; callers may hold them
        return logits.clone(), None if hidden is None else hidden.clone()

    def _capture(self, x: torch.Tensor, cache, start: int, capture):
        T = x.shape[0]
        x_in = x.detach().clone()
        pos_in = torch.arange(start, start + T, device=x.device)
        out = self.body(x_in, cache, pos_in, capture)   # this call's result; compiles the kernels for the capture
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = self.body(x_in, cache, pos_in, capture)   # recorded, not run: the cache is written once
        return (graph, x_in, pos_in, static_out), out

    def count(self) -> int:
        return sum(len(g) for g in self._graphs.values())


BUCKETS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)    # a chunk's padded lengths: <= 1.5x its rows


def bucket(rows: int) -> int | None:
    """The padded length of a prefill chunk of `rows` rows, None past the largest bucket."""
    return next((b for b in BUCKETS if b >= rows), None)


class PrefillGraphs:
    """body(x [B, D], cache, pos [B] int64, last [1] int64, capture) -> (logits [1, V] of row `last`, the
    captured layers' inputs [B, F] or None), run as CUDA graphs of the padded lengths B in BUCKETS."""

    def __init__(self, body: Callable, positions: int):
        """positions: how far the model's position tables go (a padding row's position must be in them)."""
        self.body, self.positions = body, positions
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {(B, capture): captured}

    def run(self, x: torch.Tensor, cache, start: int, capture: tuple[int, ...] | None = None):
        """(logits [1, V] after the last row, hidden [T, F] or None) of rows x at start..start+T-1, fresh
        tensors; None where no bucket fits (too many rows, or the padding would pass the cache's end)."""
        T = x.shape[0]
        B = bucket(T)
        if B is None or start + B > min(cache.max_tokens, self.positions):
            return None
        per_cache = self._graphs.setdefault(cache, {})
        key = (B, capture)
        captured = per_cache.get(key)
        if captured is None:
            x_in = torch.empty(B, x.shape[1], dtype=x.dtype, device=x.device)
            pos_in = torch.empty(B, dtype=torch.int64, device=x.device)
            last_in = torch.empty(1, dtype=torch.int64, device=x.device)
        else:
            graph, x_in, pos_in, last_in, out = captured
        x_in[:T] = x
        x_in[T:] = x[-1]                  # any real row: the padding's values never reach the real rows
        torch.arange(start, start + B, out=pos_in)
        last_in.fill_(T - 1)
        if captured is None:
            out = self.body(x_in, cache, pos_in, last_in, capture)   # eager: compiles the kernels for the capture
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=self.pool):
                static = self.body(x_in, cache, pos_in, last_in, capture)
            per_cache[key] = (graph, x_in, pos_in, last_in, static)
        else:
            graph.replay()
        logits, hidden = out
        return logits.clone(), None if hidden is None else hidden[:T].clone()

    def count(self) -> int:
        return sum(len(g) for g in self._graphs.values())
