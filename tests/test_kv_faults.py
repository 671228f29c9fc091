"""The KV store and the conversation histories under faults (issue 25): a full disk, a broken `.lock`, foreign
and odd entries, writes in flight against the size cap, two processes on one conversation, writers killed
with SIGKILL. The rule in every case: the reply reaches the user, there is no traceback, and a problem is one
warning line (once per broken file), after which the store mends itself.

The CLI runs in this process (`jllm.cli.main`) on a tiny synthetic model, so that a monkeypatched write can
fail with ENOSPC at the call a full disk would fail; concurrent and killed writers are processes forked by
tests/kv_writer_child.py, and concurrent `jllm chat` commands processes forked by tests/jllm_child.py.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from jllm.cache.conversations import History, load_messages, save_messages
from jllm.cache.store import KVState, KVStore, check_conversation_id
from jllm.cli import main
from jllm.errors import JllmError
from kv_writer_child import FINGERPRINT, dir_bytes, state_for, user_turn
from synthetic import write_tiny_model

pytestmark = pytest.mark.usefixtures("native_kernels")      # built before the first model runs

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("faults") / "tiny.gguf"
    write_tiny_model(path, "qwen2", intermediate_size=256)
    return str(path)


@pytest.fixture(autouse=True)
def _environment(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("JLLM_") and name != "JLLM_KERNELS_DIR":      # the kernels built for this run stay
            monkeypatch.delenv(name)
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "converted"))


class Run:
    """One `jllm chat -p ... --json` turn (or any jllm command) in this process."""

    def __init__(self, capsys, argv: list[str]):
        self.rc = main(argv)
        self.out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        self.err = [line for line in err.splitlines() if line.strip()]
        self.warnings = [line for line in self.err if line.startswith("jllm: warning: ")]

    @property
    def reply(self) -> dict:
        return json.loads(self.out)


def chat(capsys, model: str, kv: Path, prompt: str, *extra: str, conv: str = "c") -> Run:
    return Run(capsys, ["chat", "-m", model, "--conversation", conv, "--cache-dir", str(kv), "-p", prompt,
                        "-n", "4", "-t", "1", "--json", *extra])


def cache(capsys, kv: Path, *args: str) -> Run:
    return Run(capsys, ["cache", *args, "--cache-dir", str(kv)])


def user_turns(kv: Path, conv: str = "c") -> list[str]:
    return [m["content"] for m in load_messages(kv, conv) if m["role"] == "user"]


def files(kv: Path) -> list[str]:
    """Every file under the cache dir, relative, the lock left out."""
    return sorted(str(p.relative_to(kv)) for p in kv.rglob("*") if p.name != ".lock" and not p.is_dir())


# --- 1. a full disk ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("json_out", [True, False])
def test_a_full_disk_costs_one_warning_per_save_and_never_the_reply(capsys, model, tmp_path, monkeypatch,
                                                                     json_out):
    kv = tmp_path / "kv"
    assert chat(capsys, model, kv, "Turn one").rc == 0

    def full(fd):                              # where a full disk's ENOSPC surfaces for both writers
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full)
    argv = ["chat", "-m", model, "--conversation", "c", "--cache-dir", str(kv), "-p", "Turn six?", "-n", "8",
            "-t", "1"] + (["--json"] if json_out else [])
    run = Run(capsys, argv)
    assert run.rc == 0
    if json_out:
        assert run.reply["text"] and run.reply["turn"] == 2
    else:
        assert run.out.strip()                                   # the streamed reply
    assert len(run.warnings) == 2, run.err                       # the KV state, the history: one line each
    assert "could not save the KV cache of c" in run.warnings[0] or "could not save the KV cache of c" in \
        run.warnings[1]
    assert any("could not save conversation c" in w and "No space left on device" in w for w in run.warnings)
    assert files(kv) == ["c.kv", "conversations/c.json"]          # no temp file left behind
    monkeypatch.undo()
    assert user_turns(kv) == ["Turn one"]                        # the failed turn is not kept, the old one is
    again = chat(capsys, model, kv, "Turn three")
    assert again.rc == 0 and again.warnings == [] and user_turns(kv) == ["Turn one", "Turn three"]


def test_a_failed_history_save_is_kept_for_the_next_save(tmp_path, monkeypatch):
    warns = []
    history = History(tmp_path, "c", warn=warns.append)
    history.messages += [{"role": "user", "content": "one"}, {"role": "assistant", "content": "1"}]
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
        history.save()
    assert len(warns) == 1 and "its history is not saved this time" in warns[0] and load_messages(tmp_path, "c") == []
    history.messages += [{"role": "user", "content": "two"}, {"role": "assistant", "content": "2"}]
    history.save()                                               # an interactive chat's next turn
    assert user_turns(tmp_path) == ["one", "two"] and len(warns) == 1


# --- 2. a .lock that cannot be opened ------------------------------------------------------------------------

def test_two_new_conversations_with_a_system_message_merge_into_one_history(tmp_path):
    first, second = History(tmp_path, "c", warn=[].append), History(tmp_path, "c", warn=[].append)
    for h, who in ((first, "A"), (second, "B")):
        h.messages += [{"role": "system", "content": f"sys {who}"}, {"role": "user", "content": f"u {who}"},
                       {"role": "assistant", "content": f"a {who}"}]
    first.save()
    second.save()
    assert [m["content"] for m in load_messages(tmp_path, "c")] == ["sys A", "u A", "a A", "u B", "a B"]


def test_a_history_removed_meanwhile_is_written_whole_not_cut(tmp_path):
    """`jllm cache rm` (or another session's /reset) during a session: its next save keeps all it holds."""
    warns = []
    h = History(tmp_path, "c", warn=warns.append)
    h.messages += [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                   {"role": "assistant", "content": "a1"}]
    h.save()
    (tmp_path / "conversations" / "c.json").unlink()             # removed by another process
    h.messages += [{"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    h.save()
    assert [m["content"] for m in load_messages(tmp_path, "c")] == ["s", "u1", "a1", "u2", "a2"]
    assert h.messages[0]["content"] == "s" and not any("another process" in w for w in warns)


def test_a_history_save_does_not_wait_for_the_kv_lock(tmp_path):
    """A state's save holds the KV store's lock for seconds after a reply; the history has its own."""
    import fcntl

    h = History(tmp_path, "c", warn=[].append)
    h.messages += [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)                            # as the background KV save holds it
        h.save()                                                    # would block forever on the same lock
    assert len(load_messages(tmp_path, "c")) == 2


@pytest.mark.parametrize("lock", ["directory", "symlink loop"])
def test_a_broken_lock_is_one_line_and_the_turn_goes_on_uncached(capsys, model, tmp_path, lock):
    kv = tmp_path / "kv"
    assert chat(capsys, model, kv, "first").rc == 0
    (kv / "c.kv").write_bytes((kv / "c.kv").read_bytes()[:-100])   # a corrupt entry, to be removed
    (kv / ".lock").unlink()
    if lock == "directory":
        (kv / ".lock").mkdir()
    else:
        (kv / ".lock").symlink_to(".lock")
    run = chat(capsys, model, kv, "second")
    assert run.rc == 0 and run.reply["text"] and run.reply["timings"]["cached_tokens"] == 0
    what = "is a directory" if lock == "directory" else "is a symbolic link"
    assert len(run.warnings) == 2, run.err
    assert f".lock {what}; nothing is cached until it is removed" in run.warnings[0]
    assert "c.kv is 6" in run.warnings[1] and "(truncated or overwritten); left it in place" in run.warnings[1]
    assert (kv / "c.kv").exists() and user_turns(kv) == ["first", "second"]    # the history is still saved
    rm = cache(capsys, kv, "rm", "c")
    assert rm.rc == 1 and len(rm.err) == 1 and rm.err[0].startswith("jllm: the KV cache lock"), rm.err
    assert rm.err[0].endswith(f"{what}; `cache rm` cannot run until it is removed"), rm.err
    (kv / ".lock").rmdir() if lock == "directory" else (kv / ".lock").unlink()
    run = chat(capsys, model, kv, "third")                        # fixed: the corrupt entry goes, caching is back
    assert run.rc == 0 and len(run.warnings) == 1 and "(truncated or overwritten); removed it" in run.warnings[0]
    run = chat(capsys, model, kv, "fourth")
    assert run.warnings == [] and run.reply["timings"]["cached_tokens"] > 0


# --- 3. foreign and odd entries ------------------------------------------------------------------------------

def test_an_entry_of_another_precision_is_reported_once_and_replaced(capsys, model, tmp_path):
    kv = tmp_path / "kv"
    assert chat(capsys, model, kv, "first", "--precision", "exact").rc == 0
    run = chat(capsys, model, kv, "second", "--precision", "int8")
    assert run.rc == 0 and len(run.warnings) == 1 and "c.kv was written for other models" in run.warnings[0]
    assert ".gguf (exact@cpu/kv-" in run.warnings[0], run.warnings[0]        # named by file, not by hash
    assert run.reply["timings"]["cached_tokens"] == 0
    run = chat(capsys, model, kv, "third", "--precision", "int8")
    assert run.warnings == [] and run.reply["timings"]["cached_tokens"] > 0


def test_a_directory_at_a_kv_entry_path_is_reported_once_and_removed(capsys, model, tmp_path):
    kv = tmp_path / "kv"
    (kv / "c.kv").mkdir(parents=True)
    run = chat(capsys, model, kv, "first")
    assert run.rc == 0 and len(run.warnings) == 1 and "c.kv is a directory; removed it" in run.warnings[0]
    run = chat(capsys, model, kv, "second")
    assert run.warnings == [] and run.reply["timings"]["cached_tokens"] > 0     # cached again
    (kv / "c.kv").unlink()
    (kv / "c.kv").mkdir()
    rm = cache(capsys, kv, "rm", "c")
    assert rm.rc == 0 and rm.out == "removed: c\n" and not (kv / "c.kv").exists()


def test_a_directory_that_is_not_empty_is_named_once_per_turn_and_never_removed(capsys, model, tmp_path):
    kv = tmp_path / "kv"
    (kv / "c.kv" / "mine").mkdir(parents=True)
    for prompt in ("first", "second"):
        run = chat(capsys, model, kv, prompt)
        assert run.rc == 0 and run.reply["text"] and len(run.warnings) == 1, run.err
        assert "c.kv is a directory; cannot remove it" in run.warnings[0] and "move it away" in run.warnings[0]
    rm = cache(capsys, kv, "rm", "c")
    assert rm.rc == 1 and len(rm.err) == 1 and "move it away" in rm.err[0] and (kv / "c.kv" / "mine").is_dir()


def test_a_directory_at_a_history_path(capsys, model, tmp_path):
    kv = tmp_path / "kv"
    (kv / "conversations" / "c.json").mkdir(parents=True)
    run = chat(capsys, model, kv, "first")
    assert run.rc == 0 and len(run.warnings) == 1 and "c.json was an empty directory; removed it" in run.warnings[0]
    assert user_turns(kv) == ["first"]
    (kv / "conversations" / "d.json").mkdir()
    assert cache(capsys, kv, "rm", "d").out == "removed: d\n"      # `jllm cache rm` mends it too
    (kv / "conversations" / "e.json" / "x").mkdir(parents=True)
    run = chat(capsys, model, kv, "hi", conv="e")
    assert run.rc == 1 and run.err == [f"jllm: conversation file {kv / 'conversations' / 'e.json'} is a directory "
                                       f"that is not empty; move it away"]


# --- 4. the size cap counts writes in flight -----------------------------------------------------------------

def test_disk_use_never_exceeds_the_cap_while_entries_are_rewritten(tmp_path, monkeypatch):
    cap = 20 << 20
    store = KVStore(tmp_path, max_bytes=cap, target_fingerprint="T")
    at_rename, real_replace = [], os.replace

    def replace(src, dst):                     # the moment both the old entry and the new file are on disk
        at_rename.append(dir_bytes(tmp_path))
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    sampled, done = [], threading.Event()

    def sample():
        while not done.is_set():
            sampled.append(dir_bytes(tmp_path))
            time.sleep(0.01)
    sampler = threading.Thread(target=sample)
    sampler.start()
    g = torch.Generator().manual_seed(0)
    try:
        for i in range(15):                    # three conversations taking turns, each entry growing: 5-7.6 MB
            n = 1300 + 70 * i
            k, v = (torch.randn(4, 2, n, 64, generator=g) for _ in range(2))
            assert store.save(f"conv{i % 3}", KVState(list(range(n)), k, v)) is not None
    finally:
        done.set()
        sampler.join()
    assert len(at_rename) == 15 and len(sampled) >= 15
    assert max(at_rename) <= cap and max(sampled) <= cap, (max(at_rename) / cap, max(sampled) / cap)
    assert max(at_rename) > cap * 0.6                              # the cap was really pressed


# --- 5. two processes on one conversation --------------------------------------------------------------------

def check_conversation(kv: Path, seeds: tuple[int, ...]) -> list[str]:
    """The history reads, alternates user/assistant with each reply after its own question, and keeps every
    writer's turns in the order it took them. Returns the user turns."""
    messages = load_messages(kv, "c")
    assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
    for q, a in zip(messages[::2], messages[1::2]):
        seed, r = q["content"].split()[1::2]
        assert a["content"].startswith(f"reply {seed}.{r} ")
    turns = [m["content"] for m in messages[::2]]
    for seed in seeds:
        mine = [t for t in turns if t.startswith(f"writer {seed} ")]
        assert mine == [user_turn(seed, r) for r in range(len(mine))]
    return turns


def test_two_processes_on_one_conversation_keep_every_turn(tmp_path, writers):
    pids = [writers("chat", tmp_path, "c", seed, 10) for seed in (1, 2)]
    assert [writers("wait", pid) for pid in pids] == [0, 0]
    turns = check_conversation(tmp_path, (1, 2))
    assert sorted(turns) == sorted(user_turn(s, r) for s in (1, 2) for r in range(10))   # 20 of 20


def test_two_jllm_chat_processes_on_one_conversation(model, tmp_path, jllm_forks):
    """Three rounds, each of two `jllm chat` processes started side by side on conversation c."""
    kv = tmp_path / "kv"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JLLM_") or k == "JLLM_KERNELS_DIR"}
    env.update(JLLM_CONVERTED_DIR=str(tmp_path / "converted"), PYTHONPATH=str(HERE.parent / "src"))
    results: dict[str, list[int]] = {"a": [], "b": []}
    for r in range(3):
        pids = {who: jllm_forks.start(["chat", "-m", model, "--conversation", "c", "--cache-dir", str(kv), "-p",
                                       f"{who} {r}", "-n", "2", "-t", "1", "--json"], env=env, cwd=tmp_path)
                for who in results}
        for who, pid in pids.items():
            p = jllm_forks.finish(pid)
            assert "Traceback" not in p.stderr and json.loads(p.stdout)["text"] is not None, p.stderr
            results[who].append(p.returncode)
    assert results == {"a": [0, 0, 0], "b": [0, 0, 0]}
    kept = user_turns(kv)
    assert sorted(kept) == ["a 0", "a 1", "a 2", "b 0", "b 1", "b 2"]
    assert [t for t in kept if t[0] == "a"] == ["a 0", "a 1", "a 2"] and [t for t in kept if t[0] == "b"] == \
        ["b 0", "b 1", "b 2"]


# --- 6. writers killed with SIGKILL: no corrupt load, no stray temp file -------------------------------------

def test_killed_chat_writers_leave_nothing_broken_and_no_stray_files(capsys, tmp_path, writers):
    rng = random.Random(7)
    landed = 0
    for i in range(40):                     # at least 12 kills, and on until one has landed inside a save
        if i >= 12 and landed:
            break
        pid = writers("chat", tmp_path, "c", i, 0)
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(pid, signal.SIGKILL)
        assert writers("wait", pid) == -signal.SIGKILL
        landed += any(p.name.startswith(".tmp-") for p in (tmp_path / "conversations").iterdir())
        check_conversation(tmp_path, tuple(range(i + 1)))           # the history always reads
        warns = []
        store = KVStore(tmp_path, target_fingerprint=FINGERPRINT, draft_fingerprint=FINGERPRINT + "-draft",
                        warn=warns.append)
        for row in store.entries():                                  # and the KV state always loads
            got = store.load(row["name"], row["tokens"])
            assert got is not None and got.tokens == state_for(got.tokens[0]).tokens, warns
        assert warns == []
        ls = cache(capsys, tmp_path, "ls")
        assert ls.rc == 0 and ".tmp" not in ls.out
    assert landed >= 1                                                # a kill did land inside a history save
    stale = tmp_path / "conversations" / ".tmp-stale.json"
    stale.write_text("{")
    assert cache(capsys, tmp_path, "rm", ".tmp-stale").rc == 1       # not an id: refused, as before
    assert cache(capsys, tmp_path, "clear").rc == 0
    assert [p.name for p in tmp_path.rglob("*") if ".tmp" in p.name] == []
    assert writers("wait", writers("chat", tmp_path, "c", 99, 1)) == 0   # and a new turn still works
    assert check_conversation(tmp_path, (99,))[-1] == user_turn(99, 0)


# --- 7. small: ids ------------------------------------------------------------------------------------------

def test_a_huge_id_is_cut_in_its_message_and_file_names_are_not_ids():
    with pytest.raises(JllmError) as e:
        check_conversation_id("k" * 10_000)
    assert len(str(e.value)) < 200 and "k" * 40 + "'..." in str(e.value)
    for name in ("x.kv", "x.json"):
        with pytest.raises(JllmError, match="name the conversation, not its file"):
            check_conversation_id(name)
    assert check_conversation_id("x.kv2") == "x.kv2"


def test_the_server_400_for_a_huge_prompt_cache_key_is_short(model):
    from fastapi.testclient import TestClient

    from jllm.engine import Engine
    from jllm.server import create_app

    app = create_app(Engine(model, ctx_size=256, threads=1), "tiny")
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "prompt_cache_key": "k" * 10_000,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key"
    assert len(r.json()["error"]["message"]) < 200, r.json()


# --- jllm cache: user mistakes -------------------------------------------------------------------------------

def test_cache_rm_of_missing_ids_is_an_error_after_removing_the_others(capsys, tmp_path):
    save_messages(tmp_path, "here", [{"role": "user", "content": "hi"}])
    KVStore(tmp_path, target_fingerprint="T").save("here", state_for(3))
    run = cache(capsys, tmp_path, "rm", "nosuch", "here", "gone")
    assert run.rc == 1 and run.out == "removed: here\n"
    assert run.err == ["jllm: no such conversation: nosuch, gone (`jllm cache ls` lists them)"]
    assert files(tmp_path) == []
    run = cache(capsys, tmp_path, "rm", "nosuch")
    assert run.rc == 1 and run.out == "" and run.err[0].startswith("jllm: no such conversation: nosuch")


@pytest.mark.parametrize("args, line", [
    ([], "jllm: usage: jllm cache {ls,rm ID...,clear,stats} [--cache-dir DIR] [--cache-size SIZE] "
         "[--kv-store URL]"),
    (["rm"], "jllm: usage: jllm cache rm ID [ID ...]"),
    (["ls", "x"], "jllm: `cache ls` takes no ids (usage: jllm cache {ls,rm ID...,clear,stats} [--cache-dir DIR] "
                  "[--cache-size SIZE] [--kv-store URL])"),
])
def test_cache_usage(capsys, tmp_path, args, line):
    run = cache(capsys, tmp_path, *args)
    assert run.rc == 1 and run.err == [line] and run.out == ""
