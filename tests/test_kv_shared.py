"""The shared KV tier (cache/shared.py) and the two-tier store (cache/tiered.py) against a real redis-server
on 127.0.0.1 (tests/redis_server.py): no mocks."""

import threading
import time

import pytest
import torch

from jllm.cache.shared import RedisTier
from jllm.cache.store import KVState, KVStore
from jllm.cache.tiered import TieredStore
from jllm.errors import JllmError
from redis_server import RedisServer, require_redis

FP = "target-fp"


@pytest.fixture
def server(tmp_path):
    require_redis()
    s = RedisServer(tmp_path).start()
    yield s
    s.stop()


def tier(server, warn=None, **kw):
    kw.setdefault("target_fingerprint", FP)
    kw.setdefault("chunk_bytes", 1 << 14)            # many chunks even for small test states
    return RedisTier(server.url, warn=warn if warn is not None else (lambda m: None), **kw)


def state(tokens, dtype=torch.float16, draft=False, fill=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(tokens)

    def t(layers, d):
        x = torch.randn(layers, 2, n, d, generator=g)
        return (torch.full_like(x, float(fill)) if fill is not None else x).to(dtype)
    s = KVState(list(tokens), t(2, 16), t(2, 16))
    if draft:
        s.draft_k, s.draft_v = t(1, 8), t(1, 8)
    return s


def same(a: KVState, b: KVState, n=None):
    n = len(b.tokens) if n is None else n
    pairs = [(a.target_k, b.target_k), (a.target_v, b.target_v), (a.draft_k, b.draft_k), (a.draft_v, b.draft_v)]
    return list(a.tokens) == list(b.tokens[:n]) and all(
        (x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                      and torch.equal(x, y[:, :, :n])) for x, y in pairs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("draft", [False, True])
def test_round_trip_is_bitwise(server, dtype, draft):
    t = tier(server)
    s = state(range(700), dtype, draft)
    assert t.save("conv", s) == "conv"
    assert t.lookup(list(range(700)) + [1], "conv") == ("conv", 700)
    assert same(t.load("conv", 700), s)
    assert same(t.load("conv", 300), s, 300)
    assert t.load("conv", 701) is None                # longer than the entry: a miss
    assert t.stats()["count"] == 1
    r = server.client()
    assert {r.ttl(k) for k in r.keys("jllm:kv:c:*")} == {-1}   # committed: no orphan TTL left


def test_prefix_lookup_across_conversations_and_anonymous_names(server):
    a, b = tier(server), tier(server)                # two replicas
    a.save("first", state(range(1000)))
    name = a.save(None, state(range(5000, 5600)))
    assert name.startswith("anon-")
    prompt = list(range(900)) + [7, 7, 7]
    assert b.lookup(prompt, "second") == ("first", 900)
    assert b.lookup(prompt) == ("first", 900)
    assert b.lookup(list(range(5000, 5600)) + [1]) == (name, 600)
    assert b.lookup(list(range(200)), "second") == (None, 0)   # shorter than one block, not its own id
    assert same(b.load("first", 900), state(range(1000)), 900)


def test_entries_of_other_models_are_never_used(server):
    ours, theirs = tier(server), tier(server, target_fingerprint="other-fp")
    warned = []
    ours_w = tier(server, warn=warned.append)
    theirs.save("shared-name", state(range(600)))
    theirs.save("theirs", state(range(600)))
    assert ours.lookup(list(range(600)) + [1]) == (None, 0)
    assert ours_w.lookup(list(range(600)) + [1], "shared-name") == (None, 0)
    assert ours_w.lookup(list(range(600)) + [1], "shared-name") == (None, 0)
    assert len(warned) == 1 and "other models" in warned[0]
    assert ours.load("theirs", 600) is None
    assert theirs.lookup(list(range(600)) + [1], "theirs") == ("theirs", 600)   # left to its owner
    ours.save("shared-name", state(range(600)))                                 # replaces it
    assert ours.lookup(list(range(600)) + [1], "shared-name") == ("shared-name", 600)


def test_key_prefixes_keep_model_pairs_apart(server):
    a, b = tier(server, prefix="jllm:a:"), tier(server, prefix="jllm:b:")
    a.save("c", state(range(600)))
    assert b.lookup(list(range(600)), "c") == (None, 0)
    assert b.clear() == 0 and a.stats()["count"] == 1


def test_cap_holds_with_lru_across_replicas(server):
    size = len(state(range(600)).target_k.numpy().tobytes()) * 2
    a, b = tier(server, max_bytes=int(size * 3.5)), tier(server, max_bytes=int(size * 3.5))
    r = server.client()
    for i, name in enumerate(["c0", "c1", "c2"]):
        (a if i % 2 else b).save(name, state(range(i * 1000, i * 1000 + 600)))
    assert b.load("c0", 600) is not None             # c0 used last by replica b: c1 is the LRU now
    a.save("c3", state(range(3000, 3600)))
    assert sorted(e["name"] for e in a.entries()) == ["c0", "c2", "c3"]
    for i in range(4, 12):                           # keep writing from both; the cap holds after each
        (a if i % 2 else b).save(f"c{i}", state(range(i * 1000, i * 1000 + 600)))
        stats = a.stats()
        assert stats["bytes"] <= a.max_bytes and stats["count"] == 3
        stored = sum(r.strlen(k) for k in r.keys("jllm:kv:c:*")) + \
            sum(len(r.hget(k, "meta")) for k in r.keys("jllm:kv:e:*"))
        assert stored == stats["bytes"]              # the accounting is what Redis holds
    assert len(r.hgetall("jllm:kv:idx")) == 3 * 2    # evicted entries leave no index behind
    big = tier(server, max_bytes=size // 2, warn=(warned := []).append)
    assert big.save("huge", state(range(600))) is None and "larger than the whole" in warned[0]


def test_corrupt_and_missing_chunks_are_dropped_and_reported_once(server):
    warned = []
    t = tier(server, warn=warned.append)
    r = server.client()
    toks = {"flipped": list(range(600)), "missing": list(range(1000, 1600))}
    for name in toks:
        t.save(name, state(toks[name]))
    gen = r.hget("jllm:kv:e:flipped", "gen").decode()
    chunk = bytearray(r.get(f"jllm:kv:c:flipped:{gen}:3"))
    chunk[100] ^= 1
    r.set(f"jllm:kv:c:flipped:{gen}:3", bytes(chunk))
    gen = r.hget("jllm:kv:e:missing", "gen").decode()
    r.delete(f"jllm:kv:c:missing:{gen}:2")
    for name, why in (("flipped", "checksum"), ("missing", "misses a chunk")):
        assert t.lookup(toks[name] + [1], name) == (name, 600)      # the head is fine
        assert t.load(name, 600) is None
        assert why in warned[-1] and "dropped" in warned[-1]
        assert t.lookup(toks[name] + [1], name) == (None, 0)
        assert t.load(name, 600) is None
        assert not r.keys(f"jllm:kv:c:{name}:*") and not r.exists(f"jllm:kv:e:{name}")
    assert len(warned) == 2
    assert t.stats()["bytes"] == 0


def test_a_bad_head_is_dropped(server):
    warned = []
    t = tier(server, warn=warned.append)
    t.save("c", state(range(600)))
    r = server.client()
    meta = bytearray(r.hget("jllm:kv:e:c", "meta"))
    meta[-3] ^= 1                                    # in the token ids: fails the head's checksum
    r.hset("jllm:kv:e:c", "meta", bytes(meta))
    assert t.lookup(list(range(600)), "c") == (None, 0)
    assert len(warned) == 1 and "checksum" in warned[0]
    assert not r.keys("jllm:kv:*c:*") and t.stats()["bytes"] == 0


def test_another_format_version_is_a_miss_left_in_place(server):
    warned = []
    t = tier(server, warn=warned.append)
    t.save("c", state(range(600)))
    r = server.client()
    meta = bytearray(r.hget("jllm:kv:e:c", "meta"))
    meta[8:12] = (2).to_bytes(4, "little")
    r.hset("jllm:kv:e:c", "meta", bytes(meta))
    assert t.lookup(list(range(600)), "c") == (None, 0) and t.load("c", 600) is None
    assert len(warned) == 1 and "format version 2" in warned[0] and r.exists("jllm:kv:e:c")


def test_redis_down_then_back(server):
    warned = []
    t = tier(server, warn=warned.append, retry_s=0.5)
    s = state(range(600))
    t.save("c", s)
    server.stop()
    t0 = time.monotonic()
    assert t.lookup(list(range(600)), "c") == (None, 0)
    assert t.load("c", 600) is None
    assert t.save("c", s) is None
    assert t.entries() == [] and t.stats()["reachable"] is False and t.remove("c") is False
    assert time.monotonic() - t0 < 2                 # misses, not stalls
    assert len(warned) == 1 and "unreachable" in warned[0] and "retrying every 0.5 s" in warned[0]
    server.start()                                   # same port, empty (no persistence)
    assert t.save("c", s) is None                    # within the back-off: not tried yet
    time.sleep(0.6)
    assert t.save("c", s) == "c"
    assert same(t.load("c", 600), s)
    assert [w for w in warned if "unreachable" in w] == warned[:1] and "reachable again" in warned[-1]


def test_redis_down_at_start(tmp_path):
    require_redis()
    server = RedisServer(tmp_path)                   # never started
    warned = []
    t = tier(server, warn=warned.append)
    assert t.lookup(list(range(10)), "c") == (None, 0) and t.save("c", state(range(10))) is None
    assert len(warned) == 1


def test_password_and_urls(tmp_path):
    require_redis()
    server = RedisServer(tmp_path, password="s3cret").start()
    try:
        t = tier(server)
        assert t.save("c", state(range(300))) == "c" and t.load("c", 300) is not None
        assert "s3cret" not in t.stats()["url"]
        warned = []
        wrong = RedisTier(server.url.replace("s3cret", "wrong"), target_fingerprint=FP, warn=warned.append)
        assert wrong.lookup(list(range(300)), "c") == (None, 0)
        assert len(warned) == 1 and "wrong" not in warned[0]
    finally:
        server.stop()
    RedisTier("rediss://:pw@127.0.0.1:1/0")         # TLS URL accepted (connects lazily)
    with pytest.raises(JllmError, match="bad KV store URL"):
        RedisTier("http://127.0.0.1:6379")
    with pytest.raises(JllmError, match="^bad KV store URL notaurl: use"):     # named as given, not '://notaurl'
        RedisTier("notaurl")
    with pytest.raises(JllmError) as e:
        RedisTier("me:s3cret@host")
    assert "s3cret" not in str(e.value)
    with pytest.raises(JllmError, match="invalid conversation id"):
        RedisTier("redis://127.0.0.1:1/0").lookup([1], "../x")


def test_tls_with_a_password(tmp_path):
    """rediss:// against a TLS-only redis-server: entries round-trip; a client that does not trust the
    server's certificate gets misses and one warning, never a traceback."""
    require_redis()
    server = RedisServer(tmp_path, password="s3cret", tls=True).start()
    try:
        t = tier(server)
        s = state(range(500), draft=True)
        assert t.save("c", s) == "c" and same(t.load("c", 500), s)
        assert t.lookup(list(range(500)), "other") == ("c", 500)
        warned = []
        untrusted = RedisTier(server.url.split("?")[0], target_fingerprint=FP, warn=warned.append)
        assert untrusted.lookup(list(range(500)), "c") == (None, 0) and untrusted.load("c", 500) is None
        assert len(warned) == 1 and "s3cret" not in warned[0]
        plain = RedisTier(server.url.replace("rediss://", "redis://").split("?")[0], target_fingerprint=FP,
                          warn=warned.append)
        assert plain.save("d", state(range(10))) is None and len(warned) == 2
    finally:
        server.stop()


def test_concurrent_writers_leave_one_whole_entry(server):
    writers = [tier(server), tier(server)]
    reader = tier(server)
    errors, loads = [], []

    def write(w, k):
        for i in range(25):
            n = 300 + 97 * ((k * 25 + i) % 7)        # lengths differ; every value says which write it was
            writers[w].save("same", state(range(n), fill=(k * 25 + i) % 1000))

    def read():
        while any(th.is_alive() for th in threads):
            got = reader.load("same")
            if got is not None:
                loads.append(got)
                n = len(got.tokens)
                v = got.target_k.flatten()[0].item()
                if got.target_k.shape[2] != n or not torch.all(got.target_k == v) or \
                        not torch.all(got.target_v == v) or got.tokens != list(range(n)):
                    errors.append((n, v))
    threads = [threading.Thread(target=write, args=(w, w)) for w in range(2)]
    for th in threads:
        th.start()
    rd = threading.Thread(target=read)
    rd.start()
    for th in threads + [rd]:
        th.join()
    assert not errors and len({got.target_k.flatten()[0].item() for got in loads}) > 1   # it raced
    r = server.client()
    final = reader.load("same")
    assert final is not None and reader.stats()["count"] == 1
    gen, n = r.hmget("jllm:kv:e:same", "gen", "n")
    assert sorted(r.keys("jllm:kv:c:*")) == sorted(f"jllm:kv:c:same:{gen.decode()}:{i}".encode()
                                                   for i in range(int(n)))
    assert reader.stats()["bytes"] == sum(r.strlen(k) for k in r.keys("jllm:kv:c:*")) + \
        len(r.hget("jllm:kv:e:same", "meta"))


def test_tiered_replica_b_loads_what_a_saved(server, tmp_path):
    a = TieredStore(KVStore(tmp_path / "a", target_fingerprint=FP), tier(server))
    b = TieredStore(KVStore(tmp_path / "b", target_fingerprint=FP), tier(server))
    s = state(range(800), draft=True)
    assert a.save("conv", s) == "conv"
    prompt = list(range(800)) + [5, 6]
    assert b.local.lookup(prompt, "conv") == (None, 0)
    assert b.lookup(prompt, "conv") == ("conv", 800)
    assert same(b.load("conv", 800), s)
    b.wait_copies()
    assert b.local.lookup(prompt, "conv") == ("conv", 800)
    assert same(b.local.load("conv", 800), s)
    st = b.stats()
    assert st["count"] == 1 and st["shared"]["count"] == 1
    assert {e["tier"] for e in b.entries()} == {"local", "shared"}
    assert b.remove("conv") and a.lookup(prompt, "conv") == ("conv", 800)   # a's local copy stays
    assert a.clear() == 1


def test_tiered_longer_prefix_wins_local_on_ties(server, tmp_path):
    b = TieredStore(KVStore(tmp_path / "b", target_fingerprint=FP), tier(server))
    b.shared.save("conv", state(range(900), seed=1))
    b.local.save("conv", state(range(600), seed=2))
    assert b.lookup(list(range(900)) + [1], "conv") == ("conv", 900)
    assert same(b.load("conv", 900), state(range(900), seed=1))             # from the shared tier
    b.wait_copies()
    b.shared.save("conv", state(range(900), seed=3))
    assert b.lookup(list(range(900)) + [1], "conv") == ("conv", 900)
    assert same(b.load("conv", 900), state(range(900), seed=1))             # tie: the local copy


@pytest.mark.usefixtures("native_kernels")
def test_engine_replica_b_continues_what_a_served(server, tmp_path, monkeypatch):
    """Two engines with their own local dirs on one Redis: turn 2 on B evaluates only its new tokens and
    answers exactly as a recomputation."""
    from jllm.engine import Engine
    from jllm.sampling import SamplingParams
    from synthetic import write_tiny_model

    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "converted"))
    path = str(tmp_path / "m.gguf")
    write_tiny_model(path, "qwen2", seed=5)
    p = SamplingParams(max_tokens=12)
    turn1 = [{"role": "user", "content": "tell me about caches " * 8}]
    a = Engine(path, ctx_size=512, threads=1, kv_store_dir=str(tmp_path / "a"), kv_store_url=server.url)
    r1 = a.generate(a.chat_ids(turn1), p, conv_id="c1")
    a.wait_saves()
    msgs = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "and then?"}]
    b = Engine(path, ctx_size=512, threads=1, kv_store_dir=str(tmp_path / "b"), kv_store_url=server.url)
    ids = b.chat_ids(msgs)
    res = b.generate(ids, p, conv_id="c1")
    assert res.timings.cached_tokens > len(ids) // 2
    assert res.token_ids == Engine(path, ctx_size=512, threads=1).generate(ids, p).token_ids
    assert b.kv_store.stats()["shared"]["count"] == 1
    with pytest.raises(JllmError, match="bad KV store URL"):
        Engine(path, kv_store_dir=str(tmp_path / "c"), kv_store_url="http://127.0.0.1:1")


WRITER = """
import sys, torch
from jllm.cache.shared import RedisTier
from jllm.cache.store import KVState
t = RedisTier(sys.argv[1], target_fingerprint=sys.argv[2], chunk_bytes=1 << 14)
k = int(sys.argv[3])
for i in range(20):
    n, v = 300 + 97 * ((k + i) % 7), float(k * 100 + i)
    x = torch.full((2, 2, n, 16), v, dtype=torch.float16)
    assert t.save("same", KVState(list(range(n)), x, x.clone())) == "same"
"""


def test_concurrent_writer_processes_leave_one_whole_entry(server):
    import subprocess
    import sys
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, server.url, FP, str(k)]) for k in (0, 1)]
    reader, seen = tier(server), set()
    while any(p.poll() is None for p in procs):
        got = reader.load("same")
        if got is not None:
            v = got.target_k.flatten()[0].item()
            assert got.tokens == list(range(got.target_k.shape[2])) and torch.all(got.target_k == v) \
                and torch.all(got.target_v == v)
            seen.add(v)
    assert [p.wait() for p in procs] == [0, 0]
    final = reader.load("same")
    assert final is not None and final.target_k.flatten()[0].item() in (19.0, 119.0)
    r = server.client()
    assert reader.stats()["count"] == 1 and len(r.keys("jllm:kv:e:*")) == 1
    assert reader.stats()["bytes"] == sum(r.strlen(k) for k in r.keys("jllm:kv:c:*")) + \
        len(r.hget("jllm:kv:e:same", "meta"))


def test_cache_command_sees_the_shared_tier(server, tmp_path, capsys):
    from jllm.cli import main
    tier(server).save("remote", state(range(300)))
    args = ["--cache-dir", str(tmp_path / "local"), "--kv-store", server.url]
    assert main(["cache", "ls", *args]) == 0
    out = capsys.readouterr().out
    assert "shared (redis://127.0.0.1" in out and "remote" in out
    assert main(["cache", "stats", *args]) == 0 and "'count': 1" in capsys.readouterr().out
    assert main(["cache", "rm", "remote", *args]) == 0 and "removed: remote" in capsys.readouterr().out
    assert main(["cache", "clear", *args]) == 0
    assert main(["cache", "ls", "--kv-store", "http://x", "--cache-dir", str(tmp_path / "l2")]) == 1
    assert capsys.readouterr().err.strip().startswith("jllm: bad KV store URL http://x")


def test_metrics_show_the_shared_tier(server, tmp_path):
    from jllm.server.metrics import Metrics
    store = TieredStore(KVStore(tmp_path / "l", target_fingerprint=FP), tier(server, max_bytes=1 << 20))
    store.save("c", state(range(300)))
    text = Metrics().render(0, 0, store.stats())
    assert "jllm_kv_shared_up 1" in text and "jllm_kv_shared_entries 1" in text
    assert "jllm_kv_shared_max_bytes 1048576" in text and "jllm_kv_cache_entries 1" in text
    server.stop()
    assert "jllm_kv_shared_up 0" in Metrics().render(0, 0, store.stats())
