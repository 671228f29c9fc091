"""Greedy speculative rounds with an EAGLE-3 head on the GPU, each round one CUDA graph, replayed back to back
without the host (issue 23).

Driven from the host (spec/loop.py), a round on the GPU waits on the host several times: each of the head's
draft steps reads its argmax back before the next, the verify pass's logits come back for the host's verdict,
and the head's catch-up waits for it. On the H200 a host turn costs ~0.1-0.3 ms against a 1.7 ms target step
(BENCHMARKS.md, "Session 26 on the GPU"), and replaying the head's corpus traces with 0.1 step of host time a
round takes 1.63x down to 1.50x ("Session 27, no GPU lent"). Here the whole round stays on the device, as
jllm.cuda.chain does for plain steps:

    d_1 = d2t[argmax(head logits)]; d_j = d2t[argmax(head.step(d_(j-1), state))]   j = 2 .. k (k - 1 steps)
    a   = argmax(target([b, d_1 .. d_k]) at positions pos .. pos + k, its rows' states captured)
    n   = the leading drafts equal to the target's own tokens (d_i == a_(i-1))
    head over the verified rows: row i pairs the target's state at pos + i with a_i, positions pos .. pos + k;
         its row n gives the next round's head logits and state (rows past n are scratch: they sit past the
         accepted context, where the next round's writes land first)
    log  [n + 1, a_0 .. a_k];  b = a_n;  pos += n + 1

The accepted tokens a_0 .. a_n are the target's argmaxes over rows that are bitwise single steps (the verify
pass is the step graphs' body: jllm.cuda.graphs), so they are plain greedy decoding's tokens whatever the head
drafts. The head's rows 0 .. n are bitwise what its host-driven catch-up computes (its rows are each their
own). Rounds have static shapes: k drafts every round, verified whatever their confidence (on the GPU's
tensor-core kernels a pass of up to 16 rows costs about one; jllm.cuda.mma). The host reads a run's log while
the next run computes, and hands the tokens on; a stop (end of turn, stop string, budget) leaves up to two runs
computed past it, which the caller drops by rolling the caches back.

Without CUDA (Triton's interpreter in the tests) the same round runs eagerly, one at a time.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.profiler import record_function

from jllm.errors import JllmError

RUN = 4                     # rounds a run: the host reads a run's log while the next run computes
DRAFTS = 3                  # drafts a round by default: the best of k = 2..5 with the shipped head on the H200
                            # (BENCHMARKS.md, "Session 28 on the GPU": 1.38 / 1.40 / 1.37 / 1.32x)


def round_drafts() -> int:
    """Drafts a round from JLLM_CUDA_ROUNDS (default DRAFTS; 0: rounds off, the host drives speculation)."""
    v = os.environ.get("JLLM_CUDA_ROUNDS", str(DRAFTS))
    try:
        k = int(v)
    except ValueError:
        raise JllmError(f"JLLM_CUDA_ROUNDS={v!r}: a number of drafts a round (0: off)") from None
    if not 0 <= k <= 15:
        raise JllmError(f"JLLM_CUDA_ROUNDS={k}: 0 (off) to 15 drafts a round (a verify pass of up to 16 rows)")
    return k


@dataclass
class _Buffers:
    """A round's inputs and outputs at fixed addresses (a graph's), for one pair of caches."""
    state: torch.Tensor         # int64 [2]: b (the newest token, not yet in the target's cache), its position
    logits: torch.Tensor        # [Vd] the head's prediction of the token after b
    hidden: torch.Tensor        # [D] the head's output state that made it
    log: torch.Tensor           # int64 [2 RUN, k + 2]: a round's n + 1, then a_0 .. a_k
    at: torch.Tensor            # int64 [1]: the log's next slot
    host: torch.Tensor          # the log's copy on the host (pinned on a GPU)
    graph: object = None


class HeadRounds:
    """Greedy speculative rounds of k drafts for a target (jllm.model.transformer.Transformer, blocks precision)
    and its EAGLE-3 head (jllm.eagle3.head.Eagle3Head, blocks precision), on the target's device.
    graphs: replay each round as one CUDA graph (False: run it eagerly, as without CUDA)."""

    def __init__(self, model, head, k: int, graphs: bool | None = None):
        if k < 1:
            raise ValueError("a round drafts at least one token")
        self.model, self.head, self.k = model, head, k
        self.graphs = model.device.type == "cuda" if graphs is None else graphs
        if self.graphs:
            from jllm.cuda.embedding import DeviceEmbedding

            # a graph cannot wait for the host: the drafts' embedding rows must come from the device
            if not isinstance(model.w.embed, DeviceEmbedding) or head.embed is not model.w.embed:
                raise ValueError("rounds as CUDA graphs need the target's embedding on the device (a Q4_K table)")
            if model.graphs is None or k + 1 > model.graphs.max_rows:
                raise ValueError(f"a round's verify pass of {k + 1} rows is past the step graphs' row-exact kernels")
        self.launched = 0           # rounds launched, for the tests and the bench
        self.pool = model.graphs.pool if self.graphs and model.graphs is not None else None
        self.rows = torch.arange(k + 1, device=model.device)
        d2t = head._d2t_here
        self.d2t = None if d2t is None else d2t.to(model.device, torch.int64)
        # a drafted id feeds the target's embedding unchecked: format.check_target keeps d2t's ids inside the
        # target's vocabulary, and Transformer.chain (which Engine requires) its output rows inside the table
        self.positions = min(model.rope_global[0].shape[0], head.cos.shape[0])
        self._buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # target cache -> {head cache: _}

    # ------------------------------------------------------------------------------------ the round (device)

    def _draft_id(self, logits: torch.Tensor) -> torch.Tensor:
        """[Vd] -> the target id of its argmax, int64 [1] on the device."""
        i = torch.argmax(logits).view(1)
        return i if self.d2t is None else self.d2t.index_select(0, i)

    @torch.inference_mode()
    def _round(self, b: _Buffers, cache, features: torch.Tensor, capture: tuple[int, ...]) -> None:
        """One round on the buffers (nothing in it reads the host: a CUDA graph's body)."""
        head, k = self.head, self.k
        pos = b.state[1:2]
        with record_function("round: head drafts"):          # (labels for benchmarks/cuda_round_profile.py)
            drafts = [self._draft_id(b.logits)]
            state = b.hidden.view(1, -1)
            for j in range(1, k):               # head step j: the draft d_j at head position pos + j - 1
                x = torch.cat([head.embed(drafts[-1]).float(), state], dim=1)
                logits, state = head._blocks_body(x, head.cache, pos + (j - 1))
                drafts.append(self._draft_id(logits[0]))
        with record_function("round: verify"):
            block = torch.cat([b.state[0:1]] + drafts)                   # [k + 1]: b, d_1 .. d_k
            rows = pos + self.rows
            logits, hidden = self.model._blocks_body(self.model.embed(block), cache, rows, capture)
        with record_function("round: bookkeeping"):
            features.index_copy_(0, rows, hidden.to(features.dtype))
            a = torch.argmax(logits, dim=1)                              # the target's tokens, [k + 1]
            n = torch.cumprod((block[1:] == a[:k]).to(torch.int64), 0).sum().view(1)
            b.log.index_copy_(0, b.at, torch.cat([n + 1, a]).view(1, -1))
            b.at.add_(1).remainder_(b.log.shape[0])
        with record_function("round: head rows"):
            x = torch.cat([head.embed(a).float(), head.fuse(features.index_select(0, rows))], dim=1)
            logits, out = head._blocks_body(x, head.cache, rows)
            b.logits.copy_(logits.index_select(0, n)[0])
            b.hidden.copy_(out.index_select(0, n)[0])
            b.state[0:1].copy_(a.index_select(0, n))
            b.state[1:2].add_(n + 1)

    def _prepared(self, cache, features, capture) -> _Buffers:
        per_cache = self._buffers.setdefault(cache, weakref.WeakKeyDictionary())
        got = per_cache.get(self.head.cache)
        if got is not None:
            return got
        dev, head = self.model.device, self.head
        log = torch.zeros(2 * RUN, self.k + 2, dtype=torch.int64, device=dev)
        got = _Buffers(torch.zeros(2, dtype=torch.int64, device=dev),
                       torch.zeros(head.cfg.draft_vocab, device=dev), torch.zeros(head.cfg.hidden, device=dev), log,
                       torch.zeros(1, dtype=torch.int64, device=dev),
                       torch.empty_like(log, device="cpu", pin_memory=dev.type == "cuda"))
        per_cache[head.cache] = got
        return got

    def _capture(self, b: _Buffers, start: dict, cache, features, capture) -> None:
        """The round's graph: one eager round (compiles the kernels; its writes are the first replay's), the
        capture (recorded, not run), then the buffers back to the round's start."""
        self._start(b, **start)
        self._round(b, cache, features, capture)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.pool):
            self._round(b, cache, features, capture)
        b.graph = graph
        self._start(b, **start)

    @staticmethod
    def _start(b: _Buffers, token: int, position: int, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        b.state.copy_(torch.tensor([token, position], dtype=torch.int64))
        b.logits.copy_(logits.reshape(-1))
        b.hidden.copy_(hidden.reshape(-1))
        b.at.zero_()

    # ------------------------------------------------------------------------------------------ the host

    def tokens(self, seq, token: int, first, limit: int, stats=None) -> Iterator[int]:
        """Greedy tokens after `token` (the target's Sequence `seq` holds the context before it, at position
        len(seq); `first`: the head's Step over that context and `token`, HeadProposer.catch_up's), at most
        `limit`; fewer where the caches have no room left for a round (their last k + 1 positions), after
        which the caller goes on with plain steps. The caches' lengths are set to cover what the launched
        rounds may write; the caller keeps the tokens it hands on and rolls back the rest
        (Sequence.device_tokens). `valid` is then how far the head's cache holds rows of the rounds read:
        positions 0 .. valid - 1 (row P pairs the target's state at P with the token at P + 1).
        stats (jllm.spec.stats.SpecStats): each round read is recorded there."""
        start = len(seq.ids)
        self.valid = start              # catch_up left the head covering positions 0 .. start - 1
        if limit <= 0:
            return
        head, k = self.head, self.k
        cache, features, capture = seq.cache, seq.features, seq.capture
        room = min(cache.max_tokens, head.cache.max_tokens, self.positions)
        b = self._prepared(cache, features, capture)
        at_start = dict(token=token, position=start, logits=first.logits, hidden=first.state)
        if self.graphs and b.graph is None:
            if start + k + 1 > room:
                return
            cache.length = max(cache.length, start + k + 1)
            head.cache.length = max(head.cache.length, start + k + 1)
            self._capture(b, at_start, cache, features, capture)
        else:
            self._start(b, **at_start)
        launched, taken = 0, 0          # rounds launched; tokens handed on
        confirmed = start               # position of the newest token of the rounds read so far
        pending: list[tuple[int, int, object]] = []       # runs in flight: (first slot, rounds, event)

        def launch() -> bool:
            nonlocal launched
            ahead = sum(r for _, r, _ in pending)
            n = 0
            # a round fits where even all-accepted rounds before it leave its k + 1 rows inside the caches;
            # no more rounds than tokens still wanted (each round gives at least one)
            while n < RUN and confirmed + (ahead + n) * (k + 1) + k < room and ahead + n < limit - taken:
                n += 1
            if n == 0:
                return False
            top = confirmed + (ahead + n) * (k + 1)
            cache.length = max(cache.length, top)
            head.cache.length = max(head.cache.length, top)
            slot = launched % (2 * RUN)
            for _ in range(n):
                if b.graph is not None:
                    b.graph.replay()
                else:
                    self._round(b, cache, features, capture)
            launched += n
            self.launched += n
            ev = None
            for lo, hi in _segments(slot, n, 2 * RUN):      # the log is a ring: a run may wrap around it
                b.host[lo:hi].copy_(b.log[lo:hi], non_blocking=b.graph is not None)
            if b.graph is not None:
                ev = torch.cuda.Event(blocking=True)          # its wait sleeps rather than spins a core
                ev.record()
            pending.append((slot, n, ev))
            return True

        launch()
        while pending and taken < limit:
            launch()                    # the next run computes while this one's tokens are handed on
            slot, n, ev = pending.pop(0)
            if ev is not None:
                ev.synchronize()
            for lo, hi in _segments(slot, n, 2 * RUN):
                for rec in b.host[lo:hi].tolist():
                    got = rec[0]                    # n + 1: the accepted drafts and the target's own token
                    if stats is not None:
                        stats.record("head", k, got - 1)
                    confirmed += got
                    self.valid = confirmed          # its rows up to pos + n, paired with the tokens up to the new b
                    for t in rec[1:1 + got]:
                        taken += 1
                        yield t
                        if taken >= limit:
                            return

    def count(self) -> int:
        return sum(1 for per in self._buffers.values() for b in per.values() if b.graph is not None)


def _segments(first: int, n: int, size: int) -> list[tuple[int, int]]:
    """Slots first .. first + n - 1 of a ring of `size` as at most two [lo, hi) ranges."""
    end = first + n
    return [(first, end)] if end <= size else [(first, size), (0, end - size)]
