"""Conversation histories kept beside the KV store, so `jllm chat --conversation ID -p ...` continues a chat.

`<cache dir>/conversations/<id>.json` holds {"version": 1, "messages": [{"role", "content"}, ...]}. The KV
entries may be evicted; the messages are not (they are small), so an evicted conversation continues with its
history recomputed.

A turn is saved by `History.save` under the histories' lock (`conversations/.lock`; not the KV store's,
which a state's background save holds for seconds after a reply): it reads the stored history again, and
if another process appended turns of the same conversation since this one read it, this one's new turns
go after them (one warning says so), so two `jllm chat` processes on one conversation lose no turn. The
file is written to `conversations/.tmp-<random>.json`, fsynced and renamed; since every writer holds the
lock, a temp file seen while holding it is a dead writer's and is removed (on every save and by
`jllm cache clear`). A save that fails (a full disk) is one warning: the reply has been
shown, and the turn stays in memory for the next save.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable

from jllm import console
from jllm.cache.store import (LockError, check_conversation_id, dir_lock, remove_file_or_empty_dir,
                              remove_temp_files, valid_name, warn_once)
from jllm.errors import JllmError
from jllm import paths

VERSION = 1
_TMP_PREFIX, _TMP_SUFFIX = ".tmp-", ".json"


def default_cache_dir() -> Path:
    return paths.cache_dir("kv-cache", "JLLM_CACHE_DIR")


def _path(cache_dir: Path, conv_id: str) -> Path:
    return Path(cache_dir) / "conversations" / f"{check_conversation_id(conv_id)}.json"


def load_messages(cache_dir: Path, conv_id: str, warn: Callable[[str], None] = console.warn) -> list[dict]:
    path = _path(cache_dir, conv_id)
    if path.is_symlink():
        raise JllmError(f"conversation file {path} is a symbolic link; refusing to read it (remove it with "
                        f"`jllm cache rm {conv_id}`)")
    if path.is_dir():                               # never written by jllm: an empty one holds no history
        try:
            path.rmdir()
        except OSError:
            raise JllmError(f"conversation file {path} is a directory that is not empty; move it away") from None
        warn(f"conversation file {path} was an empty directory; removed it, the conversation starts anew")
        return []
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
    """Write the history atomically (temp file, fsync, rename), as it is: no lock, no merge (History.save)."""
    path = _path(cache_dir, conv_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"version": VERSION, "messages": messages}, f, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class History:
    """One conversation's messages: loaded once, then saved after each turn, merged with turns that other
    processes saved meanwhile. `messages` is the list to append to; save() updates it in place."""

    def __init__(self, cache_dir: Path, conv_id: str, warn: Callable[[str], None] = console.warn):
        self.cache_dir, self.conv_id, self.warn = Path(cache_dir), conv_id, warn
        self.messages = load_messages(cache_dir, conv_id, warn)
        self._stored = list(self.messages)          # what the file held when read or last written here

    def save(self) -> None:
        """Store the messages. If the file no longer holds what this process last read or wrote there,
        another process saved turns meanwhile: the messages added here since go after its, and messages
        becomes that merged history. A history that does not continue the stored one (after /reset) replaces
        it. A failure to write is one warning; the messages stay, and the next save stores them."""
        path = _path(self.cache_dir, self.conv_id)
        try:
            try:
                with dir_lock(self.cache_dir / "conversations"):    # not the KV lock, which a state's save
                                                                       # holds for seconds after a reply
                    remove_temps(self.cache_dir)
                    self._merge_and_write(path)
            except LockError as e:                  # said once; the history is still worth keeping
                warn_once(self.warn, str(e))
                self._merge_and_write(path)
        except (OSError, JllmError) as e:
            self.warn(f"could not save conversation {self.conv_id} to {path}: {getattr(e, 'strerror', None) or e}"
                      f"; its history is not saved this time")

    def _merge_and_write(self, path: Path) -> None:
        base, mine = self._stored, self.messages
        try:
            now = load_messages(self.cache_dir, self.conv_id, self.warn)
        except JllmError:                           # damaged since it was read: this process's copy is good
            self.warn(f"conversation file {path} was damaged meanwhile; replaced it with this process's history")
            now = base
        # Merge only where another process appended to what this one read; a history removed or replaced
        # meanwhile (`jllm cache rm`, another session's /reset), or replaced here (/reset), is written as this
        # process holds it.
        if now != base and now[:len(base)] == base and mine[:len(base)] == base:
            added = mine[len(base):]
            if not base and now and now[0]["role"] == "system" and added and added[0]["role"] == "system":
                added = added[1:]                   # both started it with a system message: the first stays
            self.warn(f"conversation {self.conv_id} was continued by another process meanwhile; this turn is "
                      f"saved after its turns")
            mine = now + added
        save_messages(self.cache_dir, self.conv_id, mine)
        self.messages[:] = mine
        self._stored = list(mine)


def remove_temps(cache_dir: Path) -> int:
    """Remove history temp files; call with the histories' lock held, when every temp file is a dead writer's."""
    return remove_temp_files(Path(cache_dir) / "conversations", _TMP_PREFIX, _TMP_SUFFIX)


def clear_temps(cache_dir: Path) -> int:
    """remove_temps under the histories' lock (for `jllm cache clear`)."""
    with dir_lock(Path(cache_dir) / "conversations"):
        return remove_temps(cache_dir)


def remove_messages(cache_dir: Path, conv_id: str) -> bool:
    """Remove a conversation's history (or an empty directory, a symlink in its place); False if none."""
    path = _path(cache_dir, conv_id)
    try:
        remove_file_or_empty_dir(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        raise JllmError(f"cannot remove {path} ({e.strerror}): it is a directory, not a conversation file; "
                        f"move it away") from None


def list_conversations(cache_dir: Path) -> list[str]:
    """Ids of the stored histories (temp files and names that are no conversation id left out)."""
    d = Path(cache_dir) / "conversations"
    return sorted(p.stem for p in d.glob("*.json") if valid_name(p.stem)) if d.is_dir() else []
