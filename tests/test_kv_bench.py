"""`jllm bench --multiturn` (cache/bench.py) end to end on a tiny synthetic model, with the shared-tier row
against a real redis-server: turn 2 on a fresh replica hydrates from Redis and answers as a recomputation."""

import json

import pytest
from synthetic import write_tiny_model

from jllm.cli import main
from redis_server import RedisServer, require_redis

pytestmark = pytest.mark.usefixtures("native_kernels")


def test_multiturn_with_the_shared_tier(tmp_path, monkeypatch, capsys):
    require_redis()
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "converted"))
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "qwen2", seed=5)
    redis = RedisServer(tmp_path).start()
    try:
        out = tmp_path / "bench.json"
        assert main(["bench", "--multiturn", "-m", str(path), "--conversations", "1", "--first-tokens", "300",
                     "-n", "4", "--kv-store", redis.url, "--json", str(out)]) == 0
        assert redis.client().keys("jllm:kv:e:*") == []          # the bench leaves nothing behind
    finally:
        redis.stop()
    assert "shared tier (a fresh replica)" in capsys.readouterr().out
    row = json.loads(out.read_text())["rows"][0]
    assert row["identical"] and row["identical_shared"]
    assert row["shared_cached_tokens"] == row["cached_tokens"] > 300
