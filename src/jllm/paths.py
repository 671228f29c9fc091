"""Where jllm keeps its files: one directory under the user's cache dir per kind (models, KV cache, compiled
kernels), each overridable by an environment variable."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(sub: str, env: str) -> Path:
    """$env if set (with ~ expanded), else `<user cache dir>/jllm/<sub>`."""
    value = os.environ.get(env)
    if value:
        return Path(value).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("jllm")) / sub
