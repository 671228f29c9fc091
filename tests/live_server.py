"""An app served by uvicorn on a thread, on a free loopback port, for tests that talk HTTP to a real server."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import uvicorn


def serve_app(app) -> SimpleNamespace:
    """Start serving `app` -> base ("http://127.0.0.1:PORT") and stop(), which shuts the server down."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)

    def stop():
        server.should_exit = True
        thread.join(30)
        sock.close()
    return SimpleNamespace(base=f"http://127.0.0.1:{sock.getsockname()[1]}", stop=stop)
