"""The shared KV tier: the persistent KV store's entries kept in Redis, so that several jllm replicas share
their conversations' states (turn 2 on a replica that never saw turn 1 loads turn 1's state).

An entry is the disk store's entry (store.py, format version 1: header JSON with the models' fingerprints,
n_tokens, the tensors' layout, the payload's sha256; then the token ids; then the payload), split in two:
the head (magic .. token ids, a few KB) in the entry's hash and the payload in chunks of `chunk_bytes`
(4 MiB) under a generation drawn afresh for every write. Keys, all under `prefix` (default `jllm:kv:`, so
that several model pairs, or other applications, share one Redis without cross-talk):

    e:<name>            hash  gen, n (chunk count), meta (the head's bytes), blocks (its prefix hashes), bytes
    c:<name>:<gen>:<i>  string chunk i of that generation's payload
    idx                 hash  prefix hash -> entry name (the last entry written with that prefix; when
                              that entry goes, the prefix is indexed again by the next write sharing it)
    lru                 zset  member -> last use (Redis server time, us, strictly increasing)
    size                hash  member -> bytes (head + payload)
    total, clock        strings: the sum of `size`, the last `lru` score given

A member is an entry's name, or `<name>/<gen>/<n>` for a write in flight (its chunks are being sent).

Writing: reserve room (Lua, atomic: evict least recently used members until the reserved total, this write
and the old entry of the same name included, is <= max_bytes; when the old and the new do not fit together
the old goes first), send the chunks under the new generation, then switch `e:<name>` to it (Lua, atomic:
the old generation's chunks, index fields and accounting go in the same step). Two replicas writing one
conversation at once thus leave one whole entry, the last to switch; a write whose reservation was evicted
meanwhile (a stalled writer) is abandoned. A writer that dies leaves its reservation, which is evicted in
LRU order like any entry, so the cap holds at every moment; its chunks are sent with a TTL of an hour that
the switch removes, so they expire even if nothing evicts them.

Reading: `lookup` is two round trips whatever the number of entries: the prompt's prefix hashes (a chain:
hash i covers blocks 0..i of `block` tokens, seeded with this replica's fingerprints, so another model
pair's entries never match) and the conversation's own entry in one, the candidates' heads in the next; the
common prefix is confirmed from the stored token ids. A prefix shorter than one block is found only under
the conversation's own id. `load` reads the head and the chunks of the generation it names; a chunk that
vanished because the entry was replaced meanwhile is a miss; a chunk missing otherwise, a payload failing its
sha256 or a head that does not parse is reported once and the entry is dropped (deleted); an entry written
for other models, or in another format version, is never used and left alone (a replica of those models or
that jllm owns it; a save under the same name replaces it).

Capacity is jllm's own accounting (`size`, `lru`, eviction in Lua), not Redis `maxmemory`: a shared Redis
may hold other applications' keys, which an LRU policy of the whole server would evict too, and jllm's cap
holds for jllm's entries alone. It counts entry bytes (head + payload), not Redis's own per-key overhead
(about 100 bytes a key). Scripts name keys they build themselves, so this is for a standalone Redis (or a
replicated one), not Redis Cluster.

Faults: Redis unreachable (down at start, killed mid-run, a wrong password) makes every call a miss or a
no-op with one warning per outage; after `retry_s` seconds a later call tries again, so the tier comes back
by itself, with no thread of its own. URLs: redis://[:PASSWORD@]HOST:PORT/DB, rediss:// (TLS), unix://.

Limits: the tier shares KV states, not message histories: `jllm chat --conversation ID` on another machine
finds the state but not the turns it covers (a server's clients send the history, so serve is unaffected).
A save reaches Redis on the engine's background save thread after the local file, so a slow Redis lengthens
that save, which the next turn waits for.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Callable
from urllib.parse import urlsplit

import numpy as np
import torch

from jllm import console
from jllm.cache.store import (_DTYPES, BadEntry, KVState, anon_name, made_by, check_conversation_id,
                              entry_head, entry_parts, read_head, valid_name)
from jllm.errors import JllmError

DEFAULT_PREFIX = "jllm:kv:"
_ORPHAN_TTL_S = 3600                # a write's chunks expire unless committed: a dead writer leaves nothing

# shared by every script: ARGV[1] is the key prefix
_LIB = """
local P = ARGV[1]
local function drop(m)             -- remove a member: an entry or a write in flight, its chunks, its accounting
  local name, gen, n = string.match(m, "^([^/]+)/([^/]+)/(%d+)$")
  if name then
    for i = 0, tonumber(n) - 1 do redis.call('DEL', P .. 'c:' .. name .. ':' .. gen .. ':' .. i) end
  else
    local e = redis.call('HMGET', P .. 'e:' .. m, 'gen', 'n', 'blocks')
    if e[1] then
      for i = 0, tonumber(e[2] or '0') - 1 do redis.call('DEL', P .. 'c:' .. m .. ':' .. e[1] .. ':' .. i) end
      for h in string.gmatch(e[3] or '', '%S+') do
        if redis.call('HGET', P .. 'idx', h) == m then redis.call('HDEL', P .. 'idx', h) end
      end
      redis.call('DEL', P .. 'e:' .. m)
    end
  end
  local s = redis.call('HGET', P .. 'size', m)
  if s then
    redis.call('DECRBY', P .. 'total', s)
    redis.call('HDEL', P .. 'size', m)
  end
  redis.call('ZREM', P .. 'lru', m)
end
local function now()               -- server time in us, strictly increasing: one clock for all replicas
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = tonumber(redis.call('GET', P .. 'clock') or '0')
  if us <= last then us = last + 1 end
  redis.call('SET', P .. 'clock', us)
  return us
end
if redis.replicate_commands then redis.replicate_commands() end   -- Redis 5: TIME before writes
"""

# ARGV: prefix, name, pending member, bytes, max_bytes -> 1 (reserved)
_RESERVE = _LIB + """
local name, pending, size, max = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local total = tonumber(redis.call('GET', P .. 'total') or '0')
local old = tonumber(redis.call('HGET', P .. 'size', name) or '0')
if old > 0 and old + size > max then drop(name); total = total - old end
if total + size > max then
  for _, m in ipairs(redis.call('ZRANGE', P .. 'lru', 0, -1)) do
    if total + size <= max then break end
    if m ~= name then
      total = total - tonumber(redis.call('HGET', P .. 'size', m) or '0')
      drop(m)
    end
  end
end
redis.call('HSET', P .. 'size', pending, size)
redis.call('INCRBY', P .. 'total', size)
redis.call('ZADD', P .. 'lru', now(), pending)
return 1
"""

# ARGV: prefix, name, pending member, gen, chunk count, bytes, head, blocks -> 1, or 0 if the reservation is gone
_COMMIT = _LIB + """
local name, pending = ARGV[2], ARGV[3]
if not redis.call('HGET', P .. 'size', pending) then return 0 end
drop(name)
redis.call('HDEL', P .. 'size', pending)
redis.call('ZREM', P .. 'lru', pending)
redis.call('HSET', P .. 'e:' .. name, 'gen', ARGV[4], 'n', ARGV[5], 'bytes', ARGV[6], 'meta', ARGV[7],
           'blocks', ARGV[8])
redis.call('HSET', P .. 'size', name, ARGV[6])
redis.call('ZADD', P .. 'lru', now(), name)
for i = 0, tonumber(ARGV[5]) - 1 do redis.call('PERSIST', P .. 'c:' .. name .. ':' .. ARGV[4] .. ':' .. i) end
for h in string.gmatch(ARGV[8], '%S+') do redis.call('HSET', P .. 'idx', h, name) end
return 1
"""

# ARGV: prefix, member -> whether it was there
_DROP = _LIB + """
local there = redis.call('ZSCORE', P .. 'lru', ARGV[2]) or redis.call('EXISTS', P .. 'e:' .. ARGV[2]) == 1
drop(ARGV[2])
if there then return 1 end
return 0
"""

# ARGV: prefix, name, gen -> 1 if the entry still had that generation and is dropped
_DROP_IF = _LIB + """
if redis.call('HGET', P .. 'e:' .. ARGV[2], 'gen') ~= ARGV[3] then return 0 end
drop(ARGV[2])
return 1
"""

# ARGV: prefix, name
_TOUCH = _LIB + """
if redis.call('ZSCORE', P .. 'lru', ARGV[2]) then redis.call('ZADD', P .. 'lru', now(), ARGV[2]) end
return 1
"""

# ARGV: prefix -> number of entries removed (writes in flight are removed too, and not counted)
_CLEAR = _LIB + """
local n = 0
for _, m in ipairs(redis.call('ZRANGE', P .. 'lru', 0, -1)) do
  if not string.find(m, '/') then n = n + 1 end
  drop(m)
end
redis.call('DEL', P .. 'idx', P .. 'total')
return n
"""


def check_url(url: str) -> str:
    """Return url if it names a Redis (redis://, rediss://, unix://), else raise JllmError in one line."""
    scheme = urlsplit(url).scheme if isinstance(url, str) else ""
    if scheme not in ("redis", "rediss", "unix"):
        raise JllmError(f"bad KV store URL {_where(url) if isinstance(url, str) else repr(url)}: use "
                        f"redis://[:PASSWORD@]HOST:PORT/DB, rediss://... for TLS or unix:///PATH")
    return url


def _where(url: str) -> str:
    """The URL without its password, for messages."""
    u = urlsplit(url)
    if not u.scheme or not (u.netloc or u.path.startswith("/")):     # not a URL: as given, less any password
        return url if "@" not in url else "…@" + url.rsplit("@", 1)[1]
    host = u.hostname or ""
    return f"{u.scheme}://{host}{f':{u.port}' if u.port else ''}{u.path}"


def _chunked(views: list[memoryview], size: int):
    """The buffers in order, cut into views of at most `size` bytes (a chunk never spans two buffers)."""
    for view in views:
        for s in range(0, len(view), size):
            yield view[s:s + size]


class RedisTier:
    """Entries of one model pair (target, optional draft) in a Redis shared by several replicas; the same
    calls as KVStore (lookup, load, save, entries, remove, clear, stats), every one a miss or a no-op while
    Redis is unreachable."""

    def __init__(self, url: str, max_bytes: int = 4 << 30, target_fingerprint: str = "",
                 draft_fingerprint: str | None = None, warn: Callable[[str], None] = console.warn,
                 prefix: str = DEFAULT_PREFIX, retry_s: float = 5.0, chunk_bytes: int = 4 << 20,
                 block: int = 256, timeout_s: float = 5.0, models: str = ""):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise JllmError("the shared KV tier needs the redis client: pip install 'jllm[redis]'") from None
        if max_bytes <= 0 or chunk_bytes <= 0 or block <= 0:
            raise JllmError(f"shared KV tier: the cap, chunk and block sizes must be positive (got {max_bytes}, "
                            f"{chunk_bytes}, {block})")
        if not isinstance(prefix, str) or not prefix or any(c.isspace() for c in prefix):
            raise JllmError(f"shared KV tier: the key prefix {prefix!r} must be a non-empty string without spaces")
        self.where = _where(check_url(url))
        try:
            # no retries of its own: a miss now beats a stalled turn, and _guard retries after retry_s
            self.r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=min(timeout_s, 2.0),
                                          retry=Retry(NoBackoff(), 0))
        except (ValueError, TypeError, AttributeError) as e:
            raise JllmError(f"bad KV store URL {self.where}: {e} (use redis://[:PASSWORD@]HOST:PORT/DB, "
                            f"rediss://... for TLS or unix:///PATH)") from None
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._response_error = redis.exceptions.ResponseError
        self.max_bytes, self.prefix, self.retry_s = max_bytes, prefix, retry_s
        self.chunk_bytes, self.block = chunk_bytes, block
        self.target_fingerprint, self.draft_fingerprint = target_fingerprint, draft_fingerprint
        self.models = models
        self.warn = warn
        self._seed = hashlib.sha256(f"jllm-kv-prefix {target_fingerprint} {draft_fingerprint}".encode()).digest()
        self._reserve, self._commit = self.r.register_script(_RESERVE), self.r.register_script(_COMMIT)
        self._drop, self._drop_if = self.r.register_script(_DROP), self.r.register_script(_DROP_IF)
        self._touch, self._clear = self.r.register_script(_TOUCH), self.r.register_script(_CLEAR)
        self._down_until = 0.0            # monotonic time before which no call goes to Redis
        self._down = False                # an outage has been reported and not yet ended
        self._warned: set = set()         # entries (name, gen) and server errors already reported

    # -- faults -----------------------------------------------------------------------------------------------

    def _guard(self, fn: Callable, default):
        """fn(), or `default` while Redis is unreachable: one warning per outage, a new try after retry_s."""
        if time.monotonic() < self._down_until:
            return default
        try:
            out = fn()
        except self._errors as e:
            self._down_until = time.monotonic() + self.retry_s
            if not self._down:
                self._down = True
                self.warn(f"the shared KV tier {self.where} is unreachable ({e}); turns go on without it, "
                          f"retrying every {self.retry_s:g} s")
            return default
        except self._response_error as e:  # the server refuses (out of memory, a key of another type)
            self._report(("error", str(e).split(" ")[0]), f"the shared KV tier {self.where} refused a command "
                                                          f"({e}); that call went without it")
            return default
        if self._down:
            self._down = False
            self.warn(f"the shared KV tier {self.where} is reachable again")
        return out

    def _report(self, key, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.warn(message)

    def _bad(self, name: str, gen: bytes, bad: BadEntry) -> None:
        """Drop a bad entry (unless it was replaced meanwhile) and report it once; one of another format
        version is only a miss (a replica of another jllm version, mid-upgrade, owns it)."""
        if bad.kind == "version":
            self._report((name, gen), f"shared KV entry {name} in {self.where} {bad}; left for the jllm that "
                                      f"wrote it, the prompt is evaluated from scratch")
            return
        dropped = self._drop_if(args=[self.prefix, name, gen])
        self._report((name, gen), f"shared KV entry {name} in {self.where} {bad}; "
                                  f"{'dropped it' if dropped else 'it was replaced meanwhile'}, "
                                  f"the prompt is evaluated from scratch")

    # -- keys and hashes --------------------------------------------------------------------------------------

    def _e(self, name: str) -> str:
        return f"{self.prefix}e:{name}"

    def _c(self, name: str, gen: str, i: int) -> str:
        return f"{self.prefix}c:{name}:{gen}:{i}"

    def _blocks(self, tokens: np.ndarray) -> list[str]:
        """Chained hashes of the full blocks: hash i covers tokens[: (i + 1) * block]."""
        raw = tokens.astype("<i4").tobytes()
        step, h, out = 4 * self.block, self._seed, []
        for s in range(0, len(raw) - step + 1, step):
            h = hashlib.sha256(h + raw[s:s + step]).digest()[:16]
            out.append(h.hex())
        return out

    def _ours(self, header: dict) -> bool:
        return header.get("target") == self.target_fingerprint and header.get("draft") == self.draft_fingerprint

    @staticmethod
    def _parse(meta: bytes) -> tuple[dict, np.ndarray]:
        """The head's header and token ids; BadEntry when it is not a whole, valid head."""
        pos = 0

        def read(n: int, what: str) -> bytes:
            nonlocal pos
            part = meta[pos:pos + n]
            if len(part) != n:
                raise BadEntry("corrupt", f"is truncated (in the {what})")
            pos += n
            return part

        h, tokens, end = read_head(read)
        if end != len(meta):
            raise BadEntry("corrupt", f"has a head of {len(meta)} bytes, its header says {end}")
        return h, tokens

    # -- reading ----------------------------------------------------------------------------------------------

    def lookup(self, tokens: list[int], conv_id: str | None = None) -> tuple[str | None, int]:
        """Best entry for this prompt and its common prefix length, as KVStore.lookup: the conversation's own
        entry, or the entry with the longest common prefix among those sharing at least one block."""
        if conv_id is not None:
            check_conversation_id(conv_id)
        want = np.asarray(tokens, dtype=np.int64)
        return self._guard(lambda: self._lookup(want, conv_id), (None, 0))

    def _lookup(self, want: np.ndarray, conv_id: str | None) -> tuple[str | None, int]:
        hashes = self._blocks(want)
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(f"{self.prefix}idx", hashes) if hashes else pipe.echo(b"")
        pipe.hmget(self._e(conv_id), "gen", "meta") if conv_id is not None else pipe.echo(b"")
        hits, own = pipe.execute()
        names: list[str] = []
        for raw in reversed(hits or []):            # deepest shared block first; a few distinct entries
            name = raw.decode() if raw else None
            if name and name != conv_id and name not in names and valid_name(name):
                names.append(name)
                if len(names) == 3:
                    break
        rows = []
        if conv_id is not None and isinstance(own, list) and own[0] is not None:
            rows.append((conv_id, own[0], own[1]))
        if names:
            pipe = self.r.pipeline(transaction=False)
            for name in names:
                pipe.hmget(self._e(name), "gen", "meta")
            rows += [(name, gen, meta) for name, (gen, meta) in zip(names, pipe.execute()) if gen is not None]
        best: tuple[str | None, int] = (None, 0)
        for name, gen, meta in rows:
            n = self._common(name, gen, meta, want, own=name == conv_id)
            if n > best[1]:
                best = (name, n)
        return best

    def _common(self, name: str, gen: bytes, meta: bytes | None, want: np.ndarray, own: bool) -> int:
        try:
            h, have = self._parse(meta or b"")
        except BadEntry as e:
            self._bad(name, gen, e)
            return 0
        if not self._ours(h):
            if own:
                self._report((name, gen), f"shared KV entry {name} in {self.where} was written for other models "
                                          f"({made_by(h)}); the prompt is evaluated from scratch and this "
                                          f"conversation's state replaces it")
            return 0
        have = have[:len(want)]
        diff = np.flatnonzero(have != want[:len(have)])
        return int(diff[0]) if len(diff) else len(have)

    def load(self, name: str, n_tokens: int | None = None) -> KVState | None:
        """The entry's first n_tokens positions (all with None), payload checked against its sha256; None
        for a miss (gone, replaced meanwhile, shorter, other models, Redis unreachable) or a bad entry
        (reported once and dropped). Marks the entry used (LRU)."""
        if not valid_name(name):
            raise JllmError(f"invalid KV cache entry name {name[:40]!r}")
        return self._guard(lambda: self._load(name, n_tokens), None)

    def _load(self, name: str, n_tokens: int | None) -> KVState | None:
        gen, n_chunks, meta = self.r.hmget(self._e(name), "gen", "n", "meta")
        if gen is None:
            return None
        try:
            h, tokens = self._parse(meta or b"")
            if not self._ours(h):
                return None                           # another model pair's: never used, left to its owner
            n = h["n_tokens"] if n_tokens is None else n_tokens
            if n < 0:
                raise ValueError(f"{name}: asked for {n} positions")
            if n > h["n_tokens"]:
                return None                           # replaced by a shorter state since lookup: a miss
            if h["payload_bytes"] > self.max_bytes:
                return None                           # more than this replica keeps at all: not allocated
            payload = self._read_payload(name, gen.decode(), int(n_chunks or 0), h)
            if payload is None:
                return None
        except BadEntry as e:
            self._bad(name, gen, e)
            return None
        self._touch(args=[self.prefix, name])
        tensors, off = {}, 0
        for t in h["tensors"]:
            dtype = _DTYPES[t["dtype"]]
            nbytes = int(np.prod(t["shape"])) * dtype.itemsize
            part = payload[off:off + nbytes]
            if off % dtype.itemsize:                  # a view needs an aligned start
                part = part.clone()
            tensors[t["name"]] = part.view(dtype).reshape(t["shape"])[:, :, :n]
            off += nbytes
        return KVState(tokens=tokens[:n].tolist(), target_k=tensors["target_k"], target_v=tensors["target_v"],
                       draft_k=tensors.get("draft_k"), draft_v=tensors.get("draft_v"))

    def _read_payload(self, name: str, gen: str, n_chunks: int, h: dict) -> torch.Tensor | None:
        """The payload's bytes [payload_bytes] uint8, checked; None if the entry was replaced while read."""
        size = h["payload_bytes"]
        payload = torch.empty(size, dtype=torch.uint8)
        buf, digest, pos = memoryview(payload.numpy()), hashlib.sha256(), 0
        per_call = max(1, (32 << 20) // self.chunk_bytes)          # ~32 MiB a round trip
        for s in range(0, n_chunks, per_call):
            keys = [self._c(name, gen, i) for i in range(s, min(n_chunks, s + per_call))]
            for value in self.r.mget(keys):
                if value is None:
                    if self.r.hget(self._e(name), "gen") != gen.encode():
                        return None                   # replaced (or removed) while read: a miss
                    raise BadEntry("corrupt", "misses a chunk of its payload")
                if pos + len(value) > size:
                    raise BadEntry("corrupt", f"has more than the {size} payload bytes its header says")
                buf[pos:pos + len(value)] = value
                digest.update(value)
                pos += len(value)
        if pos != size:
            raise BadEntry("corrupt", f"has {pos} payload bytes, its header says {size}")
        if digest.hexdigest() != h["payload_sha256"]:
            raise BadEntry("corrupt", "fails its payload checksum")
        return payload

    # -- writing ----------------------------------------------------------------------------------------------

    def save(self, conv_id: str | None, state: KVState) -> str | None:
        """Store the state under conv_id (or a name from its tokens), replacing the conversation's entry in
        one step; evicts least recently used entries of this prefix to stay under max_bytes. Returns the
        name, or None (one warning) when it is larger than the whole tier, or Redis is unreachable."""
        name = check_conversation_id(conv_id) if conv_id is not None else anon_name(state.tokens)
        header, tok, views = entry_parts(name, state, self.target_fingerprint, self.draft_fingerprint, self.models)
        if time.monotonic() < self._down_until:
            return None                               # unreachable: no need to hash the payload
        digest = hashlib.sha256()
        for v in views:
            digest.update(v)
        header["payload_sha256"] = digest.hexdigest()
        head = entry_head(header, tok)
        size = len(head) + header["payload_bytes"]
        if size > self.max_bytes:
            self.warn(f"KV state '{name}' ({size / 2**20:.1f} MiB) is larger than the whole shared KV tier "
                      f"({self.max_bytes / 2**20:.1f} MiB); not saved there")
            return None
        blocks = " ".join(self._blocks(np.asarray(state.tokens, dtype=np.int64)))
        return self._guard(lambda: self._save(name, head, views, size, blocks), None)

    def _save(self, name: str, head: bytes, views: list[memoryview], size: int, blocks: str) -> str | None:
        gen = secrets.token_hex(8)
        chunks = list(_chunked([v for v in views if len(v)], self.chunk_bytes))
        pending = f"{name}/{gen}/{len(chunks)}"
        self._reserve(args=[self.prefix, name, pending, size, self.max_bytes])
        try:
            pipe = self.r.pipeline(transaction=False)
            for i, chunk in enumerate(chunks):
                pipe.set(self._c(name, gen, i), chunk, ex=_ORPHAN_TTL_S)   # until the commit keeps them
            pipe.execute()
            done = self._commit(args=[self.prefix, name, pending, gen, len(chunks), size, head, blocks])
        except BaseException:
            try:                                      # give the room back; if Redis is gone, LRU will
                self._drop(args=[self.prefix, pending])
            except self._errors:
                pass
            raise
        if not done:                                  # evicted while written (chunks went with it)
            self._drop(args=[self.prefix, pending])
            return None
        return name

    # -- listing and housekeeping -----------------------------------------------------------------------------

    def entries(self) -> list[dict]:
        """As KVStore.entries, for this prefix's entries (writes in flight are not entries)."""
        return self._guard(self._entries, [])

    def _entries(self) -> list[dict]:
        members = [(m.decode(), score) for m, score in self.r.zrange(f"{self.prefix}lru", 0, -1, withscores=True)]
        members = [(m, score) for m, score in members if "/" not in m]
        pipe = self.r.pipeline(transaction=False)
        for m, _ in members:
            pipe.hmget(self._e(m), "meta", "bytes")
        out = []
        for (name, score), (meta, size) in zip(members, pipe.execute()):
            if meta is None:
                continue
            row = {"name": name, "tokens": 0, "bytes": int(size or 0), "last_used": score / 1e6,
                   "created": None, "target_match": False, "draft_match": False, "problem": None}
            try:
                h, _ = self._parse(meta)
                row.update(tokens=h["n_tokens"], created=h.get("created"),
                           target_match=h.get("target") == self.target_fingerprint,
                           draft_match=h.get("draft") == self.draft_fingerprint)
            except BadEntry as e:
                row["problem"] = str(e)
            out.append(row)
        return out

    def remove(self, conv_id: str) -> bool:
        """Remove a conversation's entry; False if there is none (or Redis is unreachable)."""
        name = check_conversation_id(conv_id)
        return bool(self._guard(lambda: self._drop(args=[self.prefix, name]), 0))

    def clear(self) -> int:
        """Remove every entry under this prefix (of any models); returns how many."""
        return int(self._guard(lambda: self._clear(args=[self.prefix]), 0))

    def stats(self) -> dict:
        def read():
            pipe = self.r.pipeline(transaction=False)
            pipe.get(f"{self.prefix}total")
            pipe.zrange(f"{self.prefix}lru", 0, -1)
            total, members = pipe.execute()
            return {"count": sum(b"/" not in m for m in members), "bytes": int(total or 0), "reachable": True}
        got = self._guard(read, None) or {"count": 0, "bytes": 0, "reachable": False}
        return {**got, "max_bytes": self.max_bytes, "url": self.where, "prefix": self.prefix}
