"""The same model on CUDA: logits match the CPU exact path; the engine generates. Skipped without a GPU
(CI has none; run on the borrowed H200, see BENCHMARKS.md)."""

import pytest
import torch

from cuda_checks import cuda_vs_cpu_exact
from jllm.engine import Engine
from jllm.sampling import SamplingParams
from synthetic import write_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_cuda_exact_matches_cpu(arch, tmp_path):
    assert cuda_vs_cpu_exact(tmp_path / f"{arch}.gguf", arch) < 1e-3


def test_cuda_bf16_engine_generates(tmp_path):
    path = tmp_path / "qwen2.gguf"
    write_tiny_model(path, "qwen2")
    eng = Engine(str(path), device="cuda", ctx_size=128)
    assert eng.precision == "bf16"
    res = eng.generate("hello", SamplingParams(max_tokens=8))
    assert len(res.token_ids) == 8
    sampled = eng.generate("hello", SamplingParams(max_tokens=8, temperature=0.8, seed=1))
    assert len(sampled.token_ids) == 8


def test_cuda_bench_reports_the_devices_memory(tmp_path):
    from jllm.bench import measure, print_table

    path = tmp_path / "qwen2.gguf"
    write_tiny_model(path, "qwen2")
    eng = Engine(str(path), device="cuda", ctx_size=128)
    r = measure(eng, prompt_tokens=16, decode_tokens=4, max_k=2, repeats=1)
    g = r["gpu_memory"]
    assert r["weights_mb"] > 0 and g["kv_mb"] > 0 and g["peak_mb"] >= r["weights_mb"] + g["kv_mb"]
    print_table(r)
