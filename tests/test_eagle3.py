"""EAGLE-3 heads (jllm/eagle3) and the target's captured hidden states (Transformer.forward's capture).

The head files are written here with gguf's GGUFWriter in llama.cpp's eagle3 layout, for a tiny synthetic
qwen2 target; the head's forward is checked against a plain-torch reference written from format.py's
description (dequantized weights), not from jllm's code.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from synthetic import write_tiny_model

from jllm.eagle3 import format as fmt
from jllm.eagle3.head import Eagle3Head
from jllm.errors import JllmError
from jllm.gguf.reader import read_gguf
from jllm.model.loader import load_model

pytestmark = pytest.mark.usefixtures("native_kernels")      # built before the first model runs

D, H, HK, HD, FFN = 64, 4, 2, 16, 128          # the tiny target's widths (tests/synthetic.py)
N_LAYERS = 2
DRAFT_VOCAB = 96
ROPE_BASE = 10000.0
EPS = 1e-5


def write_head(path, target_ref, qtype=Q.F32, seed=1, target_hidden=D, target_layers=(0, 1, 2),
               d2t=True, own_output=True, norm_before_fc=False, norm_before_residual=False, tokenizer=True,
               own_embedding=False):
    """A random eagle3 head for the synthetic target; returns the float tensors the file holds, by name."""
    rng = np.random.default_rng(seed)
    V = target_ref.vocab_size
    w = gguf.GGUFWriter(path, fmt.ARCH)
    w.add_name("tiny eagle3 head")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FFN)
    w.add_head_count(H)
    w.add_head_count_kv(HK)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_rope_dimension_count(HD)
    w.add_layer_norm_rms_eps(EPS)
    w.add_vocab_size(V)
    w.add_array(fmt.KEY_TARGET_LAYERS, list(target_layers))
    w.add_uint32(fmt.KEY_TARGET_HIDDEN, target_hidden)
    w.add_bool(fmt.KEY_NORM_BEFORE_RESIDUAL, norm_before_residual)
    w.add_bool(fmt.KEY_NORM_BEFORE_FC, norm_before_fc)
    if tokenizer:                                   # the target's, as llama.cpp's converter copies it
        meta = read_gguf(target_ref.path).metadata
        w.add_tokenizer_model(meta["tokenizer.ggml.model"])
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
        w.add_token_list(meta["tokenizer.ggml.tokens"] if tokenizer is True else tokenizer)
        w.add_token_merges(meta["tokenizer.ggml.merges"])
        w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
        w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    held = {}

    def mat(name, rows, cols, std=None):
        data = (rng.standard_normal((rows, cols)) * (std or 1 / math.sqrt(cols))).astype(np.float32)
        stored = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, stored, raw_dtype=qtype)
        held[name] = torch.from_numpy(gguf.quants.dequantize(stored, qtype).reshape(rows, cols).astype(np.float32))

    def vec(name, n):
        data = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        w.add_tensor(name, data)
        held[name] = torch.from_numpy(data)

    if own_embedding:
        mat(fmt.TOKEN_EMBD, V, D, std=0.5)
    mat(fmt.FC, D, 3 * target_hidden)
    if norm_before_fc:
        vec(fmt.FC_NORM, 3 * target_hidden)
    vec(fmt.ATTN_NORM, D)
    vec(fmt.HIDDEN_NORM, D)
    mat(fmt.ATTN_Q, H * HD, 2 * D)
    mat(fmt.ATTN_K, HK * HD, 2 * D)
    mat(fmt.ATTN_V, HK * HD, 2 * D)
    mat(fmt.ATTN_OUT, D, H * HD)
    vec(fmt.FFN_NORM, D)
    mat(fmt.FFN_GATE, FFN, D)
    mat(fmt.FFN_UP, FFN, D)
    mat(fmt.FFN_DOWN, D, FFN)
    vec(fmt.OUTPUT_NORM, D)
    if own_output:
        mat(fmt.OUTPUT, DRAFT_VOCAB if d2t else V, D, std=0.5)
    if d2t:
        ids = np.sort(rng.choice(V, DRAFT_VOCAB, replace=False)).astype(np.int64)
        w.add_tensor(fmt.D2T, ids, raw_dtype=Q.I64)
        held[fmt.D2T] = torch.from_numpy(ids)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3") / "target.gguf"
    ref = write_tiny_model(path, "qwen2", Q.Q8_0)
    return ref, load_model(path, precision="native", max_positions=128, cache_weights=False)


# ------------------------------------------------------------------------------------------- the reference

def ref_norm(x, w):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def ref_rope(x, positions):
    """Adjacent pairs (2i, 2i + 1) rotated by p * base^(-2i / head_dim); x [T, heads, HD]."""
    i = torch.arange(HD // 2, dtype=torch.float64)
    ang = positions[:, None].double() * ROPE_BASE ** (-2 * i / HD)              # [T, HD / 2]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)


class RefHead:
    """The head of format.py's description in float64: one position at a time, its own key/value lists."""

    def __init__(self, w, embed, norm_before_fc=False, norm_before_residual=False):
        self.w = {k: v.double() for k, v in w.items() if k not in (fmt.D2T, fmt.TOKEN_EMBD)}
        self.embed = embed.double()
        self.nbf, self.nbr = norm_before_fc, norm_before_residual
        self.keys, self.values = [], []

    def fuse(self, hidden3):
        x = hidden3.double()
        if self.nbf:
            x = ref_norm(x, self.w[fmt.FC_NORM])
        return x @ self.w[fmt.FC].T

    def position(self, token, g):
        w, p = self.w, len(self.keys)
        e = ref_norm(self.embed[token], w[fmt.ATTN_NORM])
        gn = ref_norm(g.double(), w[fmt.HIDDEN_NORM])
        x = torch.cat([e, gn])
        q = ref_rope((w[fmt.ATTN_Q] @ x).reshape(1, H, HD), torch.tensor([p]))[0]
        k = ref_rope((w[fmt.ATTN_K] @ x).reshape(1, HK, HD), torch.tensor([p]))[0]
        self.keys.append(k)
        self.values.append((w[fmt.ATTN_V] @ x).reshape(HK, HD))
        K, V = torch.stack(self.keys), torch.stack(self.values)                   # [p + 1, HK, HD]
        heads = []
        for h in range(H):
            kv = h // (H // HK)
            att = torch.softmax(K[:, kv] @ q[h] / math.sqrt(HD), dim=0)
            heads.append(att @ V[:, kv])
        h = w[fmt.ATTN_OUT] @ torch.cat(heads) + (gn if self.nbr else g.double())
        n = ref_norm(h, w[fmt.FFN_NORM])
        out = h + w[fmt.FFN_DOWN] @ (torch.nn.functional.silu(w[fmt.FFN_GATE] @ n) * (w[fmt.FFN_UP] @ n))
        return w[fmt.OUTPUT] @ ref_norm(out, w[fmt.OUTPUT_NORM]), out


def target_embedding(ref):
    return ref.model.model.embed_tokens.weight.detach().float()


def capture(model, tokens, layers=(0, 1, 2)):
    cache = model.new_cache(64)
    logits, hidden = model.forward(torch.tensor(tokens), cache, capture=layers)
    return logits, hidden


# ------------------------------------------------------------------------------------------- format

def test_head_file_read_and_validated(tmp_path, target):
    ref, model = target
    held = write_head(tmp_path / "head.gguf", ref)
    g = read_gguf(tmp_path / "head.gguf")
    assert fmt.is_head(g) and not fmt.is_head(ref.path)
    cfg = fmt.read_head_config(g)
    assert cfg.target_layers == (0, 1, 2) and cfg.target_hidden == D and cfg.hidden == D
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn) == (H, HK, HD, FFN)
    assert cfg.draft_vocab == DRAFT_VOCAB and cfg.has_d2t and cfg.own_output and not cfg.own_embedding
    assert torch.equal(fmt.read_d2t(g), held[fmt.D2T])
    head = Eagle3Head.load(g, model, use_cache=False)
    assert head.target_layers == (0, 1, 2)
    assert [head.target_id(i) for i in (0, 5)] == held[fmt.D2T][[0, 5]].tolist()
    t = head.target_logits(torch.arange(DRAFT_VOCAB, dtype=torch.float32))
    assert t.shape == (ref.vocab_size,) and torch.isinf(t).sum() == ref.vocab_size - DRAFT_VOCAB
    assert t[held[fmt.D2T][7]] == 7


@pytest.mark.parametrize("change, message", [
    (dict(target_hidden=32), "target hidden size 32 vs 64"),
    (dict(target_layers=(0, 1, 5)), "target layer(s) [5] beyond the target's 2 layers"),
    (dict(tokenizer=["x"] * 300), "tokenizer tokens sha256"),
])
def test_head_for_another_target_is_refused_in_one_line(tmp_path, target, change, message):
    ref, model = target
    write_head(tmp_path / "other.gguf", ref, **change)
    with pytest.raises(JllmError) as e:
        Eagle3Head.load(tmp_path / "other.gguf", model, use_cache=False)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "other.gguf" in str(e.value) and "target.gguf" in str(e.value)


def test_not_a_head_and_missing_tensors(tmp_path, target):
    ref, model = target
    with pytest.raises(JllmError, match="not an EAGLE-3 head"):
        fmt.read_head_config(read_gguf(ref.path))
    write_head(tmp_path / "h.gguf", ref, norm_before_fc=False)
    g = read_gguf(tmp_path / "h.gguf")
    g.metadata[fmt.KEY_NORM_BEFORE_FC] = True                # says it has the fc norm, has not
    with pytest.raises(JllmError, match="lacks the tensor.*enc.output_norm.weight"):
        fmt.read_head_config(g)


# ------------------------------------------------------------------------------------------- the head

# exact: f32 weights, the f16 KV cache of the kernels; native: int8 activations per block of 32
@pytest.mark.parametrize("precision, qtype, tol", [("exact", Q.F32, 3e-3), ("native", Q.Q8_0, 0.05)])
@pytest.mark.parametrize("variant", [dict(), dict(norm_before_fc=True, norm_before_residual=True),
                                     dict(own_embedding=True)])
def test_head_matches_reference(tmp_path, target, precision, qtype, tol, variant):
    ref, model = target
    held = write_head(tmp_path / "head.gguf", ref, qtype=qtype, **variant)
    head = Eagle3Head.load(tmp_path / "head.gguf", model, precision=precision, use_cache=False)
    embed = held[fmt.TOKEN_EMBD] if variant.get("own_embedding") else target_embedding(ref)
    variant = {k: v for k, v in variant.items() if k != "own_embedding"}
    oracle = RefHead(held, embed, **variant)
    tokens = [5, 77, 260, 9, 130, 41]
    _, hidden = capture(model, tokens)
    # prefill rows 0..4 (token P + 1 with the state at P), then two steps fed back
    s = head.prefill(hidden[:5], tokens[1:6])
    g = oracle.fuse(hidden[:5])
    for p in range(5):
        want_logits, want_state = oracle.position(tokens[p + 1], g[p])
    scale = want_logits.abs().max()
    assert (s.logits.double() - want_logits).abs().max() < tol * scale
    assert (s.state.double() - want_state).abs().max() < tol * want_state.abs().max()
    for tok in (17, 200):
        s = head.step(tok, s.state)
        want_logits, want_state = oracle.position(tok, want_state)
        assert (s.logits.double() - want_logits).abs().max() < 2 * tol * want_logits.abs().max()
    assert head.length == 7


def test_head_without_own_output_or_d2t_uses_the_target(tmp_path, target):
    ref, model = target
    held = write_head(tmp_path / "head.gguf", ref, d2t=False, own_output=False)
    head = Eagle3Head.load(tmp_path / "head.gguf", model, precision="exact", use_cache=False)
    assert head.cfg.draft_vocab == ref.vocab_size and head.target_id(123) == 123
    held[fmt.OUTPUT] = ref.model.lm_head.weight.detach().float()
    oracle = RefHead(held, target_embedding(ref))
    tokens = [5, 77, 260]
    _, hidden = capture(model, tokens)
    s = head.prefill(hidden[:2], tokens[1:3])
    g = oracle.fuse(hidden[:2])
    oracle.position(tokens[1], g[0])
    want, _ = oracle.position(tokens[2], g[1])
    assert s.logits.shape == (ref.vocab_size,)
    # the target's output layer is native (int8 activations): a looser bound than exact weights
    assert (s.logits.double() - want).abs().max() < 0.05 * want.abs().max()


def test_prefill_then_step_equals_step_by_step_and_rollback(tmp_path, target):
    ref, model = target
    write_head(tmp_path / "head.gguf", ref, qtype=Q.Q4_0)
    head = Eagle3Head.load(tmp_path / "head.gguf", model, use_cache=False)       # native4, the default
    assert head.precision == "native4"
    tokens = [5, 77, 260, 9, 130, 41, 3]
    _, hidden = capture(model, tokens)
    whole = head.prefill(hidden[:6], tokens[1:7])
    after = head.step(11, whole.state)
    # the same positions one row at a time
    head.truncate(0)
    for p in range(6):
        one = head.prefill(hidden[p:p + 1], tokens[p + 1:p + 2])
    assert torch.equal(one.logits, whole.logits) and torch.equal(one.state, whole.state)
    assert torch.equal(head.step(11, one.state).logits, after.logits)
    # rollback: back to 4 positions, redo 4 and 5, then the step: the same bits
    head.truncate(4)
    assert head.length == 4
    again = head.prefill(hidden[4:6], tokens[5:7])
    assert torch.equal(again.logits, whole.logits)
    assert torch.equal(head.step(11, again.state).logits, after.logits)
    # a different step after rollback overwrites, and the original comes back when redone
    head.truncate(6)
    other = head.step(12, again.state)
    assert not torch.equal(other.logits, after.logits)
    head.truncate(6)
    assert torch.equal(head.step(11, again.state).logits, after.logits)


# ------------------------------------------------------------------------------------------- capture

def test_capture_native_equals_python_loop_and_hf(tmp_path, target):
    ref, model = target
    py = load_model(ref.path, precision="native", max_positions=128, cache_weights=False)
    py.stack = None                                              # the Python layer loop on the same kernels
    tokens = [5, 77, 260, 9, 130]
    layers = (2, 0, 1)
    logits, hidden = capture(model, tokens, layers)
    py_logits, py_hidden = capture(py, tokens, layers)
    assert hidden.shape == (5, 3 * D) and hidden.dtype == torch.float32
    assert torch.equal(hidden, py_hidden) and torch.equal(logits, py_logits)
    plain = model.forward(torch.tensor(tokens), model.new_cache(64))
    assert torch.equal(plain, logits)                            # capture changes nothing else
    with torch.no_grad():                                        # HF: hidden_states[L] enters layer L
        hf = ref.model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
    for j, L in enumerate(layers):
        if L < N_LAYERS:
            want = hf[L][0]
            assert (hidden[:, j * D:(j + 1) * D] - want).abs().max() < 0.05 * want.abs().max()
    # layer 0 is the embedding itself
    assert torch.equal(hidden[:, D:2 * D], model.w.embed(torch.tensor(tokens)))


@pytest.mark.parametrize("native", [True, False])
def test_capture_is_batch_invariant(target, native):
    ref, model = target
    if not native:
        model = load_model(ref.path, precision="native", max_positions=128, cache_weights=False)
        model.stack = None
    tokens = [5, 77, 260, 9, 130, 41]
    _, together = capture(model, tokens)
    cache = model.new_cache(64)
    rows = []
    for t in tokens:                                             # decode steps, one row a call
        _, h = model.forward(torch.tensor([t]), cache, capture=(0, 1, 2))
        rows.append(h)
    assert torch.equal(torch.cat(rows), together)
    cache.truncate(3)                                            # a verify-like call of 3 rows, last_only
    _, h = model.forward(torch.tensor(tokens[3:]), cache, last_only=True, capture=(0, 1, 2))
    assert torch.equal(h, together[3:])


def test_capture_refuses_layers_out_of_range(target):
    _, model = target
    with pytest.raises(ValueError, match="capture layers"):
        model.forward(torch.tensor([1]), model.new_cache(4), capture=(0, 3))
