"""load_model: a GGUF path -> a ready Transformer (config read, weights converted)."""

from __future__ import annotations

import importlib.util
import os

import torch

from jllm.errors import JllmError
from jllm.gguf.reader import GGUFFile, read_gguf
from jllm.model.config import check_shapes, config_from_gguf
from jllm.model.transformer import Transformer
from jllm.model.weights import load_weights
from jllm.model.weights import native_supported


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise JllmError("--device cuda: no CUDA device is available to this torch build "
                        f"(torch {torch.__version__}); use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise JllmError(f"unsupported device {device!r} (use cpu or cuda)")
    return dev


def default_precision(device: torch.device) -> str:
    """native (else int8) on the CPU; on an NVIDIA GPU of compute capability 8.0 or more (Ampere: the origin
    document's Jetson is 8.7) the GGUF's own blocks (jllm.cuda: ~8x bf16's decode on the H200, BENCHMARKS.md
    "CUDA") where triton is there to compile their kernels (their inline PTX needs CUDA, not ROCm), else bf16."""
    if device.type != "cpu":
        return "blocks" if _blocks_possible(device) else "bf16"
    return "native" if native_supported() else "int8"


def _blocks_possible(device: torch.device) -> bool:
    if device.type != "cuda" or torch.version.hip is not None or importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def load_model(path: str | os.PathLike | GGUFFile, device: str | torch.device | None = "cpu",
               precision: str | None = None, max_positions: int | None = None,
               cache_weights: bool = True, output_rows: int | None = None) -> Transformer:
    """cache_weights: keep converted int8 matrices on disk so the next load of this file is fast.
    output_rows: compute logits only for token ids below this (a draft model's frequent-token subset)."""
    gguf = path if isinstance(path, GGUFFile) else read_gguf(path)
    cfg = config_from_gguf(gguf.metadata, set(gguf.tensors), source=str(gguf.path))
    check_shapes(cfg, {n: tuple(t.shape) for n, t in gguf.tensors.items()}, str(gguf.path))
    dev = resolve_device(device)
    precision = precision or default_precision(dev)
    if precision == "blocks" and (cfg.head_dim & (cfg.head_dim - 1) or cfg.n_heads % cfg.n_kv_heads):
        raise JllmError(f"{gguf.path.name}: precision blocks needs a power-of-two head size and query heads a "
                        f"multiple of the kv heads (has {cfg.head_dim}, {cfg.n_heads} / {cfg.n_kv_heads}); "
                        "use --precision bf16")
    weights = load_weights(gguf, cfg, precision, dev, cache_weights, output_rows)
    model = Transformer(cfg, weights, dev, max_positions or cfg.context_length)
    model.gguf = gguf
    return model
