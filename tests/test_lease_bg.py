"""benchmarks/lease_bg.sh on the CPU: jobs queued in one call run one after another, each in the tree as it was
when queued, with its variables, sharing one out folder; poll reports their states and archives what they
wrote (what a device lease brings back between the calls that carry the target's pieces)."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "lease_bg.sh"


def _run(tree: Path, lease: Path, *args: str, out: Path | None = None) -> str:
    env = {**os.environ, "LEASE_DIR": str(lease)}
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tree, env=env, check=True, capture_output=True,
                          text=True, timeout=60).stdout


def test_jobs_run_in_order_in_their_own_tree(tmp_path):
    tree, lease, out = tmp_path / "tree", tmp_path / "lease", tmp_path / "call_out"
    tree.mkdir(), out.mkdir()
    (tree / "which.txt").write_text("first tree")
    (tree / ".xfer").mkdir()
    (tree / ".xfer" / "p00").write_text("a piece of the target")
    # the first job is slow and leaves a file the second reads; the second must not start before it ends
    _run(tree, lease, "start", "slow", "MSG=a b", "--", "bash", "-c",
         'sleep 1.5; echo "$MSG" > "$OUT/first.txt"; cat which.txt >> "$OUT/first.txt"; ls .xfer > "$OUT/xfer.txt"')
    (tree / "which.txt").write_text("second tree")       # a later call's tree: the first job keeps its own copy
    _run(tree, lease, "start", "fast", "--", "bash", "-c",
         'cat "$OUT/first.txt" > "$OUT/second.txt" && cat which.txt >> "$OUT/second.txt"; exit 3')
    queued = _run(tree, lease, "poll")
    assert "== 00-slow: running" in queued or "== 00-slow: queued" in queued
    assert "== 01-fast: queued" in queued
    waited = _run(tree, lease, "wait", "30", out=out)
    assert "== 00-slow: done rc=0" in waited and "== 01-fast: done rc=3" in waited
    assert (lease / "out" / "first.txt").read_text() == "a b\nfirst tree"
    assert (lease / "out" / "second.txt").read_text() == "a b\nfirst treesecond tree"
    assert (lease / "out" / "xfer.txt").read_text() == ""       # the pieces stay out of the jobs' copies
    with tarfile.open(out / "bg.tgz") as t:
        names = set(t.getnames())
    assert {"out/first.txt", "out/second.txt", "jobs/00-slow/log", "jobs/01-fast/log"} <= names


def test_start_without_a_command_is_refused(tmp_path):
    env = {**os.environ, "LEASE_DIR": str(tmp_path / "lease")}
    r = subprocess.run(["bash", str(SCRIPT), "start", "x", "A=1"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "start NAME" in r.stderr
    r = subprocess.run(["bash", str(SCRIPT), "nonsense"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr
