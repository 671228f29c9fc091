"""Two `jllm serve` replicas on one real redis-server over a tiny synthetic model, for the replica benchmarks
(replicas_proxy.py, replicas_load.py): started under a temp dir on free loopback ports, each with its own local
cache dir, and stopped through the caller's ExitStack, also on errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]

import httpx  # noqa: E402

from redis_server import RedisServer, free_port  # noqa: E402


def wait_http(url: str, proc: subprocess.Popen, what: str, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up: {log.read_text()[-1500:]}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen, sig=signal.SIGINT) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def start_replicas(stack: ExitStack, d: Path, serve_args: list[str]) -> SimpleNamespace:
    """A tiny model, a redis-server and replicas A and B (`jllm serve -m MODEL --port P --cache-dir kv-X
    --kv-store URL *serve_args`), up and answering /health -> model, redis, its client, ports, procs."""
    os.environ["JLLM_CONVERTED_DIR"] = str(d / "converted")
    from synthetic import write_tiny_model

    model = d / "tiny.gguf"
    write_tiny_model(model, "qwen2", seed=10)
    redis = RedisServer(d).start()
    stack.callback(redis.stop)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JLLM_") or k == "JLLM_KERNELS_DIR"}
    env["JLLM_CONVERTED_DIR"] = str(d / "converted")
    ports, procs = {}, {}
    for name in ("A", "B"):
        ports[name] = free_port()
        procs[name] = subprocess.Popen(
            ["jllm", "serve", "-m", str(model), "--port", str(ports[name]), "--cache-dir", str(d / f"kv-{name}"),
             "--kv-store", redis.url, *serve_args],
            env=env, cwd=d, stdout=open(d / f"replica-{name}.log", "wb"), stderr=subprocess.STDOUT)
        stack.callback(stop, procs[name])
    for name in ("A", "B"):
        wait_http(f"http://127.0.0.1:{ports[name]}/health", procs[name], f"replica {name}", d / f"replica-{name}.log")
    return SimpleNamespace(model=model, redis=redis, rc=redis.client(), ports=ports, procs=procs)
