"""jllm: local LLM inference for GGUF models."""
