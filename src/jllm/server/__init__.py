"""`jllm serve`: an OpenAI-compatible HTTP server over one engine (FastAPI on uvicorn); see app.py."""

from jllm.server.app import create_app

__all__ = ["create_app"]
