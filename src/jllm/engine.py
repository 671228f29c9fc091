"""The engine: one model, its tokenizer and chat template, its Sequence (KV cache and the ids it holds), and
the decode loop.

A new prompt reuses the longest prefix the Sequence already holds and evaluates only the rest, so multi-turn
chat in one process never re-reads its history; the persistent KV store extends that across processes.
Speculative decoding (jllm.spec.loop) is another token source for the same loop.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import torch

from jllm.cache.shared import RedisTier, check_url
from jllm.cache.store import KVState, KVStore, dtype_name, model_fingerprint
from jllm.cache.tiered import TieredStore
from jllm.eagle3.format import is_head
from jllm.eagle3.head import Eagle3Head
from jllm.errors import JllmError
from jllm.gguf.reader import read_gguf
from jllm.model.loader import default_precision, load_model, resolve_device
from jllm.plan import check_limit, physical_memory, plan
from jllm.sampling import SamplingParams, argmax, make_generator, sample
from jllm.sequence import Sequence, common_prefix
from jllm.spec.compat import check_draft
from jllm.spec.config import SpecConfig, draft_precision_for
from jllm.spec.loop import SpeculativeDecoder
from jllm.spec.policy import DraftGate, RoundGate
from jllm.spec.proposers import DraftModelProposer, HeadProposer
from jllm.spec.stats import SpecStats
from jllm.stops import StopMatcher
from jllm.tokenizer.chat import ChatTemplate
from jllm.tokenizer.stream import StreamDecoder
from jllm.tokenizer.tokenizer import Tokenizer


@dataclass
class Timings:
    load_ms: float = 0.0
    prompt_eval_ms: float = 0.0
    prompt_tokens_evaluated: int = 0
    cached_tokens: int = 0
    hydrate_ms: float = 0.0
    decode_ms: float = 0.0
    decode_tokens: int = 0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["prompt_tok_s"] = _rate(self.prompt_tokens_evaluated, self.prompt_eval_ms)
        d["decode_tok_s"] = _rate(self.decode_tokens, self.decode_ms)
        return d


def _rate(n: int, ms: float) -> float:
    return round(n / (ms / 1000.0), 2) if ms > 0 else 0.0


@dataclass
class Result:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str            # "stop" (EOS / end of turn / stop string) or "length"
    timings: Timings = field(default_factory=Timings)
    spec_stats: SpecStats | None = None    # what speculation did (None: plain decoding)


@dataclass
class Piece:
    """One step of a stream: the new token and the text it completes (may be empty)."""
    token_id: int
    text: str


class Generation:
    """One generation: iterate it for its Pieces; afterwards it holds the finish reason ("stop" or "length"),
    the speculation statistics (None for plain decoding) and the timings."""

    def __init__(self, timings: Timings):
        self.timings = timings
        self.finish_reason = "length"
        self.spec_stats: SpecStats | None = None
        self._pieces: Iterator[Piece] = iter(())

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> Piece:
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()


def set_threads(threads: int | None) -> None:
    n = threads or os.cpu_count() or 1
    torch.set_num_threads(max(1, n))


class Engine:
    def __init__(self, model_path: str, device: str | None = "cpu", precision: str | None = None,
                 ctx_size: int = 4096, threads: int | None = None, kv_store_dir: str | None = None,
                 kv_store_bytes: int = 1 << 30, draft_path: str | None = None, spec=None,
                 kv_store_url: str | None = None, kv_store_shared_bytes: int = 4 << 30):
        """spec: a SpecConfig, or None for plain decoding (its mode 'none' too). kv_store_url: a Redis that
        several replicas share (cache/shared.py), behind the local store in kv_store_dir."""
        if kv_store_url is not None:
            if kv_store_dir is None:
                raise JllmError("a shared KV store (--kv-store) needs the persistent KV cache; drop --no-kv-cache")
            check_url(kv_store_url)                 # a bad URL fails before the models load
        if ctx_size <= 0:
            raise JllmError(f"context size must be positive, got {ctx_size}")
        t0 = time.perf_counter()
        set_threads(threads)
        self.device = resolve_device(device)
        self.gguf = read_gguf(model_path)
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        self.chat_template = ChatTemplate.from_metadata(self.gguf.metadata, self.tokenizer)
        self.precision = precision or default_precision(self.device)
        if spec is not None and spec.mode != "none" and self.precision == "blocks":
            from jllm.cuda.linear import MATVEC_ROWS

            if spec.draft_max + 1 > MATVEC_ROWS:         # a longer verify pass takes the prefill's kernels: inexact
                raise JllmError(f"--draft-max is at most {MATVEC_ROWS - 1} with precision blocks "
                                f"(got {spec.draft_max})")
        draft_gguf = self._check_draft(draft_path) if draft_path is not None else None   # fail before loading
        head_gguf = draft_gguf if draft_gguf is not None and is_head(draft_gguf) else None
        if head_gguf is not None:
            draft_gguf = None
        if self.device.type == "cpu":
            self._check_memory(draft_gguf or head_gguf, spec, ctx_size)
        self.ctx_size = ctx_size
        self.draft: Sequence | None = None          # the draft model's sequence
        self.head: Eagle3Head | None = None         # or an EAGLE-3 head on the target's hidden states
        self.draft_proposer = None                  # the proposer over either
        # the draft loads beside the target: a load is mostly file reads and page faults, which two cores
        # overlap (a second start of the default pair: ~1 s less)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="jllm-draft-load") as pool:
            draft_loading = pool.submit(self._load_draft, draft_gguf, spec) if draft_gguf is not None else None
            self.model = load_model(self.gguf, self.device, self.precision, max_positions=ctx_size)
            if draft_loading is not None:
                draft_loading.result()
        if head_gguf is not None:                   # the head shares the target's embedding (and output)
            self.head = Eagle3Head.load(head_gguf, self.model, checked=True, max_tokens=ctx_size)
        self.target = Sequence(self.model, ctx_size, capture=self.head.target_layers if self.head else None)
        if self.head is not None:
            self.draft_proposer = HeadProposer(self.head, self.target)
        self.spec = spec if spec is not None and spec.mode != "none" else None
        self.gate: DraftGate | None = None     # the draft gate, kept across generations (a chat's turns)
        self.rounds = self._head_rounds()      # greedy speculation with the head in rounds on the GPU, or None
        # rounds or chained steps, kept across generations (a chat's turns); JLLM_CUDA_ROUND_GATE=0: rounds always
        self.round_gate = RoundGate(fixed=None if os.environ.get("JLLM_CUDA_ROUND_GATE", "1") != "0" else "rounds")
        self.kv_store = None
        if kv_store_dir is not None:
            # CPU and CUDA compute slightly different KV, and an f32 cache's state is not an f16 one's
            tag = f"{self.precision}@{self.device.type}/kv-{dtype_name(self.cache.k.dtype)}"
            draft_fp = None
            if self.draft is not None:
                dm = self.draft.model
                draft_fp = model_fingerprint(dm.gguf, f"{self.draft_precision}@{self.device.type}"
                                                      f"/vocab{dm.w.output.out_features}"
                                                      f"/kv-{dtype_name(self.draft.cache.k.dtype)}")
            elif self.head is not None:             # the head's state is kept in the draft's slot
                draft_fp = model_fingerprint(self.head.gguf, f"eagle3/{self.head.precision}@{self.device.type}"
                                                             f"/kv-{dtype_name(self.head.cache.k.dtype)}")
            target_fp = model_fingerprint(self.gguf, tag)
            models = f"{self.gguf.path.name} ({tag})"
            if self.draft is not None:
                models += f" + {self.draft.model.gguf.path.name} ({self.draft_precision}@{self.device.type})"
            elif self.head is not None:
                models += f" + {self.head.gguf.path.name} ({self.head.precision}@{self.device.type})"
            self.kv_store = KVStore(kv_store_dir, max_bytes=kv_store_bytes, target_fingerprint=target_fp,
                                    draft_fingerprint=draft_fp, models=models)
            if kv_store_url is not None:
                self.kv_store = TieredStore(self.kv_store, RedisTier(kv_store_url, max_bytes=kv_store_shared_bytes,
                                                                     target_fingerprint=target_fp,
                                                                     draft_fingerprint=draft_fp, models=models))
        self._saving: threading.Thread | None = None
        self.load_ms = (time.perf_counter() - t0) * 1000

    def _head_rounds(self):
        """jllm.cuda.rounds for the head on a GPU (k drafts a round, JLLM_CUDA_ROUNDS; 0 turns them off). On the
        H200 the host-driven loop gave 0.58-0.99x of plain decoding, rounds 1.40x (BENCHMARKS.md, session 28),
        and their gate falls back to chained plain steps where rounds lose."""
        if self.head is None or self.spec is None or not self.spec.proposers(True)[1]:
            return None
        from jllm.cuda.rounds import HeadRounds, round_drafts

        # the rounds look the drafts up in the target's embedding on the device (the chain's), and verify
        # k + 1 rows with the step graphs' row-exact kernels
        if not self.target.chains() or not self.head.blocks or self.head.embed is not self.model.w.embed:
            return None
        k = round_drafts()
        if not k:
            return None
        from jllm.cuda.linear import MATVEC_ROWS

        if k + 1 > MATVEC_ROWS:
            raise JllmError(f"JLLM_CUDA_ROUNDS is at most {MATVEC_ROWS - 1} drafts a round (got {k})")
        return HeadRounds(self.model, self.head, k)

    @property
    def cache(self):
        """The target's KV cache."""
        return self.target.cache

    def reset(self) -> None:
        """Forget what this process holds in memory: the caches' contents and the draft gate's estimates
        (the persistent store is untouched). The next prompt is evaluated from scratch."""
        self.wait_saves()
        self.target.reset()
        if self.draft_proposer is not None:
            self.draft_proposer.reset()
        self.gate = None

    def _check_draft(self, draft_path: str):
        """Read the draft's header and check it against the target, before any weights load: a draft model's
        tokenizer, or everything an EAGLE-3 head depends on (format.check_target)."""
        dg = read_gguf(draft_path)
        check_draft(self.gguf, dg)
        return dg

    def _check_memory(self, draft_gguf, spec, ctx_size: int) -> None:
        """Refuse, before allocating, a configuration that needs more than this machine's RAM (a context of
        millions of tokens would otherwise end in the OOM killer, or in a traceback for an impossible size)."""
        spec = spec or SpecConfig()
        rows = plan(self.gguf, draft_gguf, ctx_size, self.precision, spec.draft_precision, spec.draft_vocab or None,
                    checked=True)
        check_limit(rows, physical_memory(), "this machine's memory")

    def _load_draft(self, dg, spec) -> None:
        spec = spec or SpecConfig()
        self.draft_precision = draft_precision_for(self.precision, spec.draft_precision)
        draft_model = load_model(dg, self.device, self.draft_precision, max_positions=self.ctx_size,
                                 output_rows=spec.draft_vocab or None)
        self.draft = Sequence(draft_model, self.ctx_size)
        self.draft_proposer = DraftModelProposer(self.draft)

    # -- prompts ----------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.chat_template.render(messages, add_generation_prompt=True)
        # the tokenizer adds BOS where the model wants one; the template drops its own copy (chat.py)
        return self.tokenizer.encode(text, parse_special=True)

    # -- evaluation -------------------------------------------------------------------------------------------

    def prefill(self, ids: list[int], conv_id: str | None = None,
                timings: Timings | None = None) -> tuple[torch.Tensor, int]:
        """Make the cache hold exactly `ids`, reusing the longest cached prefix: in memory, or from the
        persistent store (by conversation id, else the longest prefix among stored entries).

        Returns the logits after the last token [vocab] and the number of tokens evaluated.
        """
        if not ids:
            raise JllmError("empty prompt")
        if len(ids) >= self.ctx_size:
            raise JllmError(f"prompt of {len(ids)} tokens does not fit the context size {self.ctx_size} "
                            "(raise -c/--ctx-size or shorten the prompt)")
        if self.kv_store is not None:
            self._hydrate(ids, conv_id, timings)
        logits = self.target.sync(ids)
        return logits, self.target.evaluated

    def _hydrate(self, ids: list[int], conv_id: str | None, timings: Timings | None) -> None:
        """Load the best stored state if it covers more of `ids` than the target already holds (at most
        all but the last token, which must be evaluated for its logits)."""
        t0 = time.perf_counter()
        self.wait_saves()
        held = min(common_prefix(self.target.ids, ids), len(ids) - 1)
        name, n = self.kv_store.lookup(ids, conv_id)
        n = min(n, len(ids) - 1)
        if name is not None and n > held:
            state = self.kv_store.load(name, n)
            # another process may have replaced the entry since lookup: use it only if it still matches
            if state is not None and list(state.tokens[:n]) == ids[:n]:
                prop = self.draft_proposer
                if prop is not None and state.draft_k is not None and n > prop.lag:
                    # a head's positions are one behind the tokens (HeadProposer), so the target takes one
                    # token fewer and computes the hidden state the head's next row needs
                    n -= prop.lag
                    prop.load(ids[:n + prop.lag], state.draft_k[:, :, :n], state.draft_v[:, :, :n])
                self.target.load(ids[:n], state.target_k[:, :, :n], state.target_v[:, :, :n])
        if timings is not None:
            timings.hydrate_ms = (time.perf_counter() - t0) * 1000

    def save_state(self, conv_id: str | None) -> None:
        """Store the cache's state for the next turn, on a background thread (see wait_saves)."""
        if self.kv_store is None or not self.target.ids:
            return
        self.wait_saves()
        tokens, k, v = self.target.export()
        state = KVState(tokens=tokens, target_k=k, target_v=v)
        drafted = self.draft_proposer.export(tokens) if self.draft_proposer is not None else None
        if drafted is not None:                     # the draft's (or head's) state for the same tokens
            state.draft_k, state.draft_v = drafted

        def save():
            try:
                self.kv_store.save(conv_id, state)
            except (OSError, JllmError) as e:         # a full disk must not lose the reply
                print(f"jllm: could not save the KV cache: {e}", file=sys.stderr)

        self._saving = threading.Thread(target=save, name="jllm-kv-save")
        self._saving.start()

    def wait_saves(self) -> None:
        if self._saving is not None:
            self._saving.join()
            self._saving = None

    def step(self, token: int) -> torch.Tensor:
        return self.target.step(token)

    # -- generation -------------------------------------------------------------------------------------------

    def stream(self, prompt_ids: list[int], params: SamplingParams, timings: Timings | None = None,
               token_source: Callable | None = None, conv_id: str | None = None,
               save: bool = True) -> Generation:
        """A Generation of tokens with their text; it stops on end-of-turn tokens, stop strings or max_tokens.
        token_source(logits, params, budget) -> iterator of ids replaces the engine's own (plain or
        speculative). With a persistent store, the state is saved afterwards under conv_id (or an anonymous
        name)."""
        run = Generation(timings if timings is not None else Timings())
        run._pieces = self._generate(run, prompt_ids, params, token_source, conv_id, save)
        return run

    def _generate(self, run: Generation, prompt_ids: list[int], params: SamplingParams,
                  token_source: Callable | None, conv_id: str | None, save: bool) -> Iterator[Piece]:
        timings = run.timings
        t0 = time.perf_counter()
        logits, evaluated = self.prefill(prompt_ids, conv_id, timings)
        if self.spec is not None and self.draft_proposer is not None:
            self.draft_proposer.prepare(prompt_ids)   # its prompt prefill belongs to prompt time, not decode
        timings.prompt_eval_ms = (time.perf_counter() - t0) * 1000 - timings.hydrate_ms
        timings.prompt_tokens_evaluated = evaluated
        timings.cached_tokens = len(prompt_ids) - evaluated
        budget = min(params.max_tokens, self.ctx_size - len(prompt_ids))
        if token_source is None and self.spec is not None and self.rounds is not None and params.argmax_only:
            run.spec_stats = SpecStats()
            token_source = partial(self._round_tokens, stats=run.spec_stats)
        if token_source is None and self.spec is not None:
            if self.gate is None:
                self.gate = DraftGate()
            decoder = SpeculativeDecoder(self.target, self.draft_proposer, self.spec, self.tokenizer.eot_ids,
                                         self.gate)
            token_source = decoder.tokens
            run.spec_stats = decoder.stats
        source = (token_source or self._plain_tokens)(logits, params, budget)
        yield from self._emit(source, run, params)
        if save:
            self.save_state(conv_id)

    def _plain_tokens(self, logits: torch.Tensor, params: SamplingParams, budget: int) -> Iterator[int]:
        if params.argmax_only and self.target.chains():
            yield from self._chained_tokens(logits, budget)
            return
        gen = make_generator(params.seed)
        history = list(self.target.ids)
        for n in range(budget):
            tok = sample(logits, params, history, gen)
            history.append(tok)
            yield tok
            if n + 1 < budget and tok not in self.tokenizer.eot_ids:
                logits = self.step(tok)

    def _chained_tokens(self, logits: torch.Tensor, budget: int) -> Iterator[int]:
        """Greedy decoding as _plain_tokens does it, its steps chained on the GPU (jllm.cuda.chain): the same
        tokens, and at the end the same held context (closing the chain drops its steps past the held tokens)."""
        yielded, chain = 0, None
        tok = argmax(logits)[0]
        try:
            while budget:
                yield tok
                yielded += 1
                if yielded >= budget or tok in self.tokenizer.eot_ids:
                    return
                if chain is None:
                    chain = self.target.chain_tokens(tok, budget - yielded)
                tok = next(chain)
        finally:
            if chain is not None:
                chain.close()

    def _round_tokens(self, logits: torch.Tensor, params: SamplingParams, budget: int,
                      stats: SpecStats | None = None) -> Iterator[int]:
        """Greedy decoding on the device in stretches, each either speculative rounds with the EAGLE-3 head
        (jllm.cuda.rounds) or plain steps chained there (jllm.cuda.chain), as the round gate judges by their
        times (spec.policy.RoundGate): plain greedy decoding's tokens either way, and at the end the same held
        context; the head's cache keeps the rows of the rounds read. Where the context has no room left for a
        round (its last k + 1 positions) or the head has no states for it, a plain step."""
        seq, prop, eot, gate = self.target, self.draft_proposer, self.tokenizer.eot_ids, self.round_gate
        tok = argmax(logits)[0]
        yield tok
        yielded = 1
        while yielded < budget and tok not in eot:
            mode, n = gate.next()
            n = min(n, budget - yielded)
            run = None
            if mode == "rounds":
                first = prop.catch_up(seq.ids + [tok])
                if first is not None:
                    run = seq.device_tokens(tok, lambda owned, t=tok, f=first, n=n:
                                            self._rounds_source(t, f, n, stats, owned))
            else:
                run = seq.chain_tokens(tok, n) if seq.chains() else self._host_steps(tok, n)
            got, graphs, t0 = 0, self._graph_count(), time.perf_counter()
            if run is not None:
                try:
                    for tok in run:
                        got += 1
                        yield tok
                        yielded += 1
                        if yielded >= budget or tok in eot:
                            return
                finally:
                    run.close()
                    if self._graph_count() == graphs:       # a capture's time is not the mode's
                        gate.observe(mode, got, time.perf_counter() - t0)
            if not got:
                tok = argmax(self.step(tok))[0]
                yield tok
                yielded += 1

    def _host_steps(self, token: int, n: int) -> Iterator[int]:
        """n greedy steps from the host after `token` (where steps cannot be chained on the device)."""
        for _ in range(n):
            token = argmax(self.step(token))[0]
            yield token

    def _graph_count(self) -> int:
        """CUDA graphs captured so far for the rounds and the chain."""
        chain = self.model.chain
        return (self.rounds.count() if self.rounds is not None else 0) + (chain.count() if chain is not None else 0)

    def _rounds_source(self, token: int, first, limit: int, stats, owned) -> Iterator[int]:
        """The rounds' tokens for Sequence.device_tokens; when done, the head keeps the rows they computed for
        the tokens the sequence then holds (HeadProposer.adopt)."""
        context = self.target.ids + [token]
        tokens = self.rounds.tokens(self.target, token, first, limit, stats)
        try:
            for t in tokens:
                context.append(t)
                yield t
        finally:
            tokens.close()
            if owned():
                # the sequence holds context[:-1] (the newest token is not evaluated): head row P pairs the
                # state at P with the token at P + 1, so rows up to len(context) - 2 have both
                self.draft_proposer.adopt(context, min(self.rounds.valid, len(context) - 1))

    def _emit(self, source: Iterator[int], run: Generation, params: SamplingParams) -> Iterator[Piece]:
        decoder = StreamDecoder(self.tokenizer)
        stops = StopMatcher(params.stop)
        timings = run.timings
        t0 = time.perf_counter()
        try:
            for tok in source:
                timings.decode_tokens += 1
                if tok in self.tokenizer.eot_ids:
                    run.finish_reason = "stop"
                    yield Piece(tok, stops.push(decoder.flush()) + stops.flush())
                    return
                text = stops.push(decoder.push(tok))
                yield Piece(tok, text)
                if stops.stopped:
                    run.finish_reason = "stop"
                    return
            yield Piece(-1, stops.push(decoder.flush(cut=True)) + stops.flush())     # cut by the token budget
        finally:
            timings.decode_ms = (time.perf_counter() - t0) * 1000
            if hasattr(source, "close"):
                source.close()

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 conv_id: str | None = None) -> Result:
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        timings = Timings(load_ms=self.load_ms)
        out_ids, parts = [], []
        run = self.stream(ids, params, timings, conv_id=conv_id)
        for piece in run:
            if piece.token_id >= 0:
                out_ids.append(piece.token_id)
            parts.append(piece.text)
        return Result("".join(parts), out_ids, len(ids), run.finish_reason, timings, run.spec_stats)

