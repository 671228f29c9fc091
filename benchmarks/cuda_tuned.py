"""Run a jllm command with the GPU matvec settings a tuning sweep chose (benchmarks/cuda_matvec.py --best FILE),
to see what they give end to end before they are written into jllm.cuda.matvec.setting. A setting stays a
function of the matrix alone (never of the row count), so every exactness property holds under it.

    python benchmarks/cuda_matvec.py --best /tmp/best.json ...
    python benchmarks/cuda_tuned.py /tmp/best.json bench -m MODEL --device cuda --precision blocks
    python benchmarks/cuda_tuned.py /tmp/best.json --script benchmarks/cuda_profile.py MODEL
The table applies to whichever kernels run a matrix (the float ones, or dp4a's with JLLM_MATVEC_DP4A): give it a
sweep made with the same kernels on.
"""

from __future__ import annotations

import json
import runpy
import sys

from jllm.cuda import dp4a, matvec


def main() -> None:
    with open(sys.argv[1]) as f:
        text = f.read()
    table = {k: tuple(v) for k, v in (json.loads(text) if text.strip() else {}).items()}   # empty: the defaults
    default, default_dp4a = matvec.setting, dp4a.setting

    def chosen(w):
        n, k = w.shape
        kind = type(w).__name__.replace("Weight", "").replace("Q4K", "Q4_K").replace("Q6K", "Q6_K")
        got = table.get(f"{kind} {n}x{k}")
        return got if got is not None and len(got) == 4 else None

    def tuned(w):                       # the float kernels' (block_n, sb, split, stages)
        got = chosen(w)
        return got if got is not None else default(w)

    def tuned_dp4a(w):                  # the dp4a kernels' (block_n, sb, split): a sweep run with them on
        got = chosen(w)
        return got[:3] if got is not None else default_dp4a(w)

    matvec.setting, dp4a.setting = tuned, tuned_dp4a
    if sys.argv[2] == "--script":
        sys.argv = sys.argv[3:]
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        from jllm.cli import main as cli

        sys.argv = ["jllm", *sys.argv[2:]]
        sys.exit(cli())


if __name__ == "__main__":
    main()
