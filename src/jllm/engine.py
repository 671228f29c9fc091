"""The engine: one model, its tokenizer and chat template, a KV cache, and the decode loop.

The cache keeps the tokens it holds (`cached_ids`); a new prompt reuses the longest common prefix and
evaluates only the rest, so multi-turn chat in one process never re-reads its history. Speculative decoding
and the persistent cache plug in as token sources and cache loaders around the same loop.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from jllm.errors import JllmError
from jllm.gguf.reader import read_gguf
from jllm.model.loader import default_precision, load_model, resolve_device
from jllm.sampling import SamplingParams, make_generator, sample
from jllm.stops import StopMatcher
from jllm.tokenizer.chat import ChatTemplate
from jllm.tokenizer.stream import StreamDecoder
from jllm.tokenizer.tokenizer import Tokenizer

PREFILL_CHUNK = 256


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


@dataclass
class Piece:
    """One step of a stream: the new token and the text it completes (may be empty)."""
    token_id: int
    text: str


def set_threads(threads: int | None) -> None:
    n = threads or os.cpu_count() or 1
    torch.set_num_threads(max(1, n))


class Engine:
    def __init__(self, model_path: str, device: str | None = "cpu", precision: str | None = None,
                 ctx_size: int = 4096, threads: int | None = None, kv_store_dir: str | None = None,
                 kv_store_bytes: int = 1 << 30, draft_path: str | None = None, spec=None):
        """spec: a jllm.spec.decode.SpecConfig, or None for plain decoding (its mode 'none' too)."""
        if ctx_size <= 0:
            raise JllmError(f"context size must be positive, got {ctx_size}")
        t0 = time.perf_counter()
        set_threads(threads)
        self.device = resolve_device(device)
        self.gguf = read_gguf(model_path)
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        self.chat_template = ChatTemplate.from_metadata(self.gguf.metadata, self.tokenizer)
        self.precision = precision or default_precision(self.device)
        draft_gguf = self._check_draft(draft_path) if draft_path is not None else None   # fail before loading
        if self.device.type == "cpu":
            self._check_memory(draft_gguf, spec, ctx_size)
        self.ctx_size = ctx_size
        self.draft = None
        # the draft loads beside the target: a load is mostly file reads and page faults, which two cores
        # overlap (a second start of the default pair: ~1 s less)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="jllm-draft-load") as pool:
            draft_loading = pool.submit(self._load_draft, draft_gguf, spec) if draft_gguf is not None else None
            self.model = load_model(self.gguf, self.device, self.precision, max_positions=ctx_size)
            if draft_loading is not None:
                draft_loading.result()
        self.cache = self.model.new_cache(ctx_size)
        self.cached_ids: list[int] = []
        self.spec = spec if spec is not None and spec.mode != "none" else None
        self.spec_stats = None                 # the last speculative run's SpecStats
        self.spec_gate = None                  # the draft gate, kept across generations (a chat's turns)
        self.kv_store = None
        if kv_store_dir is not None:
            from jllm.cache.store import KVStore, dtype_name, model_fingerprint

            # CPU and CUDA compute slightly different KV, and an f32 cache's state is not an f16 one's
            tag = f"{self.precision}@{self.device.type}/kv-{dtype_name(self.cache.k.dtype)}"
            draft_fp = None
            if self.draft is not None:
                dm = self.draft.model
                draft_fp = model_fingerprint(dm.gguf, f"{self.draft.precision}@{self.device.type}"
                                                      f"/vocab{dm.w.output.out_features}"
                                                      f"/kv-{dtype_name(self.draft.cache.k.dtype)}")
            self.kv_store = KVStore(kv_store_dir, max_bytes=kv_store_bytes,
                                    target_fingerprint=model_fingerprint(self.gguf, tag),
                                    draft_fingerprint=draft_fp)
        self._saving: threading.Thread | None = None
        self.load_ms = (time.perf_counter() - t0) * 1000

    def _check_draft(self, draft_path: str):
        """Read the draft's header and check its tokenizer against the target's, before any weights load."""
        from jllm.spec.compat import check_compatible

        dg = read_gguf(draft_path)
        check_compatible(self.gguf.metadata, dg.metadata, self.gguf.path.name, dg.path.name)
        return dg

    def _check_memory(self, draft_gguf, spec, ctx_size: int) -> None:
        """Refuse, before allocating, a configuration that needs more than this machine's RAM (a context of
        millions of tokens would otherwise end in the OOM killer, or in a traceback for an impossible size)."""
        from jllm.plan import check_limit, physical_memory, plan
        from jllm.spec.decode import SpecConfig

        spec = spec or SpecConfig()
        rows = plan(self.gguf, draft_gguf, ctx_size, self.precision, spec.draft_precision, spec.draft_vocab or None)
        check_limit(rows, physical_memory(), "this machine's memory")

    def _load_draft(self, dg, spec) -> None:
        from jllm.spec.decode import DraftRunner, SpecConfig, draft_precision_for

        spec = spec or SpecConfig()
        precision = draft_precision_for(self.precision, spec.draft_precision)
        draft_model = load_model(dg, self.device, precision, max_positions=self.ctx_size,
                                 output_rows=spec.draft_vocab or None)
        self.draft = DraftRunner(draft_model, self.ctx_size)
        self.draft.precision = precision

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
        keep = min(common_prefix(self.cached_ids, ids), len(ids) - 1)   # evaluate >= 1 token for its logits
        if self.kv_store is not None:
            keep = self._hydrate(ids, conv_id, keep, timings)
        logits = fill_cache(self.model, self.cache, self.cached_ids, ids, min(keep, self.cache.length))
        return logits, len(ids) - keep

    def _hydrate(self, ids: list[int], conv_id: str | None, keep: int, timings: Timings | None) -> int:
        """Load the best stored state if it covers more of `ids` than the cache already does."""
        t0 = time.perf_counter()
        self.wait_saves()
        name, n = self.kv_store.lookup(ids, conv_id)
        n = min(n, len(ids) - 1)
        if name is not None and n > keep:
            state = self.kv_store.load(name, n)
            # another process may have replaced the entry since lookup: use it only if it still matches
            if state is not None and list(state.tokens[:n]) == ids[:n]:
                self.cache.load(state.target_k.to(self.device), state.target_v.to(self.device))
                self.cached_ids = list(ids[:n])
                keep = n
                if self.draft is not None and state.draft_k is not None:
                    self.draft.cache.load(state.draft_k.to(self.device), state.draft_v.to(self.device))
                    self.draft.ids = list(ids[:n])
        if timings is not None:
            timings.hydrate_ms = (time.perf_counter() - t0) * 1000
        return keep

    def save_state(self, conv_id: str | None) -> None:
        """Store the cache's state for the next turn, on a background thread (see wait_saves)."""
        if self.kv_store is None or not self.cached_ids:
            return
        from jllm.cache.store import KVState

        self.wait_saves()
        n = self.cache.length
        k, v = self.cache.export(n)
        state = KVState(tokens=list(self.cached_ids[:n]), target_k=k.cpu(), target_v=v.cpu())
        if self.draft is not None:                  # the draft's state covers the same tokens
            self.draft.sync(state.tokens)
            dk, dv = self.draft.cache.export(n)
            state.draft_k, state.draft_v = dk.cpu(), dv.cpu()

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
        logits = self.model.forward(torch.tensor([token], device=self.device), self.cache)[-1]
        self.cached_ids.append(token)
        return logits

    # -- generation -------------------------------------------------------------------------------------------

    def stream(self, prompt_ids: list[int], params: SamplingParams, timings: Timings | None = None,
               token_source: Callable | None = None, conv_id: str | None = None,
               save: bool = True) -> Iterator[Piece]:
        """Yield generated tokens with their text; stops on end-of-turn tokens, stop strings or max_tokens.

        With a persistent store, the state is saved afterwards under conv_id (or an anonymous name)."""
        timings = timings if timings is not None else Timings()
        t0 = time.perf_counter()
        logits, evaluated = self.prefill(prompt_ids, conv_id, timings)
        if self.spec is not None and self.draft is not None:
            self.draft.sync(prompt_ids)        # the draft's prompt prefill belongs to prompt time, not decode
        timings.prompt_eval_ms = (time.perf_counter() - t0) * 1000 - timings.hydrate_ms
        timings.prompt_tokens_evaluated = evaluated
        timings.cached_tokens = len(prompt_ids) - evaluated
        budget = min(params.max_tokens, self.ctx_size - len(prompt_ids))
        if token_source is None and self.spec is not None:
            from jllm.spec.decode import DraftGate, SpeculativeDecoder

            if self.spec_gate is None:
                self.spec_gate = DraftGate()
            decoder = SpeculativeDecoder(self, self.draft, self.spec, gate=self.spec_gate)
            token_source = decoder.tokens
            self.spec_stats = decoder.stats
        source = (token_source or self._plain_tokens)(logits, params, budget)
        yield from self._emit(source, params, timings)
        if save:
            self.save_state(conv_id)

    def _plain_tokens(self, logits: torch.Tensor, params: SamplingParams, budget: int) -> Iterator[int]:
        gen = make_generator(params.seed)
        history = list(self.cached_ids)
        for n in range(budget):
            tok = sample(logits, params, history, gen)
            history.append(tok)
            yield tok
            if n + 1 < budget and tok not in self.tokenizer.eot_ids:
                logits = self.step(tok)

    def _emit(self, source: Iterator[int], params: SamplingParams, timings: Timings) -> Iterator[Piece]:
        decoder = StreamDecoder(self.tokenizer)
        stops = StopMatcher(params.stop)
        t0 = time.perf_counter()
        self.finish_reason = "length"
        try:
            for tok in source:
                timings.decode_tokens += 1
                if tok in self.tokenizer.eot_ids:
                    self.finish_reason = "stop"
                    yield Piece(tok, stops.push(decoder.flush()) + stops.flush())
                    return
                text = stops.push(decoder.push(tok))
                yield Piece(tok, text)
                if stops.stopped:
                    self.finish_reason = "stop"
                    return
            yield Piece(-1, stops.push(decoder.flush()) + stops.flush())
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
        for piece in self.stream(ids, params, timings, conv_id=conv_id):
            if piece.token_id >= 0:
                out_ids.append(piece.token_id)
            parts.append(piece.text)
        return Result("".join(parts), out_ids, len(ids), self.finish_reason, timings)


def fill_cache(model, cache, held: list[int], ids: list[int], keep: int) -> torch.Tensor:
    """Cut `cache` back to its first `keep` tokens and evaluate ids[keep:] in chunks, so that it holds exactly
    `ids`; `held`, the list of ids the cache holds, is updated in place. Returns the logits after ids[-1]."""
    cache.truncate(keep)
    del held[keep:]
    logits = None
    for s in range(keep, len(ids), PREFILL_CHUNK):
        chunk = ids[s:s + PREFILL_CHUNK]
        logits = model.forward(torch.tensor(chunk, device=model.device), cache, last_only=True)[-1]
        held.extend(chunk)
    return logits


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
