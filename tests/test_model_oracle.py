"""jllm's forward pass against an independent oracle: HF transformers running the same weights.

Each variant is a tiny random model written by `synthetic.write_tiny_model` in llama.cpp's GGUF conventions;
the oracle is the HF model holding exactly the file's (dequantized) weights. jllm must reproduce the oracle's
logits whether the sequence arrives in one batch, one token at a time, in two chunks, or after a cache
rollback. The sequence (20 tokens) is longer than gemma3's sliding window (8), so both its sliding and its
global layers are exercised.

The first tests check the fixture itself, with transformers' own GGUF reader: if they fail, the writer (not
jllm) is wrong.
"""

from __future__ import annotations

import pytest
import torch

from synthetic import GGMLQuantizationType, write_tiny_model

pytestmark = pytest.mark.usefixtures("native_kernels")      # built before the first model runs

Q = GGMLQuantizationType

# variant -> (arch, weight type, HF config overrides)
VARIANTS = {
    "llama": ("llama", Q.F32, {}),                                   # tied embeddings
    "llama-untied": ("llama", Q.F32, {"tie_word_embeddings": False}),
    "qwen2": ("qwen2", Q.F32, {}),                                   # untied, q/k/v bias
    "qwen3": ("qwen3", Q.F32, {}),                                   # tied, q/k norm
    "gemma3": ("gemma3", Q.F32, {}),                                 # tied, sliding window 8, 6 layers
    "llama-q8_0": ("llama", Q.Q8_0, {}),                             # quantized, tied output
}
SEQ_LEN = 20
PREFILL = 7
TOL = 1e-4                 # max |diff| allowed, relative to the largest |logit|
INT8_ARGMAX_AGREEMENT = 0.9


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: extra threads only add OpenMP synchronization, which costs milliseconds per op on a
    busy machine (measured: 80x slower int8 decode with 2 threads under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    """(reference, token ids, oracle logits [SEQ_LEN, vocab]) for one variant, built once per module."""
    arch, qtype, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf"
    ref = write_tiny_model(path, arch, qtype, seed=0, **overrides)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ref.vocab_size, (SEQ_LEN,), generator=gen).tolist()
    return ref, ids, ref.logits(ids)


_loaded: dict = {}


def load(ref, precision: str):
    """jllm's model for this file, loaded once per precision (the model is stateless; each run gets a new cache)."""
    from jllm.model.loader import load_model

    key = (ref.path, precision)
    if key not in _loaded:
        _loaded[key] = load_model(ref.path, device="cpu", precision=precision)
    return _loaded[key]


@torch.no_grad()
def run(model, ids: list[int], chunks: list[int], max_tokens: int = 64) -> torch.Tensor:
    """Feed ids through a fresh cache in chunks of the given sizes; the logits of all positions, concatenated."""
    assert sum(chunks) == len(ids)
    cache = model.new_cache(max_tokens=max_tokens)
    out, start = [], 0
    for n in chunks:
        logits = model.forward(torch.tensor(ids[start:start + n]), cache)
        assert logits.ndim == 2 and logits.shape[0] == n, f"forward returned {tuple(logits.shape)} for {n} tokens"
        assert logits.dtype == torch.float32
        start += n
        assert cache.length == start, f"cache.length {cache.length} after {start} tokens"
        out.append(logits)
    return torch.cat(out)


def assert_matches_oracle(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = max(expected.abs().max().item(), 1.0)
    per_pos = (actual - expected).abs().amax(dim=-1)
    bad = (per_pos > TOL * scale).nonzero().flatten().tolist()
    assert not bad, (f"{what}: max |diff| {per_pos.max().item():.3g} exceeds {TOL:g} x logit scale {scale:.3g}; "
                     f"positions off: {bad} (first at {bad[0]})")


# ------------------------------------------------------------------------------ the fixture, checked by transformers


def test_gguf_weights_read_back_in_transformers(tiny):
    """transformers' GGUF reader (its own un-permute and gemma norm shift) recovers the oracle's weights."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    ref, ids, expected = tiny
    if ref.arch not in GGUF_SUPPORTED_ARCHITECTURES:
        pytest.skip(f"transformers cannot load {ref.arch} from GGUF")
    fresh = type(ref.model)(ref.config).eval()  # new random weights, replaced below
    parsed = load_gguf_checkpoint(str(ref.path), return_tensors=True, model_to_load=fresh)
    missing, unexpected = fresh.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if ref.config.tie_word_embeddings else set())
    with torch.no_grad():
        got = fresh(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max().item():.3g}"


def test_gguf_metadata_reads_back_in_transformers(tiny):
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    ref, _, _ = tiny
    if ref.arch not in GGUF_SUPPORTED_ARCHITECTURES:
        pytest.skip(f"transformers cannot load {ref.arch} from GGUF")
    got = load_gguf_checkpoint(str(ref.path))["config"]
    cfg = ref.config
    for key in ("num_hidden_layers", "max_position_embeddings", "hidden_size", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert got[key] == getattr(cfg, key), key
    rope = cfg.rope_parameters
    assert got["rope_theta"] == rope.get("full_attention", rope)["rope_theta"]
    assert got["rms_norm_eps"] == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
    if "head_dim" in got:       # llama: rope.dimension_count, gemma3: attention.key_length
        assert got["head_dim"] == cfg.head_dim
    if ref.arch == "gemma3":
        assert got["sliding_window"] == cfg.sliding_window
    assert (got["bos_token_id"], got["eos_token_id"]) == (ref.bos_id, ref.eos_id)


def test_gguf_tokenizer_reads_back_in_transformers(tiny):
    from transformers import AutoTokenizer

    ref, _, _ = tiny
    tok = AutoTokenizer.from_pretrained(ref.path.parent, gguf_file=ref.path.name)
    ids = tok.encode("Hello world<|im_end|>", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["Hello", "Ġworld", "<|im_end|>"]
    assert ids[-1] == ref.special_ids["<|im_end|>"] == ref.eos_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------------ jllm, exact path


def test_exact_one_batch(tiny):
    ref, ids, expected = tiny
    assert_matches_oracle(run(load(ref, "exact"), ids, [SEQ_LEN]), expected, "one batch")


def test_exact_one_token_at_a_time(tiny):
    ref, ids, expected = tiny
    assert_matches_oracle(run(load(ref, "exact"), ids, [1] * SEQ_LEN), expected, "token by token")


def test_exact_two_chunks(tiny):
    ref, ids, expected = tiny
    assert_matches_oracle(run(load(ref, "exact"), ids, [PREFILL, SEQ_LEN - PREFILL]), expected,
                          f"prefill {PREFILL} then the rest")


def test_embedding_lookup_is_the_same_for_decode_and_prefill_sizes(tiny):
    """Calls of up to Embedding.SMALL ids go through the dequantized-row cache, longer ones dequantize at once:
    the same rows either way, and an id outside the vocabulary is a JllmError on both paths."""
    from jllm.errors import JllmError

    ref, ids, _ = tiny
    embed = load(ref, "exact").w.embed
    many = torch.tensor(ids * 2)                          # past SMALL: the direct path
    assert len(many) > embed.SMALL
    whole = embed(many)
    for i in range(0, len(many), 3):
        assert torch.equal(embed(many[i:i + 3]), whole[i:i + 3])
    for bad in (torch.tensor([ref.vocab_size]), torch.tensor([-1] + ids)):
        with pytest.raises(JllmError, match="out of range"):
            embed(bad)


@torch.no_grad()
def test_exact_after_rollback(tiny):
    """Truncating the cache and feeding the rest again overwrites the rejected positions (speculative decoding)."""
    ref, ids, expected = tiny
    model = load(ref, "exact")
    cache = model.new_cache(max_tokens=64)
    model.forward(torch.tensor(ids), cache)
    model.forward(torch.tensor(ids[:5]), cache)   # 5 junk positions past the end, to be discarded
    cache.truncate(PREFILL)
    assert cache.length == PREFILL
    rest = model.forward(torch.tensor(ids[PREFILL:]), cache)
    assert cache.length == SEQ_LEN
    assert_matches_oracle(rest, expected[PREFILL:], f"after truncate({PREFILL})")


# ------------------------------------------------------------------------------ jllm, int8 path


@pytest.mark.parametrize("precision", ["int8", "native"])
def test_int8_argmax_agrees_with_oracle(tiny, precision):
    ref, ids, expected = tiny
    got = run(load(ref, precision), ids, [SEQ_LEN])
    agree = (got.argmax(-1) == expected.argmax(-1)).sum().item() / got.shape[0]   # exact: 27 / 30 is 0.9
    assert agree >= INT8_ARGMAX_AGREEMENT, (f"int8 argmax agrees with the oracle at {agree:.0%} of positions "
                                            f"(max |diff| {(got - expected).abs().max().item():.3g})")


def test_native_stack_equals_the_python_layers_bitwise(tiny):
    """The decoder layers as one native call (kernels/layers.cpp) run the Python loop's kernels in its order,
    so prefill, single steps and a verify-sized chunk give the same bits both ways."""
    ref, ids, _ = tiny
    model = load(ref, "native")
    if model.stack is None:
        pytest.skip("native kernels unavailable on this machine")
    chunks = [PREFILL, 1, 1, SEQ_LEN - PREFILL - 2]
    fused = run(model, ids, chunks)
    stack, model.stack = model.stack, None
    try:
        python = run(model, ids, chunks)
    finally:
        model.stack = stack
    assert torch.equal(fused, python), f"max |diff| {(fused - python).abs().max().item():.3g}"


@pytest.mark.parametrize("precision", ["int8", "native"])
def test_int8_batched_equals_sequential_bitwise(tiny, precision):
    """Verifying k draft tokens in one pass must give exactly the logits of decoding them one by one."""
    ref, ids, _ = tiny
    model = load(ref, precision)
    batched = run(model, ids, [SEQ_LEN])
    for chunks, what in (([1] * SEQ_LEN, "token by token"), ([PREFILL, SEQ_LEN - PREFILL], "two chunks")):
        other = run(model, ids, chunks)
        if not torch.equal(batched, other):
            diff = (batched - other).abs().amax(dim=-1)
            pytest.fail(f"int8 one batch != {what}: max |diff| {diff.max().item():.3g}, "
                        f"positions differing: {diff.nonzero().flatten().tolist()}")
