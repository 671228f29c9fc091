"""The persistent KV cache through the engine and the CLI, on tiny synthetic models: a second turn in a new
engine evaluates only its new tokens and answers exactly as a full recomputation; damaged or foreign files
are never used; the draft's state travels too."""

import json
import os

import pytest

from jllm.engine import Engine
from jllm.sampling import SamplingParams
from jllm.spec.config import SpecConfig
from synthetic import write_tiny_model

pytestmark = pytest.mark.usefixtures("native_kernels")      # built before the first model runs

P = SamplingParams(max_tokens=12)
TURN1 = [{"role": "user", "content": "tell me about caches " * 8}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv")
    a, b = d / "a.gguf", d / "b.gguf"
    write_tiny_model(a, "qwen2", seed=5)
    write_tiny_model(b, "qwen2", seed=6)
    return str(a), str(b)


@pytest.fixture(autouse=True)
def _converted_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "converted"))


def two_turns(path, cache_dir, conv="c1", **kw):
    """Turn 1 in one engine, turn 2 in a fresh one (as a new process would); returns turn 2's result."""
    e1 = Engine(path, ctx_size=512, threads=1, kv_store_dir=cache_dir, **kw)
    r1 = e1.generate(e1.chat_ids(TURN1), P, conv_id=conv)
    e1.wait_saves()
    msgs = TURN1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "and then?"}]
    e2 = Engine(path, ctx_size=512, threads=1, kv_store_dir=cache_dir, **kw)
    ids = e2.chat_ids(msgs)
    return e2.generate(ids, P, conv_id=conv), ids, e2


def test_second_turn_reuses_state_and_matches_recomputation(models, tmp_path):
    res, ids, _ = two_turns(models[0], str(tmp_path / "kv"))
    assert res.timings.cached_tokens > len(ids) // 2
    assert res.timings.prompt_tokens_evaluated == len(ids) - res.timings.cached_tokens
    scratch = Engine(models[0], ctx_size=512, threads=1).generate(ids, P)
    assert scratch.timings.cached_tokens == 0
    assert res.token_ids == scratch.token_ids


def test_prefix_shared_without_conversation_id(models, tmp_path):
    cache = str(tmp_path / "kv")
    e1 = Engine(models[0], ctx_size=512, threads=1, kv_store_dir=cache)
    e1.generate(e1.chat_ids(TURN1), P)                  # anonymous entry
    e1.wait_saves()
    e2 = Engine(models[0], ctx_size=512, threads=1, kv_store_dir=cache)
    other = TURN1[:0] + [{"role": "user", "content": "tell me about caches " * 8 + "please"}]
    res = e2.generate(e2.chat_ids(other), P)
    assert res.timings.cached_tokens > 20


def test_corrupt_entry_is_detected_and_recomputed(models, tmp_path, capsys):
    cache = tmp_path / "kv"
    e1 = Engine(models[0], ctx_size=512, threads=1, kv_store_dir=str(cache))
    e1.generate(e1.chat_ids(TURN1), P, conv_id="c1")
    e1.wait_saves()
    f = cache / "c1.kv"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF
    f.write_bytes(bytes(data))
    e2 = Engine(models[0], ctx_size=512, threads=1, kv_store_dir=str(cache))
    ids = e2.chat_ids(TURN1)
    res = e2.generate(ids, P, conv_id="c1")
    assert res.timings.cached_tokens == 0
    assert "c1.kv" in capsys.readouterr().err
    assert res.token_ids == Engine(models[0], ctx_size=512, threads=1).generate(ids, P).token_ids


def test_state_of_another_model_is_never_used(models, tmp_path):
    cache = str(tmp_path / "kv")
    e1 = Engine(models[0], ctx_size=512, threads=1, kv_store_dir=cache)
    e1.generate(e1.chat_ids(TURN1), P, conv_id="c1")
    e1.wait_saves()
    e2 = Engine(models[1], ctx_size=512, threads=1, kv_store_dir=cache)
    res = e2.generate(e2.chat_ids(TURN1), P, conv_id="c1")
    assert res.timings.cached_tokens == 0


def test_draft_state_is_stored_and_restored(models, tmp_path):
    spec = SpecConfig(mode="draft")
    res, ids, eng = two_turns(models[0], str(tmp_path / "kv"), draft_path=models[0], spec=spec)
    assert res.timings.cached_tokens > 0
    assert eng.draft.ids[:res.timings.cached_tokens] == ids[:res.timings.cached_tokens]
    plain = Engine(models[0], ctx_size=512, threads=1).generate(ids, P)
    assert res.token_ids == plain.token_ids


def test_cli_conversation_turns_and_cache_commands(models, tmp_path, jllm_forks):
    env = dict(os.environ, JLLM_CACHE_DIR=str(tmp_path / "kv"), JLLM_CONVERTED_DIR=str(tmp_path / "conv"))

    def jllm(*args, env):                  # each command a process of its own, forked from a warm one
        return jllm_forks.run(list(args), env=env, cwd=tmp_path)

    base = ["chat", "-m", models[0], "-n", "8", "--conversation", "demo", "--json"]
    t1 = json.loads(jllm(*base, "-p", "hello there, how are caches kept? " * 6, env=env).stdout)
    t2 = json.loads(jllm(*base, "-p", "and evicted?", env=env).stdout)
    assert t1["turn"] == 1 and t2["turn"] == 2
    assert t2["timings"]["cached_tokens"] > 0
    assert t2["timings"]["prompt_tokens_evaluated"] < t2["timings"]["cached_tokens"]
    # the same second turn without the cache: same text, all tokens evaluated
    env2 = dict(env, JLLM_CACHE_DIR=str(tmp_path / "kv2"))
    jllm(*base, "--no-kv-cache", "-p", "hello there, how are caches kept? " * 6, env=env2)
    t2b = json.loads(jllm(*base, "--no-kv-cache", "-p", "and evicted?", env=env2).stdout)
    assert t2b["timings"]["cached_tokens"] == 0
    assert t2b["token_ids"] == t2["token_ids"]
    ls = jllm("cache", "ls", env=env)
    assert "demo" in ls.stdout
    assert "count" in jllm("cache", "stats", env=env).stdout
    bad = jllm("chat", "-m", models[0], "--conversation", "../../etc/passwd", "-p", "x", env=env)
    assert bad.returncode != 0 and bad.stderr.strip().startswith("jllm: invalid conversation id")
    assert len(bad.stderr.strip().splitlines()) == 1
    assert "removed: demo" in jllm("cache", "rm", "demo", env=env).stdout
    assert "demo" not in jllm("cache", "ls", env=env).stdout


def test_native_cache_is_f16_and_so_are_its_files(models, tmp_path):
    """On the native kernels the cache holds f16 (kv_cache.py says why); the persistent files keep that dtype,
    and a restored second turn still answers exactly as a recomputation (the first test)."""
    import torch

    from jllm.kernels import qgemm

    if qgemm() is None:
        pytest.skip("native kernels unavailable on this machine")
    cache = tmp_path / "kv"
    res, ids, e2 = two_turns(models[0], str(cache))
    assert e2.cache.k.dtype == torch.float16 and res.timings.cached_tokens > 0
    e2.wait_saves()                                    # turn 2's entry is written in the background
    files = list(cache.glob("*.kv"))
    assert files and all(b'"float16"' in f.read_bytes()[:4096] and b'"float32"' not in f.read_bytes()[:4096]
                         for f in files)
