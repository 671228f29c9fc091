"""Time a first start of `jllm chat` and a second one, as a new user meets them: fresh kernel build,
fresh weight conversion (and with --download fresh model downloads), then the same command again.

    python benchmarks/first_start.py [-m MODEL] [-md DRAFT] [--download]

Each run is `jllm chat ... < /exit` in a subprocess with its own JLLM_KERNELS_DIR / JLLM_CONVERTED_DIR (and
JLLM_MODELS_DIR with --download) under a temporary folder, so nothing of an earlier start is reused. It
prints a table: the kernel build alone, the first start (build + conversion [+ downloads] + load) and the
second start, in seconds of wall time to the chat prompt and out.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(cmd: list[str], env: dict, stdin: str = "") -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, input=stdin.encode(), capture_output=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr.decode()[-2000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--draft-model", default=None, help="a draft model (default: chat's own, the shipped head)")
    ap.add_argument("--download", action="store_true", help="also download the models afresh")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="jllm-first-start-") as tmp:
        root = Path(tmp)
        env = {**os.environ, "JLLM_KERNELS_DIR": str(root / "kernels-alone"),
               "JLLM_CONVERTED_DIR": str(root / "converted"), "JLLM_CACHE_DIR": str(root / "kv")}
        if a.download:
            env["JLLM_MODELS_DIR"] = str(root / "models")
        build = timed([sys.executable, "-c", "from jllm.kernels import qgemm; assert qgemm() is not None"], env)
        env["JLLM_KERNELS_DIR"] = str(root / "kernels")
        chat = [sys.executable, "-m", "jllm", "chat", "-m", a.model] + (["-md", a.draft_model] if a.draft_model else [])
        first = timed(chat, env, "/exit\n")
        second = timed(chat, env, "/exit\n")

    steps = "build + " + ("downloads + " if a.download else "") + "conversion + load"
    print(f"| {'step':<52} | {'seconds':>7} |")
    print(f"|{'-' * 54}|{'-' * 9}|")
    print(f"| {'kernel build alone':<52} | {build:>7.1f} |")
    print(f"| {'first start (' + steps + ')':<52} | {first:>7.1f} |")
    print(f"| {'second start':<52} | {second:>7.1f} |")


if __name__ == "__main__":
    main()
