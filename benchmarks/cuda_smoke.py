"""CUDA smoke check for machines without pytest (the borrowed GPU): tests/test_cuda.py's checks, run plainly,
plus a speculative generation on the GPU. Prints one line per check and exits non-zero on a failure.

    python benchmarks/cuda_smoke.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]       # runs from a checkout, installed or not

from cuda_checks import cuda_vs_cpu_exact  # noqa: E402

from jllm.engine import Engine  # noqa: E402
from jllm.sampling import SamplingParams  # noqa: E402
from jllm.spec.config import SpecConfig  # noqa: E402


def main() -> int:
    d = Path(tempfile.mkdtemp())
    failures = 0
    for arch in ("llama", "qwen2", "qwen3", "gemma3"):
        rel = cuda_vs_cpu_exact(d / f"{arch}.gguf", arch)
        ok = rel < 1e-3
        failures += not ok
        print(f"{arch}: cuda exact vs cpu exact, max rel diff {rel:.2e} {'ok' if ok else 'FAIL'}")
    path = d / "qwen2.gguf"                                # written by the qwen2 check above
    eng = Engine(str(path), device="cuda", ctx_size=128)
    plain = eng.generate("hello", SamplingParams(max_tokens=16))
    spec = Engine(str(path), device="cuda", ctx_size=128, draft_path=str(path), spec=SpecConfig(mode="draft"))
    out = spec.generate("hello", SamplingParams(max_tokens=16))
    # (GPU GEMMs are not batch-invariant, so speculative output is not guaranteed bitwise equal there: shown,
    # not required)
    ok = eng.precision == "bf16" and spec.draft.precision == "bf16" and len(out.token_ids) == 16
    failures += not ok
    print(f"cuda bf16 engine: plain {len(plain.token_ids)} tokens, speculative identical: "
          f"{out.token_ids == plain.token_ids}, draft precision {spec.draft.precision} {'ok' if ok else 'FAIL'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
