"""A trained head written as llama.cpp's `eagle3` GGUF (the layout, names and keys: jllm/eagle3/format.py).

What is written: the head's own tensors, its output layer over the draft vocabulary with `d2t` (I64,
absolute target ids), no token_embd (the head's embedding is the target's, frozen in training, and both
llama.cpp and jllm take the target's when the head has none). Matrices in `qtype`, norms F32. Quantizing
uses gguf-py, which (0.19) writes F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 but no K-quants, so the
4-bit default is Q4_0 (4.5 bits a weight, as Q4_K; jllm runs it on its 4-bit tiles). RoPE: the head was
trained with llama.cpp's adjacent-pair rotation, so q and k rows go out as they are (an HF checkpoint's
would be permuted, as the converter does for llama).

Metadata: the usual llama keys for the one decoder layer under `eagle3.`, the eagle3 keys
(target_layers, target_hidden_size, norm_before_residual = norm_before_fc = false), and the target's
`tokenizer.*` keys copied with their types, as llama.cpp's converter copies the target's vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from jllm.eagle3 import format as fmt
from jllm.errors import JllmError
from jllm.train.eagle3 import Eagle3Head

QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
_FILE_TYPE = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
              Q.BF16: gguf.LlamaFileType.MOSTLY_BF16, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
              Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
              Q.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0, Q.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1}


def head_params(head: Eagle3Head) -> dict[str, torch.nn.Parameter]:
    """GGUF name -> the head's parameter ([out, in] for matrices), in file order."""
    return {fmt.FC: head.fc.weight, fmt.OUTPUT_NORM: head.output_norm, fmt.OUTPUT: head.lm_head.weight,
            fmt.ATTN_NORM: head.attn_norm, fmt.HIDDEN_NORM: head.hidden_norm, fmt.ATTN_Q: head.q.weight,
            fmt.ATTN_K: head.k.weight, fmt.ATTN_V: head.v.weight, fmt.ATTN_OUT: head.o.weight,
            fmt.FFN_NORM: head.ffn_norm, fmt.FFN_GATE: head.gate.weight, fmt.FFN_UP: head.up.weight,
            fmt.FFN_DOWN: head.down.weight}


def head_tensors(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 CPU tensor ([out, in] for matrices), in file order."""
    return {k: v.detach().float().cpu() for k, v in head_params(head).items()}


def file_bytes(head: Eagle3Head, qtype: Q = Q.Q4_0) -> int:
    """About what the file's tensors take (the tokenizer metadata comes on top: ~4 MB for a 150k vocabulary)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = 8 * head.c.draft_vocab
    for t in head_tensors(head).values():
        n += t.numel() * 4 if t.ndim == 1 else t.numel() // block * size
    return n


def _copy_tokenizer(writer: gguf.GGUFWriter, target_path: str) -> None:
    reader = gguf.GGUFReader(target_path)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)


def write_head(path, head: Eagle3Head, target_path: str, qtype: Q = Q.Q4_0, name: str = "") -> int:
    """Write the head at `path`; returns the file's size in bytes."""
    qtype = Q(qtype)
    if qtype not in QUANTIZABLE:
        raise JllmError(f"cannot quantize a head to {qtype.name} (gguf-py writes "
                        f"{', '.join(q.name for q in QUANTIZABLE)})")
    c = head.c
    path = Path(path)
    w = gguf.GGUFWriter(path, fmt.ARCH)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or f"eagle3 head for {Path(target_path).stem}")
    w.add_uint32(fmt.KEY_BLOCKS, 1)
    w.add_uint32(fmt.KEY_CONTEXT, c.context_length)
    w.add_uint32(fmt.KEY_HIDDEN, c.hidden)
    w.add_uint32(fmt.KEY_FFN, c.ffn)
    w.add_uint32(fmt.KEY_HEADS, c.n_heads)
    w.add_uint32(fmt.KEY_KV_HEADS, c.n_kv_heads)
    if c.head_dim != c.hidden // c.n_heads:
        w.add_uint32(fmt.KEY_HEAD_DIM, c.head_dim)
        w.add_uint32(f"{fmt.ARCH}.attention.value_length", c.head_dim)
    w.add_float32(fmt.KEY_RMS_EPS, c.rms_eps)
    w.add_float32(fmt.KEY_ROPE_BASE, c.rope_base)
    w.add_uint32(fmt.KEY_ROPE_DIM, c.head_dim)
    w.add_uint32(fmt.KEY_VOCAB, c.target_vocab)
    w.add_array(fmt.KEY_TARGET_LAYERS, [int(x) for x in c.target_layers])
    w.add_uint32(fmt.KEY_TARGET_HIDDEN, c.target_hidden)
    w.add_bool(fmt.KEY_NORM_BEFORE_RESIDUAL, False)
    w.add_bool(fmt.KEY_NORM_BEFORE_FC, False)
    w.add_file_type(_FILE_TYPE[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _copy_tokenizer(w, target_path)

    for tname, t in head_tensors(head).items():
        data = np.ascontiguousarray(t.numpy())
        kind = qtype if data.ndim == 2 else Q.F32
        w.add_tensor(tname, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.add_tensor(fmt.D2T, head.d2t.detach().cpu().numpy().astype(np.int64), raw_dtype=fmt.D2T_TYPE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.stat().st_size
