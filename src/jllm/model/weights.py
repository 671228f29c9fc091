"""GGUF tensors -> the compute representation of one model (exact float or int8), layer by layer.

Linears that read the same input are fused: q/k/v into one matrix, gate/up into one, so each layer makes
four matrix calls. The token embedding stays in the GGUF file: rows are dequantized exactly on lookup, so
it costs no memory beyond the pages touched.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from jllm.errors import JllmError
from jllm.gguf import quants
from jllm.gguf.reader import GGUFFile
from jllm.model.config import ModelConfig
from jllm.model.converted import ConvertedWriter, open_converted
from jllm.model.hugepages import HugePages
from jllm.model.linear import DenseLinear, Int8Linear, int8_supported, quantize_weight_int8
from jllm.model.qlinear import PackedMatrix, QLinear, pack_gguf_rows

# exact: f32 dequantized weights, f32 activations (the oracle path, 4 bytes per weight)
# native: the GGUF's own 4-bit blocks (Q4_K exactly, 0.58 bytes a weight), Q6_K on 6-bit tiles, other wide
#         types on 8-bit ones; int8 activations per block of 32, on jllm's AVX-512 VNNI or AVX2 kernel
#         (model/qlinear.py; the CPU default where it builds; 0.0015 nats KL from exact on the 1.5B)
# native4: native with every wider type requantized to 4 bits (the draft model's default: fewer bytes)
# int8: int8 weights on FBGEMM, two-pass int8 activations (the CPU fallback; 0.0018 nats KL from exact)
# int8-fast: int8 weights, one-pass int8 activations (half the GEMM rows: faster prefill and verify,
#            ~0.02 nats KL from exact)
# bf16 / f16: half-precision weights (CUDA)
# blocks: the GGUF's own blocks on the GPU with Triton kernels over them (jllm/cuda; CUDA, work in progress)
PRECISIONS = ("exact", "native", "native4", "int8", "int8-fast", "bf16", "f16", "blocks")
INT8 = ("int8", "int8-fast")
NATIVE = ("native", "native4")
CONVERTED = INT8 + NATIVE               # precisions whose converted matrices are cached on disk
_ROWS_PER_CHUNK = 8192
_CONVERT_VALUES = 1 << 20          # values per conversion chunk: 4 MB of f32, stays in cache


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: object               # Linear: [hidden] -> [q_dim + 2 * kv_dim]
    o: object
    ffn_norm: torch.Tensor
    gate_up: object           # Linear: [hidden] -> [2 * ffn]
    down: object
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None


def check_ids(lowest: int, highest: int, rows: int) -> None:
    """JllmError in one line unless token ids from lowest to highest all have a row of an embedding of `rows`."""
    if lowest < 0 or highest >= rows:
        raise JllmError(f"token id out of range 0..{rows - 1}")


class Embedding:
    """Exact row lookup straight from the GGUF bytes."""

    SMALL = 16                # calls of at most this many tokens go through the row cache
    CACHED_ROWS = 2048        # a conversation's working vocabulary; 6-12 MB for 0.5B-1.5B models

    def __init__(self, gguf: GGUFFile, name: str, device: torch.device):
        info = gguf.tensors[name]
        self.rows, self.cols = info.shape
        self.type = info.ggml_type
        self.table = gguf.raw(name).reshape(self.rows, -1)   # [vocab, bytes per row]
        self.device = device
        self._cache: dict[int, torch.Tensor] = {}         # token id -> dequantized row, oldest first

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() <= self.SMALL:                  # decode steps: recent rows are kept dequantized
            small = ids.tolist()                       # plain Python: a draft step's lookup runs cold, after
            if small:                                  # the weights' stream (numpy: ~0.1 ms)
                check_ids(min(small), max(small), self.rows)
            rows = [self._row(i) for i in small]
            return torch.stack(rows)
        idx = ids.cpu().numpy()
        check_ids(int(idx.min()), int(idx.max()), self.rows)
        out = self._dequantize(idx)
        self._keep(idx.tolist(), out)
        return out

    def _keep(self, ids: list[int], rows: torch.Tensor) -> None:
        """A prompt's rows into the row cache (copies, not views of the chunk), its latest CACHED_ROWS ids:
        a reply that repeats the prompt's words then finds their rows without dequantizing them."""
        for j, i in enumerate(ids):                      # in order: the LRU keeps the latest ids
            self._row(i, lambda j=j: rows[j].clone())

    def _row(self, i: int, make=None) -> torch.Tensor:
        """Row i from a small LRU cache (a step's lookup otherwise costs ~0.4 ms of numpy), else make() (by
        default its dequantization), cached; the row moves to the newest end, the oldest goes past CACHED_ROWS."""
        cache = self._cache
        row = cache.pop(i, None)
        if row is None:
            row = make() if make is not None else self._dequantize(np.array([i]))[0]
            if len(cache) >= self.CACHED_ROWS:
                del cache[next(iter(cache))]
        cache[i] = row
        return row

    def _dequantize(self, idx: np.ndarray) -> torch.Tensor:
        rows = np.ascontiguousarray(self.table[idx])
        return quants.dequantize(rows, self.type, (len(idx), self.cols)).to(self.device)


def _device_embedding(gguf: GGUFFile, weights, output_name: str, device: torch.device):
    """The blocks precision's embedding: looked up on the GPU from its Q4_K blocks (jllm.cuda.embedding), from
    the output matrix's own device copy where the two are one tensor."""
    from jllm.cuda.embedding import DeviceEmbedding
    from jllm.cuda.linear import device_weight
    from jllm.cuda.q4_k import Q4KWeight

    info = gguf.tensors["token_embd.weight"]
    parts = getattr(weights.output, "parts", [])
    if output_name == "token_embd.weight" and len(parts) == 1 and isinstance(parts[0], Q4KWeight) \
            and parts[0].shape == tuple(info.shape):
        return DeviceEmbedding(parts[0])
    return DeviceEmbedding(device_weight(gguf.raw("token_embd.weight"), quants.T.Q4_K, tuple(info.shape), device))


@dataclass
class Weights:
    embed: Embedding
    layers: list[LayerWeights]
    output_norm: torch.Tensor
    output: object

    def matrices(self) -> list:
        """Every linear layer a decode step reads, in order: per layer qkv, o, gate_up, down; then the output."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.output]

    def nbytes(self) -> int:
        """The matrices' bytes, and an embedding held on the device in its own copy (jllm.cuda.embedding)."""
        own = getattr(self.embed, "weight", None)
        shared = own is not None and any(p is own for p in getattr(self.output, "parts", []))
        return sum(lin.nbytes() for lin in self.matrices()) + (own.nbytes() if own is not None and not shared else 0)


class _Builder:
    def __init__(self, gguf: GGUFFile, precision: str, device: torch.device, use_cache: bool):
        if precision not in PRECISIONS:
            raise JllmError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
        if precision in INT8 and (device.type != "cpu" or not int8_supported()):
            raise JllmError(f"precision {precision} needs an x86 CPU with FBGEMM; use --precision bf16 on this device")
        if precision in NATIVE and (device.type != "cpu" or not native_supported()):
            from jllm.kernels import why_unavailable

            raise JllmError(f"precision {precision} needs jllm's CPU kernels: {why_unavailable() or 'not on this device'}; "
                            "use --precision int8")
        if precision == "blocks":
            from jllm.cuda.linear import check_device
            check_device(device)
        self.gguf, self.precision, self.device = gguf, precision, device
        self.reader = self.writer = None
        self.pages = HugePages()                # the kernel's packed weights: streamed every step
        if precision in CONVERTED and use_cache:
            try:
                kind = precision if precision in NATIVE else "int8"      # both int8 modes share the weights
                self.reader, path = open_converted(gguf.path, kind)
                if self.reader is None:
                    self.writer = ConvertedWriter(path, {"gguf": str(gguf.path), "precision": precision})
            except OSError:
                self.reader = self.writer = None       # read-only or full disk: convert in memory only

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def vector(self, name: str) -> torch.Tensor:
        if not self.has(name):
            raise JllmError(f"{self.gguf.path}: tensor {name!r} is missing")
        info = self.gguf.tensors[name]
        return self._dequantize(name, self.gguf.raw(name), info.shape).to(self.device)

    def _dequantize(self, name: str, raw, shape) -> torch.Tensor:
        info = self.gguf.tensors[name]
        if info.ggml_type not in quants.SUPPORTED_TYPES:
            raise JllmError(f"{self.gguf.path}: tensor {name!r} has type {info.ggml_type.name}, which is not "
                            f"supported by jllm (supported: {', '.join(sorted(t.name for t in quants.SUPPORTED_TYPES))})")
        return quants.dequantize(raw, info.ggml_type, shape)

    def optional_vector(self, name: str) -> torch.Tensor | None:
        return self.vector(name) if self.has(name) else None

    def _float_rows(self, name: str):
        """Yield [rows, cols] float32 chunks of a matrix, so the whole f32 copy never exists at once."""
        rows, cols = self._matrix_info(name).shape
        table = self.gguf.raw(name).reshape(rows, -1)
        for r in range(0, rows, _ROWS_PER_CHUNK):
            chunk = table[r:r + _ROWS_PER_CHUNK]
            yield self._dequantize(name, chunk, (chunk.shape[0], cols))

    def _int8_matrix(self, names: list[str], max_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The row-wise concatenation of the named matrices as int8 [N, K] with per-row scales [N]
        (of a single matrix, only its first max_rows rows when given)."""
        key = "+".join(names) + (f"[:{max_rows}]" if max_rows else "")
        if self.reader is not None and key + ":q" in self.reader.tensors:
            return self.reader.get(key + ":q"), self.reader.get(key + ":scale")
        infos = [self._matrix_info(n) for n in names]
        if max_rows:
            info = infos[0]
            row_bytes = info.nbytes // info.shape[0]
            max_rows = min(max_rows, info.shape[0])
            infos = [type(info)(info.name, (max_rows, info.shape[1]), info.ggml_type, info.offset, max_rows * row_bytes)]
        cols = infos[0].shape[1]
        n_rows = sum(i.shape[0] for i in infos)
        q = torch.empty(n_rows, cols, dtype=torch.int8)
        scale = torch.empty(n_rows)
        row = 0
        for info in infos:
            rows = info.shape[0]
            chunk = max(1, min(rows, _CONVERT_VALUES // cols))
            buf = torch.empty(chunk * cols)
            raw = self.gguf.raw(info.name)[:info.nbytes]
            for r0, block in quants.dequantize_rows(raw, info.ggml_type, info.shape, chunk, buf):
                n = block.shape[0]
                quantize_weight_int8(block, out=q[row + r0:row + r0 + n], scale_out=scale[row + r0:row + r0 + n])
            self.gguf.release(info.name)
            row += rows
        if self.writer is not None:
            self.writer.add(key + ":q", q)
            self.writer.add(key + ":scale", scale)
        return q, scale

    def _native_matrix(self, names: list[str], max_rows: int | None, bias: torch.Tensor | None) -> QLinear:
        key = "+".join(names) + (f"[:{max_rows}]" if max_rows else "")
        infos = [self._matrix_info(n) for n in names]
        cols = infos[0].shape[1]
        if self.reader is not None and key + ":data" in self.reader.tensors:
            data = self.reader.get(key + ":data", self.pages.empty)
            offsets, kinds = (self.reader.get(key + part) for part in (":offsets", ":kinds"))
            rows = int(self.reader.get(key + ":rows")[0])
            return QLinear(data, offsets, kinds, rows, cols, bias)
        matrix = PackedMatrix(cols)
        for info in infos:
            rows = min(max_rows, info.shape[0]) if max_rows else info.shape[0]
            raw = self.gguf.raw(info.name)[:info.nbytes // info.shape[0] * rows]
            pack_gguf_rows(matrix, raw, info.ggml_type, rows, four_bit=self.precision == "native4")
            self.gguf.release(info.name)
        rows = matrix.rows
        data, offsets, kinds = matrix.pack()
        data = self.pages.adopt(data)
        if self.writer is not None:
            for part, t in ((":data", data), (":offsets", offsets), (":kinds", kinds),
                            (":rows", torch.tensor([rows], dtype=torch.int64))):
                self.writer.add(key + part, t)
        return QLinear(data, offsets, kinds, rows, cols, bias)

    def _blocks_matrix(self, names: list[str], max_rows: int | None, bias: torch.Tensor | None):
        """The `blocks` precision: the matrices in their own block types on the device (jllm/cuda), neighbours
        of one type as one part (q|k|v or gate|up in one kernel launch), or bf16 for a type without a GPU
        kernel; of a single matrix only its first max_rows rows when given."""
        from jllm.cuda.layout import BLOCK_TYPES
        from jllm.cuda.linear import BlocksLinear, device_weight

        runs: list[tuple] = []                     # (block type or None, [file rows of each matrix], cols)
        for name in names:
            info = self._matrix_info(name)
            rows, cols = info.shape
            if max_rows:
                rows = min(rows, max_rows)
            if info.ggml_type in BLOCK_TYPES:
                raw = self.gguf.raw(name).reshape(info.shape[0], -1)[:rows]
                if runs and runs[-1][0] == info.ggml_type:
                    runs[-1][1].append(raw)
                else:
                    runs.append((info.ggml_type, [raw], cols))
            else:
                w = torch.cat([c.to(torch.bfloat16) for c in self._float_rows(name)])[:rows]
                runs.append((None, [w.to(self.device)], cols))
        parts = []
        for kind, raws, cols in runs:
            if kind is None:
                parts.append(raws[0])
            else:                                  # a block row is a row of the file: rows concatenate as bytes
                raw = np.concatenate(raws) if len(raws) > 1 else raws[0]
                parts.append(device_weight(raw, kind, (raw.shape[0], cols), self.device))
        return BlocksLinear(parts, bias)

    def _matrix_info(self, name: str):
        if not self.has(name):
            raise JllmError(f"{self.gguf.path}: tensor {name!r} is missing")
        info = self.gguf.tensors[name]
        if len(info.shape) != 2:
            raise JllmError(f"{self.gguf.path}: tensor {name!r} should be a matrix, has shape {info.shape}")
        if info.ggml_type not in quants.SUPPORTED_TYPES:
            self._dequantize(name, None, info.shape)          # raises the one-line error
        return info

    def linear(self, names: list[str], biases: list[str | None] | None = None, max_rows: int | None = None):
        """One linear layer from the row-wise concatenation of the named matrices."""
        bias = None
        if biases and any(b and self.has(b) for b in biases):
            parts = []
            for name, b in zip(names, biases):
                parts.append(self.vector(b) if b and self.has(b) else
                             torch.zeros(self.gguf.tensors[name].shape[0], device=self.device))
            bias = torch.cat(parts)
        if self.precision in NATIVE:
            return self._native_matrix(names, max_rows, bias)
        if self.precision == "blocks":
            return self._blocks_matrix(names, max_rows, bias)
        if self.precision in INT8:
            q, scale = self._int8_matrix(names, max_rows)
            return Int8Linear(q, scale, bias, residual=self.precision == "int8")
        dtype = {"exact": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[self.precision]
        chunks = [c.to(dtype) for name in names for c in self._float_rows(name)]
        w = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
        if max_rows:
            w = w[:max_rows].clone()
        return DenseLinear(w.to(self.device), bias)


def layer_matrices(i: int) -> dict[str, list[str]]:
    """The GGUF matrices of layer i, grouped as they are fused into one matrix call each (`jllm plan` sizes
    the same groups)."""
    p = f"blk.{i}."
    return {"qkv": [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
            "o": [p + "attn_output.weight"],
            "gate_up": [p + "ffn_gate.weight", p + "ffn_up.weight"],
            "down": [p + "ffn_down.weight"]}


def output_matrix(cfg: ModelConfig) -> str:
    return "token_embd.weight" if cfg.tied_embeddings else "output.weight"


def _biases(names: list[str]) -> list[str]:
    return [n.removesuffix(".weight") + ".bias" for n in names]


def load_weights(gguf: GGUFFile, cfg: ModelConfig, precision: str, device: torch.device,
                 use_cache: bool = True, output_rows: int | None = None) -> Weights:
    """use_cache: read int8 matrices converted by an earlier load, or save them for the next one."""
    b = _Builder(gguf, precision, device, use_cache)
    layers = []
    progress = _conversion_progress(gguf, precision, b, cfg.n_layers + 1)
    packing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jllm-pack")
    pending: deque = deque()
    for i in range(cfg.n_layers):
        p, m = f"blk.{i}.", layer_matrices(i)
        layers.append(LayerWeights(
            attn_norm=b.vector(p + "attn_norm.weight"),
            qkv=b.linear(m["qkv"], _biases(m["qkv"])),
            o=b.linear(m["o"], _biases(m["o"])),
            ffn_norm=b.vector(p + "ffn_norm.weight"),
            gate_up=b.linear(m["gate_up"]),
            down=b.linear(m["down"]),
            q_norm=b.optional_vector(p + "attn_q_norm.weight"),
            k_norm=b.optional_vector(p + "attn_k_norm.weight"),
            post_attn_norm=b.optional_vector(p + "post_attention_norm.weight"),
            post_ffn_norm=b.optional_vector(p + "post_ffw_norm.weight"),
        ))
        for lin in (layers[-1].qkv, layers[-1].o, layers[-1].gate_up, layers[-1].down):
            if isinstance(lin, Int8Linear):
                pending.append(packing.submit(lin.pack))
        while len(pending) > 8:              # bound the unpacked int8 copies held at once
            pending.popleft().result()
        _release_memory(collect=False)
        progress.update()
    output_name = output_matrix(cfg)
    weights = Weights(
        embed=Embedding(gguf, "token_embd.weight", device),
        layers=layers,
        output_norm=b.vector("output_norm.weight"),
        output=b.linear([output_name], max_rows=output_rows),
    )
    if b.precision == "blocks" and gguf.tensors["token_embd.weight"].ggml_type == quants.T.Q4_K:
        weights.embed = _device_embedding(gguf, weights, output_name, device)
    if isinstance(weights.output, Int8Linear):
        pending.append(packing.submit(weights.output.pack))
    for f in pending:
        f.result()
    packing.shutdown()
    progress.update()
    progress.close()
    if b.writer is not None:
        try:
            b.writer.commit()
        except OSError:
            pass                                     # no room for the cache: next load converts again
    _release_memory()
    return weights


def _conversion_progress(gguf: GGUFFile, precision: str, b: _Builder, steps: int):
    """A progress bar over the layers while the weights are converted (tens of seconds for the 1.5B on the
    first load; later loads read the converted file in about a second and show nothing). One plain line
    where stderr is not a terminal."""
    from tqdm import tqdm

    converting = precision in CONVERTED and b.reader is None and gguf.path.stat().st_size > 64 << 20  # ~1 s+
    if converting and not sys.stderr.isatty():
        print(f"jllm: converting {gguf.path.name} for this CPU ({precision}; once)...", file=sys.stderr, flush=True)
    return tqdm(total=steps, desc=f"jllm: converting {gguf.path.name} (once)", unit="layer", file=sys.stderr,
                leave=False, disable=not (converting and sys.stderr.isatty()))


def native_supported() -> bool:
    from jllm.kernels import qgemm

    return qgemm() is not None


def _release_memory(collect: bool = True) -> None:
    """Hand freed conversion buffers back to the OS, so peak RSS stays near the final weights' size."""
    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
