"""Two `jllm serve` replicas on one Redis (live uvicorn servers on loopback, the official `openai` client, a
tiny synthetic model): turn 2 on the replica that never saw turn 1 reuses turn 1's state from the shared
tier and answers exactly as a recomputation, with the first replica stopped; Redis killed mid-test, replies
keep coming."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from openai import OpenAI
from synthetic import write_tiny_model

from jllm.engine import Engine
from jllm.sampling import SamplingParams
from jllm.server import create_app
from live_server import serve_app
from redis_server import RedisServer, jllm_entry_bytes, require_redis

pytestmark = pytest.mark.usefixtures("native_kernels")
CTX, N = 1024, 16


def serve(engine: Engine) -> SimpleNamespace:
    live = serve_app(create_app(engine, "tiny"))
    return SimpleNamespace(client=OpenAI(base_url=f"{live.base}/v1", api_key="none", max_retries=0, timeout=60),
                           stop=live.stop, engine=engine)


@pytest.fixture
def replicas(tmp_path, monkeypatch, request):
    require_redis()
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "converted"))
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "qwen2", seed=10)
    redis = RedisServer(tmp_path).start()
    cap = getattr(request, "param", 4 << 30)          # the shared tier's cap
    engines = [Engine(str(path), ctx_size=CTX, threads=1, kv_store_dir=str(tmp_path / name), kv_store_url=redis.url,
                      kv_store_shared_bytes=cap) for name in ("a", "b")]
    servers = [serve(e) for e in engines]
    ref = Engine(str(path), ctx_size=CTX, threads=1)                # no store: the oracle
    yield SimpleNamespace(a=servers[0], b=servers[1], ref=ref, redis=redis)
    for s in servers:
        s.stop()
    redis.stop()


def chat(replica, messages, conv):
    r = replica.client.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0,
                                               extra_body={"prompt_cache_key": conv})
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def expected(ref: Engine, messages) -> str:
    return ref.generate(ref.chat_ids(messages), SamplingParams(max_tokens=N)).text


def test_turn_two_on_the_other_replica_reuses_turn_one(replicas):
    turn1 = [{"role": "user", "content": "tell me about caches and replicas " * 12}]
    text1, cached1 = chat(replicas.a, turn1, "conv1")
    assert cached1 == 0 and text1 == expected(replicas.ref, turn1)
    replicas.a.engine.wait_saves()
    replicas.a.stop()                                # A is gone: only Redis remembers turn 1
    turn2 = turn1 + [{"role": "assistant", "content": text1}, {"role": "user", "content": "and then?"}]
    text2, cached2 = chat(replicas.b, turn2, "conv1")
    assert cached2 > len(replicas.ref.chat_ids(turn1)) // 2
    assert text2 == expected(replicas.ref, turn2)


def test_replies_keep_coming_with_redis_killed(replicas):
    turn1 = [{"role": "user", "content": "a question about outages " * 12}]
    text1, _ = chat(replicas.a, turn1, "conv2")
    replicas.a.engine.wait_saves()
    replicas.redis.stop()
    turn2 = turn1 + [{"role": "assistant", "content": text1}, {"role": "user", "content": "still there?"}]
    text2, cached2 = chat(replicas.b, turn2, "conv2")      # B never saw turn 1 and Redis is gone: recomputed
    assert cached2 == 0 and text2 == expected(replicas.ref, turn2)
    text3, cached3 = chat(replicas.a, turn2, "conv2")      # A has turn 1 in memory and on its disk
    assert cached3 > 0 and text3 == text2
    assert replicas.b.engine.kv_store.stats()["shared"]["reachable"] is False


@pytest.mark.parametrize("replicas", [512 << 10], indirect=True)   # ~7 conversations' worth: evictions
def test_load_two_replicas_many_clients_within_the_cap(replicas):
    """4 clients x 6 two-turn conversations, turn 1 on one replica and turn 2 on the other: every reply
    comes, every turn 2 equals its recomputation (no cross-talk), the shared tier never exceeds its cap."""
    from concurrent.futures import ThreadPoolExecutor

    cap, peak, done = 512 << 10, [0], threading.Event()
    r = replicas.redis.client()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], jllm_entry_bytes(replicas.redis.client()))
            time.sleep(0.01)

    def client(k):
        out = []
        for j in range(6):
            conv = f"load-{k}-{j}"
            turn1 = [{"role": "user", "content": f"client {k} asks question {j} " * 10}]
            first, second = (replicas.a, replicas.b) if (k + j) % 2 else (replicas.b, replicas.a)
            text1, _ = chat(first, turn1, conv)
            deadline = time.monotonic() + 5           # turn 2 after turn 1's state is in Redis (or evicted)
            while not r.exists(f"jllm:kv:e:{conv}") and time.monotonic() < deadline:
                time.sleep(0.01)
            turn2 = turn1 + [{"role": "assistant", "content": text1}, {"role": "user", "content": f"more {j}?"}]
            out.append((turn1, text1, turn2, *chat(second, turn2, conv)))
        return out

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(4) as pool:
        results = [r for rs in pool.map(client, range(4)) for r in rs]
    done.set()
    watcher.join()
    assert len(results) == 24
    for turn1, text1, turn2, text2, cached in results:
        assert text1 == expected(replicas.ref, turn1) and text2 == expected(replicas.ref, turn2)
    assert sum(cached > 0 for *_, cached in results) >= 8             # a small cap: many still hydrate
    stats = replicas.a.engine.kv_store.stats()["shared"]
    assert 0 < peak[0] <= cap and stats["bytes"] <= cap and stats["bytes"] == jllm_entry_bytes(replicas.redis.client())
    assert stats["count"] < 24                                        # the cap evicted some
