"""One engine, one generation at a time: a worker thread takes jobs from a FIFO queue (first come, first
served) and reports each job's progress through the job's `emit` callback.

Events, in order: ("piece", Piece) for every piece of text, then ("done", Outcome) — or ("error", exception)
at any point. A job whose `cancelled` flag is set (its client went away) is skipped if it has not started, or
stopped between two tokens: the engine's stream generator is closed, so the cache keeps a consistent state
and the next job starts at once. Prompts are rendered and tokenized here too, on the one thread that owns the
engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from jllm.engine import Timings
from jllm.errors import JllmError
from jllm.sampling import SamplingParams

log = logging.getLogger("jllm.server")


class ContextTooLong(JllmError):
    """The prompt does not fit the context (OpenAI's code: context_length_exceeded)."""


@dataclass
class Outcome:
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str                  # "stop" or "length"
    timings: dict                       # Timings.as_dict() plus queue_ms
    spec: dict | None                   # the engine's speculation statistics for this request, if it speculated


@dataclass(eq=False)
class Job:
    make_ids: Callable[[], list[int]]   # the prompt's token ids, computed on the worker thread
    params: SamplingParams
    conv_id: str | None
    emit: Callable[[tuple], None]       # called on the worker thread; must not block
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)


class Worker:
    def __init__(self, engine, metrics):
        self.engine = engine
        self.metrics = metrics
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.current: Job | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jllm-generate", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        self.start()
        self._jobs.put(job)

    @property
    def running(self) -> int:
        """1 while a job is generating, else 0."""
        return int(self.current is not None)

    @property
    def depth(self) -> int:
        """Jobs waiting for the engine (not counting the one generating)."""
        return self._jobs.qsize()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what waits, let the running job stop at its next token, end the thread."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
        current = self.current
        if current is not None:
            current.cancelled.set()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():
                self.metrics.cancelled()
                continue
            self.current = job
            try:
                self._generate(job)
            except JllmError as e:
                job.emit(("error", e))
            except Exception as e:                  # a bug: the client gets a 500, the log one line
                log.error("jllm serve: generation failed: %s: %s", type(e).__name__, e)
                job.emit(("error", e))
            finally:
                self.current = None

    def _generate(self, job: Job) -> None:
        eng = self.engine
        queue_ms = (time.perf_counter() - job.submitted) * 1000
        ids = job.make_ids()
        if len(ids) >= eng.ctx_size:
            raise ContextTooLong(f"the prompt is {len(ids)} tokens, the model's context is {eng.ctx_size} "
                                 "(leave room for the reply): shorten the prompt")
        timings = Timings()
        stream = eng.stream(ids, job.params, timings, conv_id=job.conv_id)
        n = 0
        try:
            for piece in stream:
                n += piece.token_id >= 0
                job.emit(("piece", piece))
                if job.cancelled.is_set():
                    self.metrics.cancelled()
                    self.metrics.record_tokens(n)
                    return
        finally:
            stream.close()
        spec = stream.spec_stats.as_dict() if stream.spec_stats is not None else None
        outcome = Outcome(len(ids), n, stream.finish_reason, dict(timings.as_dict(), queue_ms=round(queue_ms, 2)),
                          spec)
        self.metrics.record(outcome)
        job.emit(("done", outcome))
