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
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch


class StepGraphs:
    """body(x [T, D], cache, pos [T] int64) -> logits [T, V], run as CUDA graphs for T <= max_rows."""

    def __init__(self, body: Callable, max_rows: int):
        self.body, self.max_rows = body, max_rows
        self.pool = torch.cuda.graph_pool_handle()           # the graphs' buffers, shared: they never overlap
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # cache -> {T: captured}

    def fits(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    def run(self, x: torch.Tensor, cache, start: int) -> torch.Tensor:
        """The logits of rows x at positions start..start+T-1 (cache.reserve checked them), a fresh tensor."""
        T = x.shape[0]
        per_cache = self._graphs.setdefault(cache, {})
        captured = per_cache.get(T)
        if captured is None:
            per_cache[T], out = self._capture(x, cache, start)
            return out
        graph, x_in, pos_in, out = captured
        x_in.copy_(x)
        torch.arange(start, start + T, out=pos_in)          # on the device: no copy from the host
        graph.replay()
        return out.clone()                        # the next replay overwrites `out`; callers may hold logits

    def _capture(self, x: torch.Tensor, cache, start: int):
        T = x.shape[0]
        x_in = x.detach().clone()
        pos_in = torch.arange(start, start + T, device=x.device)
        out = self.body(x_in, cache, pos_in)     # this call's result; compiles the kernels for the capture
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = self.body(x_in, cache, pos_in)       # recorded, not run: the cache is not written twice
        return (graph, x_in, pos_in, static_out), out

    def count(self) -> int:
        return sum(len(g) for g in self._graphs.values())
