"""Counters of the server, rendered in Prometheus' text exposition format (version 0.0.4) for GET /metrics."""

from __future__ import annotations

import threading
from collections import Counter

# Paths counted by name in jllm_http_requests_total; anything else is "other" (bounded label values).
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.http = Counter()                   # (path, status) -> responses
        self.completions = 0                    # generations finished (not cancelled)
        self.cancelled_jobs = 0
        self.prompt_tokens = 0                  # prompt tokens of finished generations
        self.prompt_evaluated = 0               # ... of which the model evaluated
        self.prompt_cached = 0                  # ... and reused from the in-memory or persistent KV cache
        self.cache_hits = 0                     # generations that reused at least one token
        self.generated = 0                      # tokens generated (cancelled generations included)
        self.last_decode_tok_s = 0.0
        self.last_prompt_tok_s = 0.0
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_leaves = 0                    # side leaves verified, and taken
        self.spec_leaves_taken = 0

    def response(self, path: str, status: int) -> None:
        with self._lock:
            self.http[(path if path in PATHS else "other", status)] += 1

    def cancelled(self) -> None:
        with self._lock:
            self.cancelled_jobs += 1

    def record_tokens(self, n: int) -> None:
        with self._lock:
            self.generated += n

    def record(self, outcome) -> None:
        t = outcome.timings
        with self._lock:
            self.completions += 1
            self.generated += outcome.completion_tokens
            self.prompt_tokens += outcome.prompt_tokens
            self.prompt_evaluated += t["prompt_tokens_evaluated"]
            self.prompt_cached += t["cached_tokens"]
            self.cache_hits += t["cached_tokens"] > 0
            if t["decode_tokens"] > 1:
                self.last_decode_tok_s = t["decode_tok_s"]
            if t["prompt_tokens_evaluated"] > 0:
                self.last_prompt_tok_s = t["prompt_tok_s"]
            if outcome.spec:
                self.spec_drafted += outcome.spec["drafted"]
                self.spec_accepted += outcome.spec["accepted"]
                self.spec_leaves += outcome.spec.get("leaves", 0)
                self.spec_leaves_taken += outcome.spec.get("leaves_taken", 0)

    def render(self, queue_depth: int, running: int, store_stats: dict | None) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {value}")

        with self._lock:
            metric("jllm_http_requests_total", "counter", "HTTP responses by path and status code.",
                   [(f'{{path="{p}",status="{s}"}}', n) for (p, s), n in sorted(self.http.items())])
            metric("jllm_completions_total", "counter", "Generations finished.", [("", self.completions)])
            metric("jllm_completions_cancelled_total", "counter",
                   "Generations stopped or skipped because the client disconnected.", [("", self.cancelled_jobs)])
            metric("jllm_tokens_generated_total", "counter", "Tokens generated.", [("", self.generated)])
            metric("jllm_prompt_tokens_total", "counter", "Prompt tokens of finished generations.",
                   [("", self.prompt_tokens)])
            metric("jllm_prompt_tokens_evaluated_total", "counter", "Prompt tokens the model evaluated.",
                   [("", self.prompt_evaluated)])
            metric("jllm_prompt_tokens_cached_total", "counter",
                   "Prompt tokens reused from the KV cache (in memory or persistent).", [("", self.prompt_cached)])
            metric("jllm_prompt_cache_hits_total", "counter", "Generations that reused cached prompt tokens.",
                   [("", self.cache_hits)])
            metric("jllm_decode_tokens_per_second", "gauge", "Decode speed of the last generation.",
                   [("", self.last_decode_tok_s)])
            metric("jllm_prompt_tokens_per_second", "gauge", "Prompt evaluation speed of the last generation.",
                   [("", self.last_prompt_tok_s)])
            metric("jllm_spec_drafted_tokens_total", "counter", "Tokens proposed by speculative decoding.",
                   [("", self.spec_drafted)])
            metric("jllm_spec_accepted_tokens_total", "counter", "Proposed tokens the target accepted.",
                   [("", self.spec_accepted)])
            metric("jllm_spec_leaves_total", "counter", "Side leaves (the draft's second choices) verified.",
                   [("", self.spec_leaves)])
            metric("jllm_spec_leaves_taken_total", "counter", "Side leaves the target took.",
                   [("", self.spec_leaves_taken)])
            rate = self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0
            metric("jllm_spec_acceptance_rate", "gauge", "Accepted / drafted tokens since start.",
                   [("", round(rate, 4))])
        if store_stats is not None:
            metric("jllm_kv_cache_entries", "gauge", "Entries in the persistent KV cache.",
                   [("", store_stats["count"])])
            metric("jllm_kv_cache_bytes", "gauge", "Bytes of the persistent KV cache on disk.",
                   [("", store_stats["bytes"])])
            metric("jllm_kv_cache_max_bytes", "gauge", "Size cap of the persistent KV cache.",
                   [("", store_stats["max_bytes"])])
            shared = store_stats.get("shared")     # the Redis tier (--kv-store), shared with other replicas
            if shared is not None:
                metric("jllm_kv_shared_up", "gauge", "Whether the shared KV tier (Redis) answered.",
                       [("", int(shared["reachable"]))])
                metric("jllm_kv_shared_entries", "gauge", "Entries in the shared KV tier (all replicas).",
                       [("", shared["count"])])
                metric("jllm_kv_shared_bytes", "gauge", "Bytes of the shared KV tier's entries (all replicas).",
                       [("", shared["bytes"])])
                metric("jllm_kv_shared_max_bytes", "gauge", "Size cap of the shared KV tier.",
                       [("", shared["max_bytes"])])
        metric("jllm_queue_depth", "gauge", "Requests waiting for the engine.", [("", queue_depth)])
        metric("jllm_requests_running", "gauge", "Requests generating (0 or 1).", [("", running)])
        return "\n".join(lines) + "\n"
