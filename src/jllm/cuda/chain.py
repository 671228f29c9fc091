"""Greedy decoding on the GPU as back-to-back CUDA graph replays, the next token never leaving the device
(issue 23).

A decode step from the host is: look the token's row up, copy it and the position into the step graph's
inputs, replay, copy the logits out, take their argmax and read it back, which the next step waits for. On the
H200 that host work is ~0.3 ms against ~1.67 ms of graph (BENCHMARKS.md, "Session 26 on the GPU"), and the GPU
idles through it. Here one graph holds the whole step: the embedding lookup from a token id on the device, the
layers, the argmax, and the updates of its own inputs (the argmax becomes the next step's token, the position
advances) and of a log of the tokens it made. So steps are replayed back to back without the host, in runs of
CHAIN, and while the GPU works through one run the host reads the run before it (copied out behind an event)
and hands those tokens on. A stop (end of turn, stop string, budget) then leaves up to two runs evaluated
past it, which the caller drops by rolling its cache back: a length moves, as everywhere else.

The graph runs the same kernels on the same shapes as a step graph (jllm.cuda.graphs.StepGraphs) of one row
from the same body, so its logits, its argmax and its cache writes are bitwise those of plain steps: the
tokens are greedy decoding's own (tests/test_cuda.py).
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterator

import torch

CHAIN = 8                   # steps a run: the host reads a run's tokens while the next run computes


class GreedyChain:
    """body(state, cache, capture) -> (logits [1, V], the captured layers' inputs [1, F] or None): one decode step
    of the token state[0] at position state[1] (int64 [2] on the device), writing its key and value there.
    With capture (an EAGLE-3 head's target layers) each step also writes its row of `features` (the Sequence's)
    at its position, as Sequence.forward does."""

    def __init__(self, body: Callable, pool=None):
        self.body, self.pool = body, pool
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # cache -> captured

    def _step(self, state: torch.Tensor, log: torch.Tensor, at: torch.Tensor, cache, capture, features) -> None:
        logits, hidden = self.body(state, cache, capture)
        if hidden is not None:
            features.index_copy_(0, state[1:2], hidden.to(features.dtype))
        nxt = torch.argmax(logits[0]).view(1)                     # first index on ties, as jllm.sampling
        log.index_copy_(0, at, nxt)
        state[0:1].copy_(nxt)
        state[1:2].add_(1)
        at.add_(1).remainder_(log.shape[0])

    def _captured(self, cache, state0: torch.Tensor, capture, features):
        per_cache = self._graphs.setdefault(cache, {})
        got = per_cache.get(capture)
        if got is not None:
            return got
        dev = state0.device
        state, at = state0.clone(), torch.zeros(1, dtype=torch.int64, device=dev)
        log = torch.zeros(2 * CHAIN, dtype=torch.int64, device=dev)
        self._step(state, log, at, cache, capture, features)   # eager: compiles the kernels (its writes are the
                                                                # replay's)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.pool):
            self._step(state, log, at, cache, capture, features)
        per_cache[capture] = got = (graph, state, log, at, torch.empty(2 * CHAIN, dtype=torch.int64, pin_memory=True))
        return got

    def tokens(self, token: int, cache, start: int, limit: int, capture: tuple[int, ...] | None = None,
               features: torch.Tensor | None = None) -> Iterator[int]:
        """Greedy tokens after `token` at position start (the cache holds start positions): the token after
        `token`, then the one after that, ... at most `limit`. The cache's length follows what has been computed,
        which runs ahead of what was yielded by up to two runs: the caller rolls it back to what it keeps.
        capture, features: the Sequence's (each step's captured row lands in features at its position)."""
        if limit <= 0:
            return
        cache.reserve(1)                      # the capture's eager step writes position start
        state0 = torch.tensor([token, start], dtype=torch.int64).to(cache.k.device)
        graph, state, log, at, host = self._captured(cache, state0, capture, features)
        state.copy_(state0)
        at.zero_()
        done = 0                              # steps launched

        def launch() -> tuple[int, int, torch.cuda.Event] | None:
            """The next run: (its first log slot, its steps, the event after its tokens' copy), or None."""
            nonlocal done
            n = min(CHAIN, limit - done)
            if n <= 0:
                return None
            cache.reserve(n)                  # raises past the cache's end, before anything is written there
            first = done % (2 * CHAIN)
            for _ in range(n):
                graph.replay()
            done += n
            cache.length = start + done
            host[first:first + n].copy_(log[first:first + n], non_blocking=True)
            ev = torch.cuda.Event(blocking=True)      # its wait sleeps rather than spins a core
            ev.record()
            return first, n, ev

        run = launch()
        while run is not None:
            ahead = launch()                  # the next run computes while this one's tokens are handed on
            first, n, ev = run
            ev.synchronize()
            yield from host[first:first + n].tolist()
            run = ahead

    def count(self) -> int:
        return sum(len(g) for g in self._graphs.values())
