"""jllm.cache.store: the on-disk KV store, on real files in tmp_path with small random tensors.

Corruption is made by editing the files the store wrote; crashes by SIGKILLing writer processes forked by
tests/kv_writer_child.py at seeded random moments.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from jllm.cache.store import FORMAT_VERSION, KVState, KVStore, check_conversation_id, model_fingerprint
from jllm.errors import JllmError
from kv_writer_child import FINGERPRINT, state_for


def make_state(tokens: list[int], draft: bool = False, seed: int = 0, dtype=torch.float32) -> KVState:
    g = torch.Generator().manual_seed(seed)
    n = len(tokens)
    k, v = (torch.randn(3, 2, n, 16, generator=g).to(dtype) for _ in range(2))
    dk, dv = (torch.randn(2, 1, n, 8, generator=g) for _ in range(2)) if draft else (None, None)
    return KVState(list(tokens), k, v, dk, dv)


def assert_same(got: KVState, want: KVState, n: int) -> None:
    assert got.tokens == want.tokens[:n]
    for name in ("target_k", "target_v", "draft_k", "draft_v"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None
        else:
            assert a.dtype == b.dtype and torch.equal(a, b[:, :, :n]), name


class Warnings(list):
    def __call__(self, message: str) -> None:
        assert "\n" not in message
        self.append(message)


@pytest.fixture
def warns() -> Warnings:
    return Warnings()


@pytest.fixture
def store(tmp_path, warns) -> KVStore:
    return KVStore(tmp_path / "kv", target_fingerprint="T", warn=warns)


def entry_size(state: KVState, name: str = "x") -> int:
    """Bytes the store writes for `state`, measured by saving it in a scratch store."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        KVStore(d, target_fingerprint="T").save(name, state)
        return os.path.getsize(Path(d) / f"{name}.kv")


# --- round trip and lookup -----------------------------------------------------------------------------------

@pytest.mark.parametrize("draft", [False, True])
def test_round_trip_is_bitwise(tmp_path, warns, draft):
    store = KVStore(tmp_path, target_fingerprint="T", draft_fingerprint="D" if draft else None, warn=warns)
    state = make_state(list(range(100, 150)), draft=draft, seed=1)
    store.save("conv-1", state)
    assert store.lookup(state.tokens, "conv-1") == ("conv-1", 50)
    assert_same(store.load("conv-1", 50), state, 50)
    assert_same(store.load("conv-1", 17), state, 17)               # first n positions
    assert_same(store.load("conv-1", 0), state, 0)
    assert store.load("conv-1", 51) is None                        # replaced by a shorter state: a miss
    assert warns == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_round_trip(store, dtype):
    state = make_state([5, 6, 7, 8], dtype=dtype)
    store.save("h", state)
    assert_same(store.load("h", 4), state, 4)


def test_prefix_lookup_by_id_and_by_longest_prefix(store, warns):
    system = list(range(1000, 1040))                                # a shared system prompt
    store.save("alice", make_state(system + [1, 2, 3, 4, 5], seed=1))
    store.save("bob", make_state(system + [7, 8], seed=2))
    store.save(None, make_state(system[:10], seed=3))               # prompt-only entry
    assert store.lookup(system + [1, 2, 3, 9], "alice") == ("alice", 43)
    assert store.lookup(system + [7, 8, 9], None) == ("bob", 42)
    assert store.lookup(system + [7, 8, 9], "alice") == ("bob", 42)  # the conv entry shares less
    assert store.lookup(system + [1, 2], "carol") == ("alice", 42)   # no entry for carol: shared prompt
    assert store.lookup(system + [1, 2, 3], "bob") == ("alice", 43)
    assert store.lookup(system[:5], "bob") == ("bob", 5)             # ties prefer the conversation
    assert store.lookup([99, 98], "alice") == (None, 0)
    assert store.lookup([], None) == (None, 0)
    anon = [e["name"] for e in store.entries() if e["name"].startswith("anon-")]
    assert len(anon) == 1 and store.lookup(system[:10] + [0], None) in {("alice", 10), ("bob", 10), (anon[0], 10)}
    assert warns == []


def test_lookup_reads_only_headers(store, monkeypatch):
    state = make_state(list(range(30)))
    store.save("c", state)
    import jllm.cache.store as mod

    monkeypatch.setattr(mod, "_read_hashed", lambda *a: pytest.fail("lookup read the payload"))
    assert store.lookup(list(range(40)), None) == ("c", 30)


def test_anonymous_names_follow_the_tokens(store):
    a = store.save(None, make_state([1, 2, 3]))
    b = store.save(None, make_state([1, 2, 3], seed=5))
    c = store.save(None, make_state([1, 2, 4]))
    assert a == b != c and a.startswith("anon-")
    assert store.stats()["count"] == 2


def test_new_instance_sees_existing_entries(tmp_path, warns):
    KVStore(tmp_path, target_fingerprint="T").save("old", make_state([4, 5, 6], seed=9))
    again = KVStore(tmp_path, target_fingerprint="T", warn=warns)
    assert again.lookup([4, 5, 6, 7], None) == ("old", 3)
    assert_same(again.load("old", 3), make_state([4, 5, 6], seed=9), 3)
    (row,) = again.entries()
    assert row["name"] == "old" and row["tokens"] == 3 and row["target_match"] and row["draft_match"]
    assert row["bytes"] == os.path.getsize(tmp_path / "old.kv") and row["problem"] is None
    assert again.stats() == {"count": 1, "bytes": row["bytes"], "max_bytes": 1 << 30, "max_entries": 256,
                             "dir": str(tmp_path)}


def test_remove_and_clear(store, tmp_path):
    for name in ("a", "b", "c"):
        store.save(name, make_state([1, 2]))
    assert store.remove("b") and not store.remove("b")
    (tmp_path / "kv" / "conversations").mkdir()                     # the CLI keeps histories beside
    assert store.clear() == 2 and store.entries() == [] and (tmp_path / "kv" / "conversations").is_dir()


# --- LRU caps ------------------------------------------------------------------------------------------------

def test_size_cap_evicts_least_recently_used(tmp_path, warns):
    state = make_state(list(range(20)))
    size = entry_size(state, "e0")
    store = KVStore(tmp_path, max_bytes=3 * size, target_fingerprint="T", warn=warns)
    for i in range(3):
        store.save(f"e{i}", make_state(list(range(20)), seed=i))
    assert store.load("e0", 20) is not None                         # e0 is now the most recently used
    store.save("e3", state)
    assert sorted(e["name"] for e in store.entries()) == ["e0", "e2", "e3"]  # e1, not the oldest e0
    assert store.stats()["bytes"] <= 3 * size
    store.save("big", make_state(list(range(36))))                  # ~1.8 slots: evicts e2, then e0
    assert sorted(e["name"] for e in store.entries()) == ["big", "e3"]
    assert store.stats()["bytes"] <= 3 * size
    store.save("huge", make_state(list(range(100))))                 # larger than the cap alone: not kept
    assert "huge" not in {e["name"] for e in store.entries()} and len(warns) == 1
    assert "larger than the whole KV cache" in warns[0]


def test_entry_cap_and_restart_keep_last_use_order(tmp_path):
    store = KVStore(tmp_path, max_entries=3, target_fingerprint="T")
    for name in ("a", "b", "c"):
        store.save(name, make_state([1, 2, 3]))
    store.load("a", 3)
    store.load("b", 1)
    later = KVStore(tmp_path, max_entries=3, target_fingerprint="T")  # a new process, same directory
    later.save("d", make_state([4]))
    assert sorted(e["name"] for e in later.entries()) == ["a", "b", "d"]
    later.load("a", 3)
    later.save("e", make_state([5]))
    assert sorted(e["name"] for e in later.entries()) == ["a", "d", "e"]


def test_a_big_rewrite_drops_its_own_old_entry_before_other_conversations(tmp_path):
    small, big = make_state(list(range(10))), make_state(list(range(60)))
    cap = 2 * entry_size(small, "a") + entry_size(big, "big") + entry_size(big, "big") // 2
    store = KVStore(tmp_path, max_bytes=cap, target_fingerprint="T")
    for name, state in (("a", small), ("b", small), ("big", big)):
        store.save(name, state)
    store.save("big", make_state(list(range(64))))      # old + new over the cap; new + the others within it
    assert sorted(e["name"] for e in store.entries()) == ["a", "b", "big"]
    assert sum(e["bytes"] for e in store.entries()) <= cap


def test_cap_holds_before_the_new_file_is_renamed_in(tmp_path, monkeypatch):
    state = make_state(list(range(20)))
    cap = 2 * entry_size(state, "e0") + 50
    store = KVStore(tmp_path, max_bytes=cap, target_fingerprint="T")
    store.save("e0", state)
    store.save("e1", state)

    def crash(src, dst):                       # the writer dies after writing its temp file
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.save("e2", state)
    assert [e["name"] for e in store.entries()] == ["e1"]          # room was made first
    with pytest.raises(KeyboardInterrupt):
        store.save("e1", state)                # rewriting: the old entry and the new file both fit
    assert sorted(os.listdir(tmp_path)) == [".lock", "e1.kv"]
    with pytest.raises(KeyboardInterrupt):
        store.save("e1", make_state(list(range(25))))              # they do not fit together: the old goes
    assert sorted(os.listdir(tmp_path)) == [".lock"]


def test_foreign_entries_count_toward_the_cap(tmp_path):
    state = make_state(list(range(20)))
    size = entry_size(state)
    KVStore(tmp_path, target_fingerprint="other").save("theirs", state)
    mine = KVStore(tmp_path, max_bytes=2 * size + 100, target_fingerprint="T")  # 100: longer names
    mine.save("m1", state)
    mine.save("m2", state)
    assert sorted(e["name"] for e in mine.entries()) == ["m1", "m2"]


# --- damaged and foreign files -------------------------------------------------------------------------------

def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    hlen = int.from_bytes(data[12:16], "little")
    if how == "truncated":
        data = data[:len(data) - 100]
    elif how == "payload byte":
        data[-37] ^= 0x10
    elif how == "header byte":
        i = 48 + data[48:48 + hlen].index(b'"n_tokens"') + 13      # a digit of the token count
        data[i] ^= 0x01
    elif how == "token byte":
        data[48 + hlen + 2] ^= 0x01
    elif how == "version":
        data[8:12] = (FORMAT_VERSION + 1).to_bytes(4, "little")
    elif how == "magic":
        data[0] ^= 0xFF
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "payload byte", "header byte", "token byte", "version", "magic",
                                 "empty"])
def test_damaged_file_is_reported_once_removed_and_not_used(store, warns, how):
    state = make_state(list(range(60)))
    store.save("c", state)
    path = store.dir / "c.kv"
    _damage(path, how)
    if how == "payload byte":                  # lookup cannot see it: load finds it
        assert store.lookup(state.tokens, "c") == ("c", 60)
    assert store.load("c", 60) is None
    assert store.lookup(state.tokens, "c") == (None, 0)
    assert store.load("c", 60) is None
    assert not path.exists()
    assert len(warns) == 1 and str(path) in warns[0] and "removed" in warns[0], warns
    store.save("c", state)                     # recomputed state is saved again and used
    assert_same(store.load("c", 60), state, 60)


@pytest.mark.parametrize("how", ["truncated", "header byte", "version"])
def test_lookup_reports_and_removes_damaged_headers(store, warns, how):
    store.save("c", make_state(list(range(60))))
    _damage(store.dir / "c.kv", how)
    assert store.lookup(list(range(60)), None) == (None, 0)
    assert not (store.dir / "c.kv").exists() and len(warns) == 1


def test_foreign_file_skipped_by_lookup_refused_by_load(tmp_path, warns):
    state = make_state(list(range(10)), draft=True)
    KVStore(tmp_path, target_fingerprint="other", draft_fingerprint="D").save("c", state)
    KVStore(tmp_path, target_fingerprint="T", draft_fingerprint="D2").save("d", state)
    store = KVStore(tmp_path, target_fingerprint="T", draft_fingerprint="D", warn=warns)
    assert store.lookup(state.tokens, None) == (None, 0)
    assert (tmp_path / "c.kv").exists() and warns == []             # found by prefix: someone else's, left alone
    assert store.lookup(state.tokens, "c") == (None, 0)              # under its own id: reported, once
    assert store.lookup(state.tokens, "c") == (None, 0)
    assert len(warns) == 1 and "c.kv was written for other models (target other, draft D)" in warns[0]
    assert "replaces it" in warns[0]
    rows = {e["name"]: e for e in store.entries()}
    assert not rows["c"]["target_match"] and rows["d"]["target_match"] and not rows["d"]["draft_match"]
    store.save("c", state)                                           # and replaced by this conversation's state
    assert_same(store.load("c", 10), state, 10)
    assert len(warns) == 1
    store.lookup(state.tokens, "d")
    assert store.load("d", 10) is None                               # load refuses (and removes) a foreign one
    assert len(warns) == 2 and "other models" in warns[1] and not (tmp_path / "d.kv").exists()


def test_a_directory_or_fifo_at_an_entry_path_is_reported_once_and_removed(store, warns):
    (store.dir / "d.kv").mkdir()
    os.mkfifo(store.dir / "f.kv")
    assert store.lookup([1], None) == (None, 0) and store.entries() == [] and warns == []   # not entries
    for _ in range(2):
        assert store.lookup([1], "d") == (None, 0) and store.load("f", 1) is None   # without blocking on the fifo
    assert len(warns) == 2 and "d.kv is a directory; removed it" in warns[0], warns
    assert "f.kv is not a regular file; removed it" in warns[1]
    assert sorted(os.listdir(store.dir)) == [".lock"]
    store.save("d", make_state([1]))                                 # the conversation is cached again
    assert_same(store.load("d", 1), make_state([1]), 1) and len(warns) == 2


def test_a_directory_that_is_not_empty_is_reported_once_and_left_uncached(store, warns):
    (store.dir / "d.kv" / "keep").mkdir(parents=True)
    for _ in range(3):                                               # every turn of this process
        assert store.lookup([1], "d") == (None, 0)
        assert store.save("d", make_state([1])) is None
    assert len(warns) == 1 and "d.kv is a directory; cannot remove it" in warns[0] and "move it away" in warns[0]
    assert store.save("e", make_state([1])) == "e" and len(warns) == 1   # other conversations are cached
    with pytest.raises(JllmError, match="d.kv .*move it away"):
        store.remove("d")
    assert store.clear() == 1 and sorted(os.listdir(store.dir)) == [".lock", "d.kv"]
    (store.dir / "d.kv" / "keep").rmdir()
    assert store.remove("d") and not store.remove("d")              # an empty one `jllm cache rm` removes


def test_file_vanishing_is_a_quiet_miss(store, warns):
    store.save("c", make_state([1, 2, 3]))
    name, n = store.lookup([1, 2, 3], None)
    os.unlink(store.dir / "c.kv")                                   # another process evicted it
    assert store.load(name, n) is None and warns == []


def test_directory_removed_under_a_running_store_is_made_again(store, warns):
    import shutil
    store.save("c", make_state([1, 2, 3]))
    shutil.rmtree(store.dir)                                        # a user cleaning up under a server
    assert store.lookup([1, 2, 3], "c") == (None, 0) and store.entries() == []
    store.save("c", make_state([1, 2, 3]))
    assert store.lookup([1, 2, 3], "c") == ("c", 3) and warns == []
    shutil.rmtree(store.dir)
    store.dir.write_bytes(b"")                                      # and a file in its place: a miss, and
    assert store.lookup([1, 2, 3], "c") == (None, 0)                # saving fails as a full disk does:
    assert store.save("c", make_state([1, 2, 3])) is None           # one warning
    assert len(warns) == 1 and "could not save the KV cache of c" in warns[0]


def test_stale_temp_files_are_cleaned_and_not_counted(store):
    stale = store.dir / ".c.12345.deadbeef.tmp"
    stale.write_bytes(b"x" * 5000)
    assert store.stats() == {**store.stats(), "count": 0, "bytes": 0}
    store.save("c", make_state([1]))
    assert not stale.exists() and sorted(os.listdir(store.dir)) == [".lock", "c.kv"]


# --- untrusted ids and symlinks ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["../../etc/passwd", "a/b", "..", "", "x" * 200, ".hidden", "a..b", "-x",
                                 "a\nb", "a b", "é", "a\0b", "/abs"])
def test_unsafe_ids_are_refused(store, bad):
    with pytest.raises(JllmError, match="invalid conversation id") as e:
        check_conversation_id(bad)
    assert "\n" not in str(e.value).replace(repr(bad), "")
    for call in (lambda: store.save(bad, make_state([1])), lambda: store.lookup([1], bad),
                 lambda: store.load(bad, 1), lambda: store.remove(bad)):
        with pytest.raises(JllmError):
            call()
    assert os.listdir(store.dir) in ([], [".lock"])


def test_good_ids_are_accepted():
    for good in ("a", "Z9", "chat-2024_01.v2", "x" * 128, "0"):
        assert check_conversation_id(good) == good


def test_symlink_entry_is_not_followed(store, warns, tmp_path):
    outside = tmp_path / "outside.kv"
    KVStore(tmp_path / "elsewhere", target_fingerprint="T").save("x", make_state([1, 2, 3]))
    os.rename(tmp_path / "elsewhere" / "x.kv", outside)             # a valid entry, outside the cache dir
    secret = outside.read_bytes()
    (store.dir / "x.kv").symlink_to(outside)
    assert store.lookup([1, 2, 3], "x") == (None, 0)
    assert store.lookup([1, 2, 3], None) == (None, 0)
    assert store.entries() == [] and store.stats()["count"] == 0
    assert store.load("x", 3) is None and "symbolic link" in warns[0]
    (store.dir / "x.kv").unlink(missing_ok=True)
    (store.dir / "x.kv").symlink_to(outside)
    store.save("x", make_state([7]))                                # replaces the link, not its target
    assert not (store.dir / "x.kv").is_symlink() and outside.read_bytes() == secret
    store.clear()
    assert outside.read_bytes() == secret


# --- crashes and concurrent writers --------------------------------------------------------------------------

def check_directory(directory: Path, cap: int) -> int:
    """Every entry loads bitwise-correct; returns the number of entries. Fails on any corrupt one."""
    warns = Warnings()
    store = KVStore(directory, max_bytes=cap, target_fingerprint=FINGERPRINT,
                    draft_fingerprint=FINGERPRINT + "-draft", warn=warns)
    assert store.stats()["bytes"] <= cap
    rows = store.entries()
    for row in rows:
        got = store.load(row["name"], row["tokens"])
        assert got is not None, warns
        assert_same(got, state_for(got.tokens[0]), row["tokens"])
    assert warns == []
    return len(rows)


def test_kill_9_during_saves_never_leaves_a_bad_entry(tmp_path, writers):
    cap = 4 << 20
    rng = random.Random(1234)
    interrupted = 0
    for i in range(30):
        pid = writers("spawn", tmp_path, cap, i, 0)
        time.sleep(rng.uniform(0.002, 0.06))
        os.kill(pid, signal.SIGKILL)
        assert writers("wait", pid) == -signal.SIGKILL
        interrupted += any(name.endswith(".tmp") for name in os.listdir(tmp_path))
        check_directory(tmp_path, cap)
    assert interrupted >= 3                                        # the kills did land inside saves
    pid = writers("spawn", tmp_path, cap, 99, 1)                    # the next save cleans up after them
    assert writers("wait", pid) == 0
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]
    assert check_directory(tmp_path, cap) >= 1


def test_two_processes_share_a_directory(tmp_path, writers):
    cap = 3 << 20
    pids = [writers("spawn", tmp_path, cap, seed, 25) for seed in (1, 2)]
    assert [writers("wait", pid) for pid in pids] == [0, 0]
    n = check_directory(tmp_path, cap)
    assert 1 <= n <= 6
    assert sorted(os.listdir(tmp_path)) == sorted([".lock"] + [e["name"] + ".kv" for e in
                                                               KVStore(tmp_path).entries()])


# --- model fingerprints --------------------------------------------------------------------------------------

def test_fingerprint_of_a_small_gguf_sees_data_and_precision(tmp_path):
    import gguf
    import numpy as np

    from jllm.gguf.reader import read_gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for name in ("a", "b", "c"):
        w.add_tensor(name, rng.standard_normal((64, 64)).astype(np.float32))   # 16 KiB: a middle is unsampled
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    base = model_fingerprint(read_gguf(path), "f32")
    assert base == model_fingerprint(read_gguf(path), "f32") and len(base) == 32
    assert base != model_fingerprint(read_gguf(path), "int8")
    offset = read_gguf(path).tensors["b"].offset
    data = bytearray(path.read_bytes())
    data[offset + 1] ^= 0x01                                        # one weight byte of one tensor
    path.write_bytes(bytes(data))
    assert model_fingerprint(read_gguf(path), "f32") != base


def test_fingerprint_of_real_models_is_distinct_and_stable(real_model):
    from jllm.gguf.reader import read_gguf

    small = model_fingerprint(read_gguf(real_model("smollm2-135m")), "int8")
    big = model_fingerprint(read_gguf(real_model("qwen2.5-coder-1.5b")), "int8")
    assert small != big
    assert model_fingerprint(read_gguf(real_model("qwen2.5-coder-1.5b")), "int8") == big


# --- conversation histories (jllm/cache/conversations.py) -----------------------------------------------------

@pytest.mark.parametrize("text", ["[]", '"hello"', "{}", '{"version": 1, "messages": [1, 2]}',
                                  '{"version": 1, "messages": [{"content": "hi"}]}',
                                  '{"version": 1, "messages": [{"role": "user", "content": 5}]}',
                                  '{"version": 1, "messages": [{"role": "user", "content": null}]}',
                                  '{"version": 2, "messages": []}', "{not json"])
def test_a_conversation_file_in_another_shape_is_one_clear_error(tmp_path, text):
    from jllm.cache.conversations import load_messages, save_messages
    save_messages(tmp_path, "c", [{"role": "user", "content": "hi"}])
    assert load_messages(tmp_path, "c") == [{"role": "user", "content": "hi"}]
    (tmp_path / "conversations" / "c.json").write_text(text)
    with pytest.raises(JllmError, match="jllm cache rm c"):
        load_messages(tmp_path, "c")
