"""A real redis-server for tests: started on 127.0.0.1 on a free port in a temp dir, without persistence,
and stopped (or killed, and started again on the same port) by the test."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def require_redis() -> None:
    """Skip the calling test, with the reason, when redis-server or the redis client is missing."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; .ci/run does it)")
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the redis client is not installed (pip install 'jllm[test]')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jllm_entry_bytes(client, prefix: str = "jllm:kv:") -> int:
    """What jllm's entries hold in a Redis: every chunk and every head under `prefix` (cache/shared.py's keys),
    to check the shared tier's own accounting against."""
    return (sum(client.strlen(k) for k in client.scan_iter(f"{prefix}c:*", count=1000))
            + sum(len(client.hget(k, "meta") or b"") for k in client.scan_iter(f"{prefix}e:*", count=1000)))


class RedisServer:
    def __init__(self, directory: Path, password: str | None = None, tls: bool = False):
        """tls: serve TLS only, with a self-signed certificate for 127.0.0.1 made by openssl (the test
        skips where openssl is missing); `url` then says rediss:// and names the certificate as its CA."""
        self.dir, self.password, self.port, self.tls = Path(directory), password, free_port(), tls
        self.proc: subprocess.Popen | None = None
        if tls:
            if shutil.which("openssl") is None:
                pytest.skip("openssl is not installed: no certificate for a TLS redis-server")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                            "-keyout", str(self.dir / "key.pem"), "-out", str(self.dir / "cert.pem"),
                            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                           check=True, capture_output=True)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.dir / 'cert.pem'}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self):
        import redis
        return redis.Redis.from_url(self.url)

    def start(self) -> "RedisServer":
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no"]
        if self.tls:
            args[1:3] = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.dir / "cert.pem"),
                         "--tls-key-file", str(self.dir / "key.pem"), "--tls-ca-cert-file",
                         str(self.dir / "cert.pem"), "--tls-auth-clients", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=open(self.dir / "redis.log", "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if self.tls and self.proc.poll() is not None and "tls" in (self.dir / "redis.log").read_text().lower():
                    pytest.skip("this redis-server was built without TLS")
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {(self.dir / 'redis.log').read_text()[-500:]}")
                time.sleep(0.02)

    def stop(self) -> None:
        """Kill the server (SIGKILL: a crash, nothing is flushed) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
