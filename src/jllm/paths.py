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


def check_writable(path: str | Path) -> None:
    """Raise OSError unless a file can be written at `path`, for an option whose file is written only after long
    work (bench --json, train-head -o): not a directory, an existing file there writable, and its folder taking a
    new file (a fresh temporary one, made and removed: nothing there is touched)."""
    import errno
    import tempfile

    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(errno.EISDIR, "it is a directory")
    if p.exists() and not os.access(p, os.W_OK):
        raise PermissionError(errno.EACCES, "the file is not writable")
    fd, probe = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    os.close(fd)
    os.unlink(probe)
