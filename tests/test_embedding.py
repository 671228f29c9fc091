"""jllm.model.weights.Embedding: exact rows from the GGUF's blocks, and its row cache (decode steps look recent
rows up without dequantizing; a prompt's rows go into it)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize
from synthetic import write_tiny_model

from jllm.gguf.reader import read_gguf
from jllm.model.weights import Embedding


def _table(path) -> torch.Tensor:
    t = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    return torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(-1, int(t.shape[0]))


def test_rows_are_the_blocks_and_a_prompt_fills_the_row_cache(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, "qwen2", Q.Q8_0)
    want = _table(path)
    emb = Embedding(read_gguf(path), "token_embd.weight", torch.device("cpu"))
    monkeypatch.setattr(Embedding, "CACHED_ROWS", 8)
    prompt = [5, 9, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 9]      # 19 ids, 17 distinct
    got = emb(torch.tensor(prompt))
    assert torch.equal(got, want[prompt])
    # the prompt's 8 latest distinct ids are cached, newest last, as copies
    assert list(emb._cache) == [37, 41, 43, 47, 53, 59, 61, 9]
    assert all(r._base is None for r in emb._cache.values())
    calls = []
    real = emb._dequantize
    monkeypatch.setattr(emb, "_dequantize", lambda idx: calls.append(list(idx)) or real(idx))
    step = emb(torch.tensor([9, 61, 2]))                 # a verify pass: two cached rows, one new
    assert torch.equal(step, want[[9, 61, 2]]) and calls == [[2]]
    assert len(emb._cache) == 8 and 37 not in emb._cache and list(emb._cache)[-1] == 2
