"""Conversation histories kept beside the KV store, so `jllm chat --conversation ID -p ...` continues a chat.

`<cache dir>/conversations/<id>.json` holds {"version": 1, "messages": [{"role", "content"}, ...]}. The KV
entries may be evicted; the messages are not (they are small), so an evicted conversation continues with its
history recomputed. Written atomically (temp file, fsync, rename).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from jllm.cache.store import check_conversation_id
from jllm.errors import JllmError
from jllm import paths

VERSION = 1


def default_cache_dir() -> Path:
    return paths.cache_dir("kv-cache", "JLLM_CACHE_DIR")


def _path(cache_dir: Path, conv_id: str) -> Path:
    return Path(cache_dir) / "conversations" / f"{check_conversation_id(conv_id)}.json"


def load_messages(cache_dir: Path, conv_id: str) -> list[dict]:
    path = _path(cache_dir, conv_id)
    if path.is_symlink():
        raise JllmError(f"conversation file {path} is a symbolic link; refusing to read it")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise JllmError(f"conversation file {path} is unreadable ({e}); remove it with "
                        f"`jllm cache rm {conv_id}` to start over") from None
    if not _well_formed(data):
        raise JllmError(f"conversation file {path} has an unknown format; remove it with `jllm cache rm {conv_id}`")
    return data["messages"]


def _well_formed(data) -> bool:
    """{"version": VERSION, "messages": [{"role": str, "content": str}, ...]}, as save_messages writes it."""
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("messages"), list):
        return False
    return all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in data["messages"])


def save_messages(cache_dir: Path, conv_id: str, messages: list[dict]) -> None:
    path = _path(cache_dir, conv_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"version": VERSION, "messages": messages}, f, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_messages(cache_dir: Path, conv_id: str) -> bool:
    path = _path(cache_dir, conv_id)
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def list_conversations(cache_dir: Path) -> list[str]:
    d = Path(cache_dir) / "conversations"
    return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []
