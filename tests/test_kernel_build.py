"""The kernels' on-demand build (jllm/kernels/__init__.py): a dead build's lock file must not stop a start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from jllm import kernels

pytestmark = pytest.mark.usefixtures("kernels_required")


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path):
    """torch's builder waits for as long as its `lock` file exists; a build killed outright leaves one. With
    jllm's flock held no build is running, so the file is a dead one's: the start goes on instead of
    waiting forever. (A copy of this machine's finished build, so nothing is compiled.)"""
    built = kernels.build_dir()
    copy = tmp_path / "kernels" / built.name
    shutil.copytree(built, copy)
    (copy / "lock").write_text("")
    env = {**os.environ, "JLLM_KERNELS_DIR": str(tmp_path / "kernels")}
    proc = subprocess.run([sys.executable, "-c", "from jllm.kernels import qgemm; assert qgemm() is not None"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not (copy / "lock").exists()
