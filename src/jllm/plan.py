"""`jllm plan`: the memory budget of a configuration, computed from the GGUF headers before loading anything
(the table the origin document drew by hand): weights in their compute representation, KV pools of target
and draft at the context size, scratch, runtime, total. `--mem-limit` turns it into a refusal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gguf import GGMLQuantizationType as T

from jllm.eagle3 import format as fmt
from jllm.eagle3.format import is_head, read_head_config
from jllm.errors import JllmError
from jllm.gguf.reader import GGUFFile, read_gguf
from jllm.kernels import native_possible
from jllm.model.config import config_from_gguf
from jllm.model.kv_cache import kv_dtype
from jllm.model.qlinear import packed_bytes, row_kind
from jllm.model.weights import layer_matrices, output_matrix
from jllm.spec import DRAFT_VOCAB
from jllm.spec.compat import check_draft
from jllm.spec.config import draft_precision_for

RUNTIME_BYTES = 350 << 20      # python + torch + tokenizer, measured: RSS of an engine on a tiny model
BYTES_PER_WEIGHT = {"exact": 4, "int8": 1, "int8-fast": 1, "bf16": 2, "f16": 2}


@dataclass
class Budget:
    name: str
    weights: int
    kv: int
    scratch: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.scratch


def model_budget(g: GGUFFile, precision: str, ctx: int, output_rows: int | None = None,
                 verify_tokens: int = 9) -> Budget:
    cfg = config_from_gguf(g.metadata, set(g.tensors), str(g.path))
    from jllm.sequence import CUDA_PREFILL_CHUNK, PREFILL_CHUNK

    chunk = min(ctx, CUDA_PREFILL_CHUNK if precision == "blocks" else PREFILL_CHUNK)   # Transformer.prefill_chunk
    kv, scratch = _kv(cfg, ctx, precision), _scratch(cfg, ctx, output_rows, verify_tokens, chunk)
    if precision in ("native", "native4"):
        return Budget(g.path.name, _native_weights(g, cfg, output_rows, precision == "native4"), kv, scratch)
    if precision == "blocks":
        return Budget(g.path.name, _blocks_weights(g, cfg, output_rows), kv,
                      scratch + _blocks_scratch(g, cfg, ctx, chunk))
    per = BYTES_PER_WEIGHT[precision]
    scale_bytes = 4 if per == 1 else 0              # int8: one f32 scale per output row
    weights = 0
    for name, t in g.tensors.items():
        if len(t.shape) != 2 or name == "token_embd.weight":
            weights += t.n_elements * 4 if len(t.shape) == 1 else 0      # norms and biases in f32
            continue
        rows, cols = t.shape
        if name == "output.weight" and output_rows:
            rows = min(rows, output_rows)
        weights += rows * (cols * per + scale_bytes)
    if cfg.tied_embeddings:                          # the output layer is a converted copy of the embedding
        rows = min(cfg.vocab_size, output_rows or cfg.vocab_size)
        weights += rows * (cfg.hidden * per + scale_bytes)
    return Budget(g.path.name, weights, kv, scratch)


def _blocks_weights(g: GGUFFile, cfg, output_rows: int | None) -> int:
    """The blocks precision's device bytes (jllm/cuda): a matrix of a block type in its device layout
    (jllm.cuda.layout.device_bytes), another type in bf16; vectors in f32; a Q4_K embedding on the device in
    its block layout (jllm.cuda.embedding; the output's copy where the two are tied), another on the host (read
    row by row); a tied output is a copy of it."""
    from jllm.cuda.layout import BLOCK_TYPES, device_bytes

    def matrix(t, rows):
        cols = t.shape[1]
        return device_bytes(t.ggml_type, rows, cols) if t.ggml_type in BLOCK_TYPES else rows * cols * 2

    weights = 0
    for name, t in g.tensors.items():
        if len(t.shape) == 1:
            weights += t.n_elements * 4
        elif name != "token_embd.weight":
            rows = min(t.shape[0], output_rows) if name == "output.weight" and output_rows else t.shape[0]
            weights += matrix(t, rows)
    t = g.tensors["token_embd.weight"]
    out_rows = min(t.shape[0], output_rows or t.shape[0])
    if cfg.tied_embeddings:
        weights += matrix(t, out_rows)
    if t.ggml_type == T.Q4_K and not (cfg.tied_embeddings and out_rows == t.shape[0]):
        weights += device_bytes(t.ggml_type, t.shape[0], t.shape[1])
    return weights


def _blocks_scratch(g: GGUFFile, cfg, ctx: int, chunk: int) -> int:
    """What the blocks precision adds to a pass's scratch: the f16 copy of the widest layer matrix that a
    prefill chunk multiplies over (jllm.cuda.linear; q|k|v and gate|up are one part each) and attention's
    per-chunk parts for 16 queries, or a prefill chunk's queries over one chunk each (jllm.cuda.attention)."""
    from jllm.cuda.layout import QUERIES, n_chunks

    widest = 0
    for i in range(cfg.n_layers):
        for names in (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("attn_output",), ("ffn_down",)):
            ts = [g.tensors.get(f"blk.{i}.{n}.weight") for n in names]
            if all(ts):
                widest = max(widest, sum(t.shape[0] for t in ts) * ts[0].shape[1])
    parts = max(QUERIES * n_chunks(ctx), chunk)
    return widest * 2 + parts * cfg.n_heads * (cfg.head_dim + 2) * 4


def _kv(cfg, ctx: int, precision: str) -> int:

    half = precision == "blocks" or (precision in ("native", "native4") and native_possible())
    size = kv_dtype(half).itemsize                                   # f16 on the native stack and in blocks
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * ctx * size


def _scratch(cfg, ctx: int, output_rows: int | None, verify_tokens: int, chunk: int) -> int:
    vocab = min(cfg.vocab_size, output_rows or cfg.vocab_size)
    return (verify_tokens * vocab * 4                          # logits of a verify pass
            + chunk * (2 * cfg.ffn + 4 * cfg.hidden) * 4 * 2   # a prefill chunk's activations
            + 2 * ctx * cfg.rope_dim * 4)                      # RoPE tables


def _native_weights(g: GGUFFile, cfg, output_rows: int | None, all_four: bool = False) -> int:
    """The native kernel's packed matrices, fused as weights.py fuses them, plus norms and biases in f32."""

    t = g.tensors

    def fused(names: list[str], max_rows: int | None = None) -> int:
        parts = [(min(max_rows, t[n].shape[0]) if max_rows else t[n].shape[0], row_kind(t[n].ggml_type, all_four))
                 for n in names]
        return packed_bytes(parts, t[names[0]].shape[1])

    total = sum(x.n_elements * 4 for x in t.values() if len(x.shape) == 1)
    for i in range(cfg.n_layers):
        total += sum(fused(names) for names in layer_matrices(i).values())
    return total + fused([output_matrix(cfg)], output_rows)


def plan(target: str | GGUFFile, draft: str | GGUFFile | None, ctx: int, precision: str,
         draft_precision: str = "auto", draft_vocab: int | None = DRAFT_VOCAB, checked: bool = False) -> list[Budget]:
    """Budgets of the target and the draft (paths, or files already read). A draft that cannot run with this
    target is refused as the engine refuses it (spec.compat.check_draft), unless `checked`: the caller has."""

    read = lambda f: f if isinstance(f, GGUFFile) else read_gguf(f)      # noqa: E731
    t = read(target)
    rows = [model_budget(t, precision, ctx)]
    if draft:
        g = read(draft)
        if not checked:
            check_draft(t, g)
        rows.append(head_budget(g, ctx) if is_head(g) else
                    model_budget(g, draft_precision_for(precision, draft_precision), ctx, output_rows=draft_vocab))
    return rows


def head_budget(g: GGUFFile, ctx: int) -> Budget:
    """An EAGLE-3 head: its matrices on 4-bit tiles (native4, as Eagle3Head loads them), its one layer's KV
    cache, and as scratch the target's captured states it reads, kept by position in bf16 (sequence.py)."""
    c = read_head_config(g)
    t = g.tensors
    groups = [[fmt.FC], [fmt.ATTN_Q, fmt.ATTN_K, fmt.ATTN_V], [fmt.ATTN_OUT], [fmt.FFN_GATE, fmt.FFN_UP],
              [fmt.FFN_DOWN]] + ([[fmt.OUTPUT]] if fmt.OUTPUT in t else [])
    weights = sum(x.n_elements * 4 for x in t.values() if len(x.shape) == 1)
    for names in groups:
        weights += packed_bytes([(t[n].shape[0], row_kind(t[n].ggml_type, True)) for n in names], t[names[0]].shape[1])
    kv = 2 * c.n_kv_heads * c.head_dim * ctx * kv_dtype(native_possible()).itemsize
    scratch = ctx * 3 * c.target_hidden * 2 + 9 * (c.draft_vocab or 0) * 4
    return Budget(g.path.name, weights, kv, scratch)


def total_bytes(rows: list[Budget]) -> int:
    return sum(r.total for r in rows) + RUNTIME_BYTES


def check_limit(rows: list[Budget], limit: int | None, what: str = "the memory limit") -> None:
    if limit is not None and total_bytes(rows) > limit:
        fixes = "lower -c/--ctx-size" + (" or drop the draft" if len(rows) > 1 else "")
        raise JllmError(f"this configuration needs about {total_bytes(rows) / 2**30:.2f} GiB, over {what} "
                        f"of {limit / 2**30:.2f} GiB (see `jllm plan`; {fixes})")


def physical_memory() -> int | None:
    """Bytes of RAM this machine has (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def print_plan(rows: list[Budget], ctx: int) -> None:
    mib = lambda b: f"{b / 2**20:,.0f}"          # noqa: E731
    print(f"{'model':<44} {'weights MiB':>12} {f'KV@{ctx} MiB':>14} {'scratch MiB':>12} {'total MiB':>10}")
    for r in rows:
        print(f"{r.name:<44} {mib(r.weights):>12} {mib(r.kv):>14} {mib(r.scratch):>12} {mib(r.total):>10}")
    print(f"{'runtime (python, torch, tokenizer)':<44} {'':>12} {'':>14} {'':>12} {mib(RUNTIME_BYTES):>10}")
    print(f"{'total':<44} {'':>12} {'':>14} {'':>12} {mib(total_bytes(rows)):>10}")
