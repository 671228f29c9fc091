"""The persistent KV store: one file per conversation holding the token ids a KV state covers and the KV
tensors of the target model (and of the draft model when speculation is on).

On-disk format, version 1. `<dir>/<conv_id>.kv` for a named conversation, `<dir>/anon-<hash of the
tokens>.kv` for a prompt without one. All integers little-endian:

    offset  size  field
    0       8     magic b"JLLM-KV\\n"
    8       4     u32 format version (1)
    12      4     u32 H, the header's length in bytes
    16      32    sha256 of the header bytes followed by the token bytes (the "meta digest")
    48      H     header, UTF-8 JSON:
                    {"version": 1, "name": str, "created": unix time (s),
                     "target": fingerprint of the target model, "draft": the draft's or null,
                     "models": their files, for messages only (e.g. "t.gguf (native@cpu/kv-bfloat16) + h.gguf"),
                     "n_tokens": n,
                     "tensors": [{"name": "target_k", "dtype": "float16", "shape": [L, Hkv, n, D]},
                                 "target_v", then "draft_k", "draft_v" if present],
                     "payload_bytes": P, "payload_sha256": hex digest of the payload}
    48+H    4n    token ids, int32
    48+H+4n P     payload: the tensors in header order, each its C-order bytes (dtype: the cache's, f16
                  on the native CPU stack, f32 elsewhere; float32, float16 or bfloat16 are read)

Header and tokens come first so that `lookup` reads a few KB per entry and never the payload. A file is
written to `.<name>.<pid>.<rand>.tmp` in the same directory, fsynced and renamed over the entry (then the
directory is fsynced), so a reader sees an old entry or a new one, never half of one. A file that is
truncated, fails a checksum or has another format version is reported once through `warn` (once per file
and process), removed, and `load` returns None. An entry written for other models (fingerprints, see
`model_fingerprint`) is reported once when it sits under the conversation's own id (the next save replaces
it); found by the prefix search under another name it is left alone, since another process with other
models may own it. Anything at an entry's path that is not a regular file (a symlink, a FIFO, an empty
directory) is never read, and is reported once and removed; a directory that is not empty is reported
once and that conversation goes uncached until it is moved away.

Writers (save and its eviction, remove, clear) hold `flock(<dir>/.lock)`, so every temp file seen while
holding the lock belongs to a writer that died, and is removed (conversations.py's history saves hold a lock
of their own, `conversations/.lock`, the same way). A `.lock` that cannot be opened (a directory, a symlink) is said once in one line (`LockError`),
and nothing is saved or removed until it is fixed; the turn goes on uncached. Readers take no lock: an
entry that vanishes while being read is a miss. Last use is the file's mtime (set on save and load).

Before a new file is written, eviction removes the least recently used `.kv` files (of any models) until
their total size, counting both the new file and the old entry it replaces (both are on disk until the
rename), is <= max_bytes and their count, counting the new one, is <= max_entries; when the old and the new
do not fit together, the old entry goes first. So the caps hold at every moment, even when a writer is
killed half-way. A save that fails (a full disk) is one warning through `warn` and returns None: the turn
that produced the state is never lost to it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from jllm import console
from jllm.errors import JllmError

FORMAT_VERSION = 1
MAGIC = b"JLLM-KV\n"
_PREFIX = 48                        # magic, version, header length, meta digest
_MAX_HEADER = 1 << 20
_MAX_TOKENS = 1 << 24
_CHUNK = 8 << 20                    # bytes per write/read step; hashing of one step overlaps the next's I/O
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_TENSORS = ("target_k", "target_v", "draft_k", "draft_v")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass
class KVState:
    """One conversation's cached state. Tensors: [n_layers, n_kv_heads, n, head_dim], CPU."""

    tokens: list[int]
    target_k: torch.Tensor
    target_v: torch.Tensor
    draft_k: torch.Tensor | None = None
    draft_v: torch.Tensor | None = None


def valid_name(name: str) -> bool:
    """A name that is safe as a file name in the cache directory (an entry's, without its `.kv`)."""
    return isinstance(name, str) and bool(_ID.fullmatch(name)) and ".." not in name


def check_conversation_id(conv_id: str) -> str:
    """Return conv_id if it is safe as a file name in the cache directory and names no file (`x.kv`, which
    would be stored as `x.kv.kv`), else raise JllmError; the message quotes at most 40 characters of it."""
    shown = repr(conv_id) if not isinstance(conv_id, str) or len(conv_id) <= 40 else repr(conv_id[:40]) + "..."
    if not valid_name(conv_id):
        raise JllmError(f"invalid conversation id {shown}: use letters, digits, '.', '_' or '-' "
                        f"(at most 128, starting with a letter or digit, no '..')")
    if conv_id.endswith((".kv", ".json")):
        raise JllmError(f"invalid conversation id {shown}: name the conversation, not its file "
                        f"(without {conv_id[conv_id.rindex('.'):]})")
    return conv_id


def dtype_name(dtype: torch.dtype) -> str:
    """"float16" for torch.float16: the name the header and the model tags use."""
    return str(dtype).removeprefix("torch.")


def model_fingerprint(gguf_file, precision: str) -> str:
    """A cheap, stable identity of a model as the KV store sees it: sha256 over the store's format version,
    the precision, the file size, the GGUF header (metadata and tensor directory) and the first and last
    4 KiB of every tensor's data. Reads a few MB at most."""
    h = hashlib.sha256(f"jllm-kv {FORMAT_VERSION} {precision} {gguf_file.size}\n".encode())
    infos = sorted(gguf_file.tensors.values(), key=lambda t: t.offset)
    data_start = infos[0].offset if infos else gguf_file.size
    with open(gguf_file.path, "rb") as f:
        h.update(f.read(data_start))
    for t in infos:
        raw = gguf_file.raw(t.name)
        h.update(raw[:4096])
        h.update(raw[-4096:])
    return h.hexdigest()[:32]


class LockError(JllmError):
    """The cache directory's `.lock` cannot be opened or locked; the message says which and why (`problem`),
    then what it means for caching."""

    def __init__(self, problem: str, fix: str = "fixed"):
        super().__init__(f"{problem}; nothing is cached until it is {fix}")
        self.problem, self.fix = problem, fix


_said: set[str] = set()             # lock problems already reported by this process


def warn_once(warn: Callable[[str], None], message: str) -> None:
    """Report a problem of the whole directory (its lock) once per process, whoever meets it."""
    if message not in _said:
        _said.add(message)
        warn(message)


def remove_temp_files(directory: Path, prefix: str, suffix: str) -> int:
    """Remove the regular files named prefix...suffix in directory (none if it is gone); returns how many.
    For writers' temp files, called with the lock that every writer holds, so each one is a dead writer's."""
    try:
        listing = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    n = 0
    for e in listing:
        if e.name.startswith(prefix) and e.name.endswith(suffix) and e.is_file(follow_symlinks=False):
            Path(e.path).unlink(missing_ok=True)
            n += 1
    return n


def remove_file_or_empty_dir(path: Path) -> None:
    """Unlink path (a symlink itself, never its target), or rmdir it when it is a directory; OSError for a
    directory that is not empty, FileNotFoundError when nothing is there."""
    os.rmdir(path) if stat.S_ISDIR(os.lstat(path).st_mode) else os.unlink(path)


@contextmanager
def dir_lock(directory: Path) -> Iterator[None]:
    """Hold flock(<directory>/.lock), making the directory (and the lock file) if missing. Raises LockError
    when the lock cannot be had, OSError when the directory cannot be made (a full disk, a file there)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)   # removed since we started: make it again
    path = directory / ".lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        what = {errno.EISDIR: "is a directory", errno.ELOOP: "is a symbolic link"}.get(e.errno)
        raise LockError(f"the KV cache lock {path} {what or f'cannot be opened ({e.strerror})'}",
                        "removed" if what else "fixed") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LockError(f"the KV cache lock {path} is not a regular file", "removed")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            raise LockError(f"the KV cache lock {path} cannot be locked ({e.strerror})") from None
        yield
    finally:
        os.close(fd)


class BadEntry(Exception):
    """A file that is not a usable entry; `kind` is "corrupt", "version", "foreign" or "link" (not a regular
    file: a symlink, a FIFO, a directory)."""

    def __init__(self, kind: str, problem: str):
        super().__init__(problem)
        self.kind = kind


@dataclass
class _Meta:
    header: dict
    tokens: np.ndarray              # int32 [n]
    st: os.stat_result
    payload_offset: int


# --- buffers and hashing -------------------------------------------------------------------------------------

def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, flat, without a copy when it is already a contiguous CPU tensor."""
    t = t.detach().cpu().contiguous()
    return memoryview(t.view(torch.uint8).numpy().reshape(-1))


_pool: ThreadPoolExecutor | None = None
_pool_pid = -1


def _hasher() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():     # a forked child has no threads of its parent
        _pool, _pool_pid = ThreadPoolExecutor(1, thread_name_prefix="jllm-kv-hash"), os.getpid()
    return _pool


def _chunks(views: list[memoryview]):
    """The buffers in order, cut into _CHUNK-byte views."""
    for view in views:
        for s in range(0, len(view), _CHUNK):
            yield view[s:s + _CHUNK]


def _hashed(chunks, h):
    """Yield the chunks; each one is hashed on a worker thread once the caller has handled it (written it, or
    filled it), while the caller handles the next. One hash is in flight at a time, so h sees chunks in order."""
    pending: Future | None = None
    try:
        for chunk in chunks:
            yield chunk
            if pending is not None:
                pending.result()
            pending = _hasher().submit(h.update, chunk)
    finally:
        if pending is not None:
            pending.result()


def _write_all(f, data) -> None:
    """Write all of data to an unbuffered file (whose write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


def _write_hashed(f, views: list[memoryview], h) -> None:
    """Write the buffers in order, hashing each chunk on a worker thread while the next is written."""
    with closing(_hashed(_chunks(views), h)) as chunks:     # closing: the last hash is waited for on any exit
        for chunk in chunks:
            _write_all(f, chunk)


def _read_hashed(f, views: list[memoryview], h) -> None:
    """Fill the buffers from f, hashing chunk i on a worker thread while chunk i+1 is read."""
    with closing(_hashed(_chunks(views), h)) as chunks:
        for chunk in chunks:
            got = 0
            while got < len(chunk):
                n = f.readinto(chunk[got:])
                if not n:
                    raise BadEntry("corrupt", "is truncated (in the payload)")
                got += n


def _read_exact(f, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise BadEntry("corrupt", f"is truncated (in the {what})")
    return data


# --- the entry's bytes (shared with the Redis tier, shared.py) ----------------------------------------------

def made_by(header: dict) -> str:
    """The models an entry was written for, for messages: their file names where the header has them."""
    return header.get("models") or f"target {header.get('target')}, draft {header.get('draft')}"


def entry_parts(name: str, state: KVState, target_fp: str, draft_fp: str | None, models: str = "") \
        -> tuple[dict, bytes, list[memoryview]]:
    """Check a state and lay it out as an entry named `name`: the header (its payload_sha256 a placeholder of
    the final length, set once the payload is hashed), the token ids' bytes and the payload's buffers (the
    tensors' own memory, no copy). Raises ValueError for a state that is not one."""
    tokens = np.asarray(state.tokens, dtype=np.int64)
    tensors = {"target_k": state.target_k, "target_v": state.target_v}
    if (state.draft_k is None) != (state.draft_v is None):
        raise ValueError("KVState: draft_k and draft_v come together")
    if state.draft_k is not None:
        tensors.update(draft_k=state.draft_k, draft_v=state.draft_v)
    n = len(tokens)
    if n and (tokens.min() < 0 or tokens.max() >= 2**31):
        raise ValueError("KVState: token ids must fit in int32")
    for k, t in tensors.items():
        if t.dim() != 4 or t.shape[2] != n or dtype_name(t.dtype) not in _DTYPES:
            raise ValueError(f"KVState: {k} is {tuple(t.shape)} {t.dtype}, expected "
                             f"[layers, kv_heads, {n}, head_dim] float32/float16/bfloat16")
    views = [_bytes_of(t) for t in tensors.values()]
    header = {"version": FORMAT_VERSION, "name": name, "created": int(time.time()),
              "target": target_fp, "draft": draft_fp, "models": models, "n_tokens": n,
              "tensors": [{"name": k, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
                          for k, t in tensors.items()],
              "payload_bytes": sum(len(v) for v in views), "payload_sha256": "0" * 64}
    return header, tokens.astype("<i4").tobytes(), views


def anon_name(tokens) -> str:
    """The name of an entry saved without a conversation id: a hash of its tokens."""
    return "anon-" + hashlib.sha256(np.asarray(tokens, dtype=np.int64).astype("<i4").tobytes()).hexdigest()[:24]


def entry_head(header: dict, tok: bytes) -> bytes:
    """The entry's bytes before its payload: magic, version, header length, meta digest, header, token ids."""
    raw = json.dumps(header).encode()
    return MAGIC + FORMAT_VERSION.to_bytes(4, "little") + len(raw).to_bytes(4, "little") \
        + hashlib.sha256(raw + tok).digest() + raw + tok


def read_head(read: Callable[[int, str], bytes]) -> tuple[dict, np.ndarray, int]:
    """Parse and check an entry's head, read(n, what) giving its next n bytes (or raising BadEntry "corrupt"
    when they are not there). Returns the header, the token ids (int32) and the head's length, which is
    where the payload starts; raises BadEntry ("corrupt" or "version")."""
    prefix = read(_PREFIX, "header")
    if prefix[:8] != MAGIC:
        raise BadEntry("corrupt", "is not a jllm KV cache file (bad magic)")
    version, hlen = int.from_bytes(prefix[8:12], "little"), int.from_bytes(prefix[12:16], "little")
    if version != FORMAT_VERSION:
        raise BadEntry("version", f"has format version {version}, this jllm reads version {FORMAT_VERSION}")
    if hlen > _MAX_HEADER:
        raise BadEntry("corrupt", f"has an implausible header length {hlen}")
    raw = read(hlen, "header")
    try:
        h = json.loads(raw)
        n = int(h["n_tokens"])
    except (ValueError, KeyError, TypeError):
        raise BadEntry("corrupt", "has an unreadable header") from None
    if not 0 <= n <= _MAX_TOKENS:
        raise BadEntry("corrupt", f"has an implausible token count {n}")
    tok = read(4 * n, "token ids")
    if hashlib.sha256(raw + tok).digest() != prefix[16:48]:
        raise BadEntry("corrupt", "fails its header checksum")
    try:
        payload = 0
        for t in h["tensors"]:
            shape = [int(d) for d in t["shape"]]
            if t["name"] not in _TENSORS or len(shape) != 4 or shape[2] != n or min(shape) < 0:
                raise ValueError
            payload += int(np.prod(shape)) * _DTYPES[t["dtype"]].itemsize
        names = [t["name"] for t in h["tensors"]]
        if names not in (list(_TENSORS[:2]), list(_TENSORS)) or payload != h["payload_bytes"] \
                or h["version"] != FORMAT_VERSION:
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise BadEntry("corrupt", "has a header describing an impossible layout") from None
    return h, np.frombuffer(tok, dtype="<i4"), _PREFIX + hlen + 4 * n


# --- the store ------------------------------------------------------------------------------------------------

class KVStore:
    """A directory of KV entries for one pair of models (target, optional draft), capped in bytes and count."""

    def __init__(self, directory: str | Path, max_bytes: int = 1 << 30, max_entries: int = 256,
                 target_fingerprint: str = "", draft_fingerprint: str | None = None,
                 warn: Callable[[str], None] = console.warn, models: str = ""):
        if max_bytes <= 0 or max_entries <= 0:
            raise JllmError(f"KV cache cap must be positive (got {max_bytes} bytes, {max_entries} entries)")
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise JllmError(f"cannot create the KV cache directory {self.dir}: {e.strerror}") from None
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.target_fingerprint, self.draft_fingerprint = target_fingerprint, draft_fingerprint
        self.models = models            # the files behind the fingerprints, named in the header for messages
        self.warn = warn
        self._warned: set[tuple[int, int]] = set()
        self._last_touch = 0

    # -- reading ----------------------------------------------------------------------------------------------

    def lookup(self, tokens: list[int], conv_id: str | None = None) -> tuple[str | None, int]:
        """Best entry for this prompt: with conv_id, that entry (if valid for these models); else (and also
        if the conv entry shares less) the entry with the longest common token prefix. Returns (entry name,
        common prefix length); reads only headers + token ids, never the KV payload."""
        want = np.asarray(tokens, dtype=np.int64)
        best: tuple[str | None, int] = (None, 0)
        if conv_id is not None:
            n = self._shared(check_conversation_id(conv_id), want, own=True)
            if n > 0:
                best = (conv_id, n)
            if n == len(want):
                return best
        for name in self._names():
            if name != conv_id:
                n = self._shared(name, want)
                if n > best[1]:
                    best = (name, n)
        return best

    def _shared(self, name: str, want: np.ndarray, own: bool = False) -> int:
        """Common prefix of `want` with the entry's tokens; 0 if missing, foreign or bad. `own`: the entry is
        the conversation's own, so one of other models there is reported (the save replaces it)."""
        try:
            with self._open(name) as f:
                meta = self._read_meta(f)
        except OSError:                                   # vanished or unreadable: a miss
            return 0
        except BadEntry as e:
            self._discard(name, e, None)
            return 0
        if not self._ours(meta.header):
            if own:
                h = meta.header
                self._report((meta.st.st_dev, meta.st.st_ino),
                             f"KV cache file {self.dir / (name + '.kv')} was written for other models "
                             f"({made_by(h)}); the prompt is evaluated from scratch and this conversation's "
                             f"state replaces it")
            return 0
        have = meta.tokens[:len(want)]
        diff = np.flatnonzero(have != want[:len(have)])
        return int(diff[0]) if len(diff) else len(have)

    def load(self, name: str, n_tokens: int) -> KVState | None:
        """Read an entry, verify header and checksum, return its first n_tokens positions; None (after one
        warning line naming the file and the problem, and removing the file) if it is corrupt, truncated,
        of another format version, or written for other models. Touches the entry's last-use time (LRU)."""
        if not valid_name(name):
            raise JllmError(f"invalid KV cache entry name {name[:40]!r}")
        meta = None
        try:
            with self._open(name) as f:
                meta = self._read_meta(f)
                h = meta.header
                if not self._ours(h):
                    raise BadEntry("foreign", f"was written for other models ({made_by(h)})")
                if n_tokens < 0:
                    raise ValueError(f"{name}: asked for {n_tokens} positions")
                if n_tokens > h["n_tokens"]:
                    return None                           # replaced by a shorter state since lookup: a miss
                tensors = {t["name"]: torch.empty(t["shape"], dtype=_DTYPES[t["dtype"]]) for t in h["tensors"]}
                digest = hashlib.sha256()
                f.seek(meta.payload_offset)
                _read_hashed(f, [_bytes_of(t) for t in tensors.values()], digest)
                if digest.hexdigest() != h["payload_sha256"]:
                    raise BadEntry("corrupt", "fails its payload checksum")
                self._touch(f.fileno())
        except FileNotFoundError:
            return None                                   # evicted or removed by another process: a miss
        except BadEntry as e:
            self._discard(name, e, meta)
            return None
        except OSError as e:                              # unreadable (permissions, I/O error): not ours to remove
            self.warn(f"cannot read KV cache file {self.dir / (name + '.kv')}: {e.strerror}; "
                      f"the prompt is evaluated from scratch")
            return None
        part = {k: t[:, :, :n_tokens] for k, t in tensors.items()}
        return KVState(tokens=meta.tokens[:n_tokens].tolist(), target_k=part["target_k"],
                       target_v=part["target_v"], draft_k=part.get("draft_k"), draft_v=part.get("draft_v"))

    def _open(self, name: str):
        """Open an entry for reading without following a symlink (or blocking on a FIFO planted there)."""
        path = self.dir / f"{name}.kv"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise BadEntry("link", "is a symbolic link") from None
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise BadEntry("link", "is a directory" if stat.S_ISDIR(mode) else "is not a regular file")
        return os.fdopen(fd, "rb", buffering=0)

    def _read_meta(self, f) -> _Meta:
        st = os.fstat(f.fileno())
        h, tokens, head = read_head(lambda n, what: _read_exact(f, n, what))
        end = head + h["payload_bytes"]
        if st.st_size != end:
            raise BadEntry("corrupt", f"is {st.st_size} bytes, its header says {end} (truncated or overwritten)")
        return _Meta(h, tokens, st, head)

    def _ours(self, header: dict) -> bool:
        return header.get("target") == self.target_fingerprint and header.get("draft") == self.draft_fingerprint

    def _report(self, key: tuple[int, int], message: str) -> None:
        """Warn about one file (device, inode) once in this process."""
        if key not in self._warned:
            self._warned.add(key)
            self.warn(message)

    def _discard(self, name: str, bad: BadEntry, meta: _Meta | None) -> None:
        """Remove a bad entry (unless it was replaced by a new file meanwhile) and report it once; what is not
        a regular file there (kind "link") is mended instead."""
        if bad.kind == "link":
            self._mend(name)
            return
        path = self.dir / f"{name}.kv"
        try:
            st = meta.st if meta is not None else os.lstat(path)
        except FileNotFoundError:
            return
        key = (st.st_dev, st.st_ino)
        done = "removed it"
        try:
            with self._locked():
                now = os.lstat(path)
                if (now.st_dev, now.st_ino) == key and stat.S_ISREG(now.st_mode):
                    path.unlink()
        except LockError as e:
            warn_once(self.warn, str(e))
            done = "left it in place"
        except FileNotFoundError:
            pass                                          # gone already
        except OSError as e:
            done = f"cannot remove it ({e.strerror})"
        self._report(key, f"KV cache file {path} {bad}; {done}, the prompt is evaluated from scratch")

    def _mend(self, name: str, held: bool = False) -> bool:
        """Something that is not a regular file sits at an entry's path (a symlink, a FIFO, a directory):
        remove it (a symlink itself, never its target; a directory only if empty) and report it once.
        `held`: the caller holds the lock. Returns whether the path is free for an entry now."""
        path = self.dir / f"{name}.kv"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return True
        if stat.S_ISREG(st.st_mode):
            return True
        what = "is a directory" if stat.S_ISDIR(st.st_mode) else \
            "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a regular file"
        free, done = True, "removed it"
        try:
            with nullcontext() if held else self._locked():
                now = os.lstat(path)
                if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                    remove_file_or_empty_dir(path)
        except LockError as e:
            warn_once(self.warn, str(e))
            free, done = False, "left it in place"
        except FileNotFoundError:
            pass
        except OSError as e:
            free, done = False, f"cannot remove it ({e.strerror}): move it away, until then {name} is not cached"
        self._report((st.st_dev, st.st_ino), f"KV cache file {path} {what}; {done}, the prompt is evaluated "
                                             f"from scratch")
        return free

    # -- writing ----------------------------------------------------------------------------------------------

    def save(self, conv_id: str | None, state: KVState) -> str | None:
        """Enforce the caps counting the new entry and the old one it replaces (evict least recently used
        entries until total bytes <= max_bytes and count <= max_entries; an entry larger than max_bytes alone
        is not kept), then write atomically (temp file in the same dir, fsync, rename, fsync the dir). conv_id
        None names the entry after its tokens. Returns the name, or None (after one warning) if the state was
        too large to keep or could not be written (a full disk, a broken lock)."""
        name = check_conversation_id(conv_id) if conv_id is not None else anon_name(state.tokens)
        header, tok, views = entry_parts(name, state, self.target_fingerprint, self.draft_fingerprint, self.models)
        size = _PREFIX + len(json.dumps(header).encode()) + len(tok) + header["payload_bytes"]
        if size > self.max_bytes:
            self.warn(f"KV state '{name}' ({size / 2**20:.1f} MiB) is larger than the whole KV cache "
                      f"({self.max_bytes / 2**20:.1f} MiB); not saved")
            return None
        try:
            with self._locked():
                if not self._mend(name, held=True):
                    return None
                self._remove_temps()
                self._evict(name, size)
                self._write(name, header, tok, views)
        except LockError as e:
            warn_once(self.warn, str(e))
            return None
        except OSError as e:
            self.warn(f"could not save the KV cache of {name} in {self.dir}: {e.strerror or e}; the next turn "
                      f"evaluates its prompt from scratch")
            return None
        return name

    def _write(self, name: str, header: dict, tok: bytes, views: list[memoryview]) -> None:
        """Write the entry to a temp file and rename it in; called with the lock held and room made."""
        tmp = self.dir / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                raw = json.dumps(header).encode()          # placeholder checksum, same length
                _write_all(f, b"\0" * (_PREFIX + len(raw)) + tok)
                digest = hashlib.sha256()
                _write_hashed(f, views, digest)
                header["payload_sha256"] = digest.hexdigest()
                head = entry_head(header, tok)                   # the tokens are in place already
                os.pwrite(f.fileno(), head[:len(head) - len(tok)], 0)
                self._touch(f.fileno())
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / f"{name}.kv")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._sync_dir()

    def _touch(self, fd: int) -> None:
        now = max(time.time_ns(), self._last_touch + 1)     # distinct, increasing last-use times
        self._last_touch = now
        try:
            os.utime(fd, ns=(now, now))
        except OSError:
            pass                                            # read-only cache: LRU order just goes stale

    def _evict(self, name: str, size: int) -> None:
        """Make room for `size` bytes under `name` before they are written: remove least recently used
        entries until the caps hold with the new file and the old entry both on disk (as they are until the
        rename, or for good if the write fails); if the two do not fit together, the old entry goes first.
        So the caps hold at every moment, crashes included."""
        rows = sorted(self._scan(), key=lambda r: r[1].st_mtime_ns)
        old = sum(st.st_size for n, st in rows if n == name)
        rows = [(n, st) for n, st in rows if n != name]
        if old and old + size > self.max_bytes:             # old and new do not fit together: old goes first,
            (self.dir / f"{name}.kv").unlink(missing_ok=True)   # before any other conversation's entry
            old = 0
        total, count = sum(st.st_size for _, st in rows) + old + size, len(rows) + 1
        for victim, st in rows:
            if total <= self.max_bytes and count <= self.max_entries:
                break
            (self.dir / f"{victim}.kv").unlink(missing_ok=True)
            total, count = total - st.st_size, count - 1

    def _remove_temps(self) -> int:
        """Remove temp files; called with the lock held, when every temp file is a dead writer's."""
        return remove_temp_files(self.dir, ".", ".tmp")

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _locked(self):
        return dir_lock(self.dir)

    # -- listing and housekeeping -----------------------------------------------------------------------------

    def _scan(self) -> list[tuple[str, os.stat_result]]:
        """(name, lstat) of every regular `.kv` file whose name is a valid id; symlinks are not entries. A
        directory removed under a running server holds none (the next locked write makes it again)."""
        rows = []
        try:
            listing = list(os.scandir(self.dir))
        except (FileNotFoundError, NotADirectoryError):
            return rows
        for e in listing:
            if e.name.endswith(".kv") and valid_name(e.name[:-3]):
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    rows.append((e.name[:-3], st))
        return rows

    def _names(self) -> list[str]:
        return [name for name, _ in self._scan()]

    def entries(self) -> list[dict]:
        """name, tokens (count), bytes, last_used, created, target_match, draft_match, problem (or None)."""
        out = []
        for name, st in self._scan():
            row = {"name": name, "tokens": 0, "bytes": st.st_size, "last_used": st.st_mtime_ns / 1e9,
                   "created": None, "target_match": False, "draft_match": False, "problem": None}
            try:
                with self._open(name) as f:
                    h = self._read_meta(f).header
                row.update(tokens=h["n_tokens"], created=h.get("created"),
                           target_match=h.get("target") == self.target_fingerprint,
                           draft_match=h.get("draft") == self.draft_fingerprint)
            except FileNotFoundError:
                continue
            except BadEntry as e:
                row["problem"] = str(e)
            out.append(row)
        return out

    def remove(self, conv_id: str) -> bool:
        """Remove a conversation's entry (or an empty directory, a symlink in its place); False if there is
        none. Raises JllmError for a directory that is not empty, LockError for a broken lock."""
        path = self.dir / f"{check_conversation_id(conv_id)}.kv"
        with self._locked():
            try:
                remove_file_or_empty_dir(path)
            except FileNotFoundError:
                return False
            except OSError as e:
                raise JllmError(f"cannot remove {path} ({e.strerror}): it is a directory, not a KV cache file; "
                                f"move it away") from None
            self._sync_dir()
        return True

    def clear(self) -> int:
        """Remove every entry (of any models) and dead writers' temp files; returns the number of entries."""
        with self._locked():
            self._remove_temps()
            names = [name for name, _ in self._scan()]
            for name in names:
                (self.dir / f"{name}.kv").unlink(missing_ok=True)
            self._sync_dir()
        return len(names)

    def stats(self) -> dict:
        rows = self._scan()
        return {"count": len(rows), "bytes": sum(st.st_size for _, st in rows), "max_bytes": self.max_bytes,
                "max_entries": self.max_entries, "dir": str(self.dir)}
