"""jllm.gguf.quants against gguf-py's numpy dequantizer (the oracle), compared bit for bit.

Bitwise means the float32 bit patterns: signed zeros and NaN payloads must agree too, so results are
compared as int32 views, not with torch.equal on floats (which calls -0.0 equal to 0.0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

import jllm.gguf.quants as quants
from jllm.errors import JllmError
from jllm.gguf.quants import SUPPORTED_TYPES, dequantize, dequantize_rows
from jllm.gguf.reader import read_gguf

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
# byte offsets of the f16 scale fields (d, and m / dmin where there is one) in each block
F16_FIELDS = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2),
    T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}
ALL_TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.value)


def oracle(raw: np.ndarray, ggml_type: T, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf_quants.dequantize(raw, ggml_type)).reshape(shape))


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    diff = got.view(torch.int32) != want.view(torch.int32)
    assert not diff.any(), (f"{int(diff.sum())} of {diff.numel()} values differ, first at flat index "
                            f"{int(diff.view(-1).nonzero()[0])}")


def synthetic(ggml_type: T, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random block bytes with the f16 scale fields set to finite values: normal, tiny, subnormal, zero,
    negative. Float types keep fully random bytes (NaNs and infinities included)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_blocks = int(np.prod(shape)) // block_size
    raw = rng.integers(0, 256, n_blocks * type_size, dtype=np.uint8)
    blocks = raw.reshape(n_blocks, type_size)
    for off in F16_FIELDS.get(ggml_type, ()):
        scale = rng.normal(size=n_blocks) * 10.0 ** rng.uniform(-7, 1, size=n_blocks)
        scale[rng.random(n_blocks) < 0.05] = 0.0
        blocks[:, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw


def shapes_for(ggml_type: T) -> list[tuple[int, ...]]:
    bs = GGML_QUANT_SIZES[ggml_type][0]
    return [(bs,), (1, bs), (3, 2 * bs), (2, 3, bs), (5, 7 * bs)]


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_synthetic_matches_gguf_py(ggml_type):
    for i, shape in enumerate(shapes_for(ggml_type)):
        raw = synthetic(ggml_type, shape, seed=i)
        got = dequantize(raw, ggml_type, shape)
        assert_bitwise(got, oracle(raw, ggml_type, shape))
        if ggml_type not in FLOAT_TYPES:
            assert not got.isnan().any() and got.isfinite().all()


@pytest.mark.parametrize("ggml_type", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_types_keep_nan_payloads(ggml_type):
    # Every 16-bit pattern (F16, BF16), and enough random F32 patterns to hit NaNs of both kinds.
    if ggml_type == T.F32:
        raw = np.random.default_rng(1).integers(0, 256, 4 << 16, dtype=np.uint8)
    else:
        raw = np.arange(1 << 16, dtype=np.uint16).view(np.uint8)
    n = raw.size // GGML_QUANT_SIZES[ggml_type][1]
    got = dequantize(raw, ggml_type, (n,))
    assert got.isnan().any()
    assert_bitwise(got, oracle(raw, ggml_type, (n,)))


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_chunk_boundaries_rows_and_out(ggml_type, monkeypatch):
    """Many inner chunks (with a short last one), row chunks, out=, and a torch input at an odd offset."""
    monkeypatch.setattr(quants, "CHUNK_VALUES", 64)
    bs, ts = GGML_QUANT_SIZES[ggml_type]
    shape = (7, 3 * bs) if bs > 1 else (7, 45)
    raw = synthetic(ggml_type, shape, seed=7)
    want = oracle(raw, ggml_type, shape)
    assert_bitwise(dequantize(raw, ggml_type, shape), want)

    out = torch.full(shape, float("nan"))
    assert dequantize(raw, ggml_type, shape, out=out).data_ptr() == out.data_ptr()
    assert_bitwise(out, want)

    chunks = list(dequantize_rows(raw, ggml_type, shape, rows_per_chunk=3))
    assert [r0 for r0, _ in chunks] == [0, 3, 6]
    assert [c.shape[0] for _, c in chunks] == [3, 3, 1]
    assert_bitwise(torch.cat([c for _, c in chunks]), want)

    buf = torch.empty(3 * shape[1])
    for r0, chunk in dequantize_rows(raw, ggml_type, shape, rows_per_chunk=3, out=buf):
        assert chunk.data_ptr() == buf.data_ptr()
        assert_bitwise(chunk, want[r0:r0 + 3])

    padded = torch.zeros(raw.size + 3, dtype=torch.uint8)
    padded[3:] = torch.from_numpy(raw)
    assert_bitwise(dequantize(padded[3:], ggml_type, shape), want)


def test_caller_thread_setting_is_restored():
    before = torch.get_num_threads()
    raw = synthetic(T.Q4_K, (4, 256))
    dequantize(raw, T.Q4_K, (4, 256))
    assert torch.get_num_threads() == before
    chunks = dequantize_rows(raw, T.Q4_K, (4, 256), rows_per_chunk=1)
    next(chunks)
    assert torch.get_num_threads() == before     # also between chunks, while the caller runs


def test_unsupported_type_names_it():
    with pytest.raises(JllmError, match=r"^tensor type IQ2_XS is not supported \(supported: .*Q4_K.*\)$"):
        dequantize(np.zeros(66, dtype=np.uint8), T.IQ2_XS, (256,))


def test_wrong_sizes_are_reported():
    with pytest.raises(JllmError, match="needs 144 bytes, got 143"):
        dequantize(np.zeros(143, dtype=np.uint8), T.Q4_K, (256,))
    with pytest.raises(JllmError, match="not a multiple of the block size 32"):
        dequantize(np.zeros(34, dtype=np.uint8), T.Q8_0, (1, 40))


# alias -> the tensor types its file must contain (all of them are checked)
REAL_TYPES = {
    "qwen2.5-coder-1.5b": {T.Q4_K, T.Q6_K, T.F32},
    "qwen2.5-coder-0.5b": {T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K, T.F32},
    "gemma-3-270m": {T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K, T.F32},
    "smollm2-135m": {T.Q4_1, T.Q8_0, T.F32},
}
ROWS = 96   # rows compared at the head and at the tail of each chosen tensor


@pytest.mark.parametrize("alias", list(REAL_TYPES))
def test_real_tensors_match_gguf_py(alias, real_model):
    g = read_gguf(real_model(alias))
    by_type: dict[T, list] = {}
    for info in g.tensors.values():
        by_type.setdefault(info.ggml_type, []).append(info)
    assert REAL_TYPES[alias] <= set(by_type), f"{alias}: types {sorted(t.name for t in by_type)}"
    for ggml_type, infos in by_type.items():
        # the first tensor of the type, and its biggest (often the embedding or output matrix)
        for name in dict.fromkeys([infos[0].name, max(infos, key=lambda i: i.n_elements).name]):
            info = g.tensors[name]
            rows = int(np.prod(info.shape[:-1]))
            table = g.raw(info.name).reshape(rows, -1)
            for r0 in sorted({0, max(0, rows - ROWS)}):
                part = table[r0:r0 + ROWS]
                shape = (part.shape[0], info.shape[-1])
                got = dequantize(part, ggml_type, shape)
                assert_bitwise(got, oracle(part, ggml_type, shape))
                assert not got.isnan().any(), info.name


def test_real_matrix_row_chunks_match_whole(real_model):
    """The chunked path over a whole real Q6_K matrix agrees with one dequantize call and with gguf-py."""
    g = read_gguf(real_model("qwen2.5-coder-0.5b"))
    info = next(i for i in g.tensors.values() if i.ggml_type == T.Q6_K and len(i.shape) == 2)
    raw = g.raw(info.name)
    whole = dequantize(raw, info.ggml_type, info.shape)
    for r0, chunk in dequantize_rows(raw, info.ggml_type, info.shape, rows_per_chunk=1000):
        assert_bitwise(chunk, whole[r0:r0 + chunk.shape[0]])
    mid = info.shape[0] // 2
    part = raw.reshape(info.shape[0], -1)[mid:mid + 64]
    assert_bitwise(whole[mid:mid + 64], oracle(part, info.ggml_type, (64, info.shape[1])))
