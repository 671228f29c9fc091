"""The CUDA checks shared by tests/test_cuda.py and benchmarks/cuda_smoke.py (which runs them where pytest is
not installed)."""

import torch

from jllm.model.loader import load_model
from synthetic import write_tiny_model


def cuda_vs_cpu_exact(path, arch: str) -> float:
    """Write a tiny `arch` model at path; the max relative difference of its logits, CUDA exact vs CPU exact."""
    write_tiny_model(path, arch)
    ids = torch.arange(3, 23)
    cpu = load_model(path, device="cpu", precision="exact", cache_weights=False)
    gpu = load_model(path, device="cuda", precision="exact", cache_weights=False)
    a = cpu.forward(ids, cpu.new_cache(64))
    b = gpu.forward(ids.cuda(), gpu.new_cache(64)).cpu()
    return ((a - b).abs().max() / a.abs().max()).item()
