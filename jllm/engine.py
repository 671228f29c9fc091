"""The engine: one model, its tokenizer and chat template, a KV cache, and the decode loop.

The cache keeps the tokens it holds (`cached_ids`); a new prompt reuses the longest common prefix and
evaluates only the rest, so multi-turn chat in one process never re-reads its history. Speculative decoding
and the persistent cache plug in as token sources and cache loaders around the same loop.
"""

from __future__ import annotations

import os
import time
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
                 ctx_size: int = 4096, threads: int | None = None):
        if ctx_size <= 0:
            raise JllmError(f"context size must be positive, got {ctx_size}")
        t0 = time.perf_counter()
        set_threads(threads)
        self.device = resolve_device(device)
        self.gguf = read_gguf(model_path)
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        self.chat_template = ChatTemplate.from_metadata(self.gguf.metadata, self.tokenizer)
        self.precision = precision or default_precision(self.device)
        self.model = load_model(self.gguf, self.device, self.precision, max_positions=ctx_size)
        self.ctx_size = ctx_size
        self.cache = self.model.new_cache(ctx_size)
        self.cached_ids: list[int] = []
        self.load_ms = (time.perf_counter() - t0) * 1000

    # -- prompts ----------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.chat_template.render(messages, add_generation_prompt=True)
        # the tokenizer adds BOS where the model wants one; the template drops its own copy (chat.py)
        return self.tokenizer.encode(text, parse_special=True)

    # -- evaluation -------------------------------------------------------------------------------------------

    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Make the cache hold exactly `ids`, reusing the longest cached prefix.

        Returns the logits after the last token [vocab] and the number of tokens evaluated.
        """
        if not ids:
            raise JllmError("empty prompt")
        if len(ids) >= self.ctx_size:
            raise JllmError(f"prompt of {len(ids)} tokens does not fit the context size {self.ctx_size} "
                            "(raise -c/--ctx-size or shorten the prompt)")
        keep = common_prefix(self.cached_ids, ids)
        keep = min(keep, len(ids) - 1)             # evaluate at least one token to get its logits
        self.cache.truncate(min(keep, self.cache.length))
        self.cached_ids = self.cached_ids[:self.cache.length]
        logits = None
        for s in range(self.cache.length, len(ids), PREFILL_CHUNK):
            chunk = ids[s:s + PREFILL_CHUNK]
            logits = self.model.forward(torch.tensor(chunk, device=self.device), self.cache, last_only=True)[-1]
            self.cached_ids.extend(chunk)
        return logits, len(ids) - keep

    def step(self, token: int) -> torch.Tensor:
        logits = self.model.forward(torch.tensor([token], device=self.device), self.cache)[-1]
        self.cached_ids.append(token)
        return logits

    # -- generation -------------------------------------------------------------------------------------------

    def stream(self, prompt_ids: list[int], params: SamplingParams, timings: Timings | None = None,
               token_source: Callable | None = None) -> Iterator[Piece]:
        """Yield generated tokens with their text; stops on end-of-turn tokens, stop strings or max_tokens."""
        timings = timings if timings is not None else Timings()
        t0 = time.perf_counter()
        logits, evaluated = self.prefill(prompt_ids)
        timings.prompt_eval_ms = (time.perf_counter() - t0) * 1000
        timings.prompt_tokens_evaluated = evaluated
        timings.cached_tokens = len(prompt_ids) - evaluated
        budget = min(params.max_tokens, self.ctx_size - len(prompt_ids))
        source = (token_source or self._plain_tokens)(logits, params, budget)
        yield from self._emit(source, params, timings)

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

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> Result:
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        timings = Timings(load_ms=self.load_ms)
        out_ids, parts = [], []
        for piece in self.stream(ids, params, timings):
            if piece.token_id >= 0:
                out_ids.append(piece.token_id)
            parts.append(piece.text)
        return Result("".join(parts), out_ids, len(ids), self.finish_reason, timings)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
