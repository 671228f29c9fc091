"""GGUF blocks on the GPU (jllm.cuda): each type's device layout and its Triton matvec against the CPU's own
dequantization, and each output row independent of the other rows of its call, bit for bit. On a machine
without CUDA the kernels run in Triton's interpreter; without triton (CI's CPU torch) the tests skip."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")          # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (it comes with torch's CUDA builds)")

from gguf import GGMLQuantizationType as T  # noqa: E402

from jllm.cuda.blocks32 import Blocks32Weight  # noqa: E402
from jllm.cuda.linear import device_weight  # noqa: E402
from jllm.cuda.matvec import matvec  # noqa: E402
from jllm.gguf.quants import dequantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _build(kind):
    return lambda raw, shape, device="cpu": device_weight(raw, kind, shape, torch.device(device))


# type -> (device layout, values a block, bytes a block in the file, where its f16 scale(s) sit, device bytes a block)
TYPES = {T.Q4_K: (_build(T.Q4_K), 256, 144, slice(0, 4), 148),
         T.Q6_K: (_build(T.Q6_K), 256, 210, slice(208, 210), 210),
         T.Q4_0: (_build(T.Q4_0), 32, 18, slice(0, 2), 18),
         T.Q5_0: (_build(T.Q5_0), 32, 22, slice(0, 2), 22),
         T.Q8_0: (_build(T.Q8_0), 32, 34, slice(0, 2), 34)}


def random_blocks(kind, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random bytes of n x k values of `kind`: random codes and scale bytes, small finite f16 factors."""
    _, per, size, halves, _ = TYPES[kind]
    g = torch.Generator().manual_seed(seed)
    nb = n * k // per
    b = torch.randint(0, 256, (nb, size), generator=g, dtype=torch.uint8)
    count = (halves.stop - halves.start) // 2
    b[:, halves] = (torch.rand(nb, count, generator=g) * 0.02 + 0.001).to(torch.float16).view(torch.uint8)
    return b.reshape(-1)


@pytest.mark.parametrize("kind", list(TYPES), ids=lambda t: t.name)
def test_layout_is_near_the_files_size_and_checks_its_input(kind):
    build, per, _, _, device_size = TYPES[kind]
    n, k = 8, 512
    raw = random_blocks(kind, n, k)
    w = build(raw, (n, k))
    assert w.shape == (n, k) and w.nbytes() == n * (k // per) * device_size
    assert w.nbytes() / raw.numel() < 1.03
    with pytest.raises(ValueError, match=f"multiple of {per}"):
        build(raw, (n, k + per // 2))
    with pytest.raises(ValueError, match="bytes"):
        build(raw[:-1], (n, k))


def rel_tol(x, w) -> float:
    """A product's tolerance against float64, relative to its largest output: float32 accumulation, or x's 8
    bits where the dp4a kernels take w (JLLM_MATVEC_DP4A; jllm.cuda.dp4a: ~0.5 % rms)."""
    import jllm.cuda.dp4a as dp4a

    return 2e-2 if dp4a.handles(x, w) else 1e-4


@pytest.mark.parametrize("kind", list(TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(40, 512), (16, 256), (8, 768)])       # 768: an odd count of super-blocks
def test_matvec_matches_the_cpu_dequantization(kind, n, k):
    raw = random_blocks(kind, n, k, seed=n)
    ref_w = dequantize(raw.numpy(), kind, (n, k)).double()
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    w = TYPES[kind][0](raw, (n, k), DEV)
    y = matvec(x.to(DEV), w, block_n=16 if rel_tol(x, w) < 1e-3 else None).cpu()
    want = x.double() @ ref_w.T
    assert y.shape == (3, n) and y.dtype == torch.float32
    tol = rel_tol(x, w)
    assert torch.allclose(y.double(), want, rtol=tol / 10, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_matvec_writes_a_column_range_of_a_wider_output_with_its_bias(kind):
    n, k = 24, 512
    w = TYPES[kind][0](random_blocks(kind, n, k, seed=5), (n, k), DEV)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4)).to(DEV)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6)).to(DEV)
    wide = torch.full((3, n + 10), float("nan"), device=DEV)
    matvec(x, w, out=wide[:, 4:4 + n], bias=bias)
    assert torch.allclose(wide[:, 4:4 + n], matvec(x, w) + bias, rtol=1e-6, atol=1e-5)
    assert wide[:, :4].isnan().all() and wide[:, 4 + n:].isnan().all()      # nothing written beside it
    with pytest.raises(ValueError, match="out must be"):
        matvec(x, w, out=wide[:, :n - 1])


@pytest.mark.parametrize("kind", list(TYPES), ids=lambda t: t.name)
def test_each_row_is_its_own_bitwise_whatever_the_rows_beside_it(kind):
    n, k = 24, 512
    w = TYPES[kind][0](random_blocks(kind, n, k, seed=3), (n, k), DEV)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2)).to(DEV)
    together = matvec(x, w)
    for i in range(5):
        assert torch.equal(matvec(x[i:i + 1], w), together[i:i + 1])
    assert torch.equal(matvec(x[1:4], w), together[1:4])
    with pytest.raises(ValueError, match="must be"):
        matvec(x[:, :256], w)
    with pytest.raises(TypeError, match="no GPU kernel"):
        matvec(x, object())


@pytest.mark.parametrize("kind", list(TYPES), ids=lambda t: t.name)
def test_rows_sharing_a_program_get_the_one_row_programs_sums_bitwise(kind, monkeypatch):
    """11 rows: a program of 8 and one of 3 (5 of its slots masked), against a program a row."""
    import jllm.cuda.rows as rows

    n, k = 16, 512
    w = TYPES[kind][0](random_blocks(kind, n, k, seed=5), (n, k), DEV)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(6)).to(DEV)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(DEV)
    split = 2 if kind in (T.Q4_K, T.Q6_K) else None
    shared = matvec(x, w, bias=bias, split=split)
    monkeypatch.setattr(rows, "ROWS_MAX", 1)
    alone = matvec(x, w, bias=bias, split=split)
    assert torch.equal(shared, alone)
    assert rows.rows_a_program(11) == 1


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("split", [2, 3, 5])           # 5 shares of 4 super-blocks: the last one is empty
def test_a_row_summed_in_shares_is_the_whole_rows_sum_and_stays_its_own(kind, split):
    n, k = 24, 1024
    raw = random_blocks(kind, n, k, seed=7)
    w = TYPES[kind][0](raw, (n, k), DEV)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(8)).to(DEV)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(9)).to(DEV)
    bn, sb = (8, 1) if rel_tol(x, w) < 1e-3 else (32, 1)          # dp4a: a thread a super-block at least
    whole = matvec(x, w, block_n=bn, sb=sb, split=1, bias=bias)
    shared = matvec(x, w, block_n=bn, sb=sb, split=split, bias=bias)
    want = x.double().cpu() @ dequantize(raw.numpy(), kind, (n, k)).double().T + bias.double().cpu()
    tol = rel_tol(x, w)
    assert torch.allclose(shared.double().cpu(), want, rtol=tol / 10, atol=tol * want.abs().max().item())
    # the shares add in another order than one running sum: float32 rounding of the largest outputs' size
    assert torch.allclose(shared, whole, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for i in range(4):
        assert torch.equal(matvec(x[i:i + 1], w, block_n=bn, sb=sb, split=split, bias=bias), shared[i:i + 1])


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("block_n,sb,stages", [(8, 1, 1), (8, 2, 3), (16, 2, 1), (32, 1, 2), (4, 4, 1)])
def test_every_setting_a_sweep_may_pick_gives_the_same_products(kind, block_n, sb, stages):
    n, k = 40, 1536                                  # 6 super-blocks: some settings leave a ragged last step
    raw = random_blocks(kind, n, k, seed=11)
    w = TYPES[kind][0](raw, (n, k), DEV)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(12)).to(DEV)
    want = x.double().cpu() @ dequantize(raw.numpy(), kind, (n, k)).double().T
    tol = rel_tol(x, w)
    if tol > 1e-3 and block_n * sb < 32:
        pytest.skip("the dp4a kernels take a thread an output's super-block: block_n x sb >= 32")
    for split in (1, 3):
        y = matvec(x, w, block_n=block_n, sb=sb, split=split, stages=stages).double().cpu()
        assert torch.allclose(y, want, rtol=tol / 10, atol=tol * want.abs().max().item()), (split, block_n, sb)


def test_a_type_the_32_value_layout_does_not_hold_is_refused():
    with pytest.raises(ValueError, match="Q4_K is not a 32-value block type"):
        Blocks32Weight.from_gguf(random_blocks(T.Q4_K, 1, 256), T.Q4_K, (1, 256))


@pytest.mark.parametrize("arch,qtype", [("qwen2", T.Q8_0), ("qwen2", T.Q4_0), ("llama", T.Q8_0), ("qwen3", T.Q8_0),
                                        ("gemma3", T.Q8_0)], ids=lambda v: getattr(v, "name", v))
def test_blocks_precision_runs_a_model_as_the_exact_path_does(arch, qtype, tmp_path):
    """The `blocks` precision end to end: a tiny qwen2 in a block type, its logits against the exact path's
    over the same file (the GPU's attention, f16 keys and values: in Triton's interpreter without a GPU); a
    batched pass's rows are those of passes over each token's prefix alone, bitwise, in the linear layers."""
    from jllm.model.loader import load_model
    from synthetic import write_tiny_model

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, arch, qtype=qtype)
    ids = torch.arange(3, 15)
    exact = load_model(path, device="cpu", precision="exact", cache_weights=False)
    blocks = load_model(path, device=DEV, precision="blocks", cache_weights=False)
    a = exact.forward(ids, exact.new_cache(32))
    b = blocks.forward(ids.to(DEV), blocks.new_cache(32)).cpu()
    assert ((a - b).abs().max() / a.abs().max()).item() < 2e-3          # the blocks precision's KV cache is f16
    lin = blocks.w.layers[0].gate_up
    x = torch.randn(4, lin.in_features).to(DEV)
    assert torch.equal(lin(x)[2:3], lin(x[2:3]))
    assert blocks.w.nbytes() < exact.w.nbytes() / 3
    # jllm plan's budget of the precision: the matrices as loaded, plus the f32 vectors
    from jllm.gguf.reader import read_gguf
    from jllm.plan import model_budget

    g = read_gguf(path)
    vectors = sum(t.n_elements * 4 for t in g.tensors.values() if len(t.shape) == 1)
    assert model_budget(g, "blocks", 32).weights == blocks.w.nbytes() + vectors


def test_an_embedding_held_on_the_device_counts_in_the_weights_once():
    """Weights.nbytes counts a DeviceEmbedding's own copy, and not again when it is the tied output's."""
    from jllm.cuda.embedding import DeviceEmbedding
    from jllm.cuda.linear import BlocksLinear
    from jllm.model.weights import Weights

    w = TYPES[T.Q4_K][0](random_blocks(T.Q4_K, 16, 256), (16, 256), DEV)
    other = TYPES[T.Q4_K][0](random_blocks(T.Q4_K, 16, 256, seed=1), (16, 256), DEV)
    tied = Weights(embed=DeviceEmbedding(w), layers=[], output_norm=None, output=BlocksLinear([w]))
    untied = Weights(embed=DeviceEmbedding(w), layers=[], output_norm=None, output=BlocksLinear([other]))
    assert tied.nbytes() == w.nbytes() and untied.nbytes() == 2 * w.nbytes()


def test_blocks_precision_is_refused_where_it_cannot_run(monkeypatch, tmp_path):
    from jllm.errors import JllmError
    from jllm.model.loader import load_model
    from synthetic import write_tiny_model

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "qwen2", qtype=T.Q8_0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(JllmError, match="precision blocks needs a CUDA device"):
        load_model(path, device="cpu", precision="blocks", cache_weights=False)


def test_blocks_precision_refuses_what_would_not_be_exact_or_would_not_run(tmp_path):
    """A verify pass past the matvecs' 16 rows would take the prefill's kernels (not a single step's bits), and
    the GPU attention needs a power-of-two head size: both refused in one line, before anything loads."""
    from jllm.engine import Engine
    from jllm.errors import JllmError
    from jllm.model.loader import load_model
    from jllm.spec.config import SpecConfig
    from synthetic import write_tiny_model

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "qwen2", qtype=T.Q8_0)
    with pytest.raises(JllmError, match="--draft-max is at most 15 with precision blocks"):
        Engine(str(path), device=DEV, precision="blocks", ctx_size=64, spec=SpecConfig(mode="ngram", draft_max=16))
    odd = tmp_path / "odd.gguf"
    write_tiny_model(odd, "qwen3", qtype=T.Q8_0, head_dim=24)
    with pytest.raises(JllmError, match="power-of-two head size"):
        load_model(odd, device=DEV, precision="blocks", cache_weights=False)


def test_blocks_model_batched_pass_is_single_steps_bitwise(tmp_path):
    """A forward over 6 tokens gives each row the logits of decoding it alone (on a GPU, the eager pass: the
    graphs' replays are tested in test_cuda.py)."""
    from jllm.model.loader import load_model
    from synthetic import write_tiny_model

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "qwen2", qtype=T.Q8_0)
    m = load_model(path, device=DEV, precision="blocks", cache_weights=False)
    assert m.block_attention and m.kv_dtype == torch.float16
    m.graphs = None
    ids = torch.arange(3, 9, device=DEV)
    batched = m.forward(ids, m.new_cache(16))
    cache = m.new_cache(16)
    m.forward(ids[:2], cache)
    for t in range(2, 6):
        assert torch.equal(m.forward(ids[t:t + 1], cache)[0], batched[t])


def test_a_padded_prefill_chunk_gives_the_unpadded_chunks_logits_and_features(tmp_path):
    """The prefill graphs' body (cuda/graphs.py, PrefillGraphs) over a chunk padded to its bucket: the last real
    row's logits and the captured layers' inputs of the real rows are the unpadded pass's (bit for bit where
    every product is row by row, as here: Q8_0 has no f16 path), and the real positions' keys are the same."""
    from jllm.cuda.graphs import bucket
    from jllm.model.loader import load_model
    from synthetic import write_tiny_model

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "qwen2", qtype=T.Q8_0)
    m = load_model(path, device=DEV, precision="blocks", cache_weights=False)
    ids = torch.arange(3, 3 + 21, device=DEV)                  # after 4 held tokens: 17 rows, padded to 32
    capture = (1, m.cfg.n_layers)
    plain, padded = m.new_cache(64), m.new_cache(64)
    for cache in (plain, padded):
        m.forward(ids[:4], cache)
    want, want_hidden = m.forward(ids[4:], plain, last_only=True, capture=capture)
    n, b = 17, bucket(17)
    assert b == 32
    x = m.w.embed(ids[4:]).float()
    x = torch.cat([x, x[-1:].expand(b - n, -1)])
    pos = torch.arange(4, 4 + b, device=DEV)
    got, hidden = m._prefill_body(x, padded, pos, torch.tensor([n - 1], device=DEV), capture)
    assert got.shape == want.shape == (1, m.cfg.vocab_size) and hidden.shape == (b, want_hidden.shape[1])
    assert torch.equal(got, want) and torch.equal(hidden[:n], want_hidden)
    assert torch.equal(padded.k[:, :, :4 + n], plain.k[:, :, :4 + n])
    assert [bucket(n) for n in (17, 33, 100, 1024, 1025)] == [32, 48, 128, 1024, None]


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_dequantize_to_f16_matches_the_cpu(kind):
    from jllm.cuda import q4_k, q6_k

    n, k = 24, 768
    raw = random_blocks(kind, n, k, seed=8)
    w = TYPES[kind][0](raw, (n, k), DEV)
    got = (q4_k.dequantize(w) if kind == T.Q4_K else q6_k.dequantize(w)).cpu()
    assert got.dtype == torch.float16 and got.shape == (n, k)
    want = dequantize(raw.numpy(), kind, (n, k))
    assert torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-3 * want.abs().max().item())


def test_a_long_pass_multiplies_over_the_dequantized_matrix():
    """More rows than MATVEC_ROWS (a prefill chunk): the f16 product, close to the matvec's rows."""
    from jllm.cuda.linear import MATVEC_ROWS, BlocksLinear

    n, k = 40, 512
    parts = [TYPES[kind][0](random_blocks(kind, n, k, seed=i), (n, k), DEV) for i, kind in enumerate((T.Q4_K, T.Q6_K))]
    lin = BlocksLinear(parts, torch.randn(2 * n).to(DEV))
    x = torch.randn(MATVEC_ROWS + 4, k, generator=torch.Generator().manual_seed(7)).to(DEV)
    long = lin(x)
    rows = torch.cat([lin(x[i:i + 1]) for i in range(x.shape[0])])
    assert not torch.equal(long, rows)                                 # another path
    assert ((long - rows).abs().max() / rows.abs().max()).item() < max(3e-3, rel_tol(x[:1], parts[0]))


def test_q4_k_rows_on_the_device_are_the_cpus_dequantized_rows_bit_for_bit():
    """The embedding lookup on the GPU (jllm.cuda.embedding) gives the host's rows exactly, any ids, repeats."""
    from jllm.cuda.embedding import DeviceEmbedding
    from jllm.errors import JllmError

    n, k = 24, 512
    raw = random_blocks(T.Q4_K, n, k, seed=5)
    emb = DeviceEmbedding(TYPES[T.Q4_K][0](raw, (n, k), DEV))
    want = dequantize(raw.numpy(), T.Q4_K, (n, k))
    for ids in ([3], [3, 0, 23, 3, 11], list(range(n))):
        got = emb(torch.tensor(ids))
        assert got.device.type == torch.device(DEV).type and got.dtype == torch.float32
        assert torch.equal(got.cpu(), want[ids])
    assert emb(torch.tensor([], dtype=torch.int64)).shape == (0, k)
    with pytest.raises(JllmError, match="out of range"):
        emb(torch.tensor([n]))


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_the_tensor_core_kernels_match_the_cpu_and_keep_each_row_its_own(kind, monkeypatch):
    """jllm.cuda.mma (JLLM_MATVEC_MMA=1): every pass one tile of 16 rows, x in two f16 halves. A row's sums are
    its own bitwise on the GPU (a tensor-core product's element comes from its own row, by one circuit whatever
    the row's place in the tile); the interpreter multiplies the tile with numpy, whose BLAS sums a row by its
    place in the matrix, so there the same row at the same place is what is bitwise."""
    import jllm.cuda.mma as mma

    mma_on(monkeypatch)
    n, k = 40, 1024                                     # 40 outputs: a ragged last tile of 16
    raw = random_blocks(kind, n, k, seed=21)
    w = TYPES[kind][0](raw, (n, k), DEV)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(22)).to(DEV)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(23)).to(DEV)
    want = x.double().cpu() @ dequantize(raw.numpy(), kind, (n, k)).double().T + bias.double().cpu()
    for split in (1, 3):
        assert mma.handles(x, w)
        y = matvec(x, w, bias=bias, split=split)
        assert torch.allclose(y.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        for i in (0, 4, 10):
            alone = matvec(x[i:i + 1], w, bias=bias, split=split)
            assert torch.equal(alone, y[i:i + 1]) if DEV == "cuda" or i == 0 else \
                torch.allclose(alone, y[i:i + 1], rtol=1e-6, atol=1e-6 * want.abs().max().item())
        assert torch.equal(matvec(x[:6], w, bias=bias, split=split), y[:6])
        if DEV == "cuda":
            assert torch.equal(matvec(x[3:9], w, bias=bias, split=split), y[3:9])
    assert not mma.handles(torch.zeros(17, k, device=DEV), w)   # past 16 rows: the other kernels


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_the_tensor_core_kernels_keep_x_of_any_magnitude_to_f32_precision(kind, monkeypatch):
    """x meets the f16 tensor cores scaled by a power of two per row and super-block: rows far outside f16's
    range (1e-7, 1e7), a zero row, and a row whose super-blocks differ by 10^12 each come out as exactly as a
    row of ordinary values."""
    import jllm.cuda.mma as mma

    mma_on(monkeypatch)
    n, k = 16, 768
    raw = random_blocks(kind, n, k, seed=31)
    w = TYPES[kind][0](raw, (n, k), DEV)
    g = torch.Generator().manual_seed(32)
    x = torch.randn(6, k, generator=g)
    x[1] *= 1e-7
    x[2] *= 1e7
    x[3] = 0.0
    x[4, :256] *= 1e6
    x[4, 256:512] *= 1e-6
    x[5, ::7] = 0.0
    ref = dequantize(raw.numpy(), kind, (n, k)).double()
    y = matvec(x.to(DEV), w).double().cpu()
    for i in range(6):
        want = x[i].double() @ ref.T
        # error against the row's own magnitude: |x| . |w|, as for the f32 kernels
        bound = (x[i].double().abs() @ ref.abs().T) * 2e-6 + 1e-300
        assert torch.all((y[i] - want).abs() <= bound), i
    assert torch.equal(y[3], torch.zeros(n, dtype=torch.float64))


def mma_on(monkeypatch, types="1"):
    """The tensor-core kernels on for these block types (JLLM_MATVEC_MMA's values)."""
    import jllm.cuda.mma as mma

    monkeypatch.setattr(mma, "TYPES", mma._types(types))


def test_the_tensor_core_setting_names_block_types():
    import jllm.cuda.mma as mma

    assert mma._types("1") == (mma.Q4KWeight, mma.Q6KWeight) and mma._types("0") == ()
    assert mma._types("Q4_K") == (mma.Q4KWeight,) and mma._types("q6_k") == (mma.Q6KWeight,)
    with pytest.raises(ValueError, match="JLLM_MATVEC_MMA"):
        mma._types("yes")


def kernels_on(monkeypatch, family, types="1"):
    """The tensor-core (family "mma") or the dp4a kernels ("dp4a") on for these block types, and the other
    family off: the module whose prepare() makes x ready for them."""
    import jllm.cuda.dp4a as dp4a
    import jllm.cuda.mma as mma

    on, off = (mma, dp4a) if family == "mma" else (dp4a, mma)
    monkeypatch.setattr(on, "TYPES", on._types(types))
    monkeypatch.setattr(off, "TYPES", ())
    return on


FAMILIES = [("mma", "1"), ("mma", "q4_k"), ("dp4a", "1"), ("dp4a", "q4_k")]


@pytest.mark.parametrize("family,types", FAMILIES)
def test_a_layer_of_q4_k_and_q6_k_parts_prepares_x_once_for_both(monkeypatch, family, types):
    """q|k|v as the Q4_K_M files hold it (Q4_K q|k, Q6_K v) on the tensor cores or the dp4a kernels: one
    prepare a call, in both types' orders, and every part's columns as its own product over x. With only Q4_K
    there (q4_k) x is prepared for it alone and the Q6_K part runs on the float kernels, each row its own.
    dp4a's int8 x is within ~1 % of the float product (the CPU's int8 path quantizes x the same way)."""
    from jllm.cuda.linear import BlocksLinear

    mod = kernels_on(monkeypatch, family, types)
    calls = []
    real = mod.prepare
    monkeypatch.setattr(mod, "prepare", lambda x, ws: calls.append([type(w).__name__ for w in ws]) or real(x, ws))
    n, k = 32, 512
    raws = [random_blocks(kind, n, k, seed=40 + i) for i, kind in enumerate((T.Q4_K, T.Q6_K))]
    parts = [TYPES[kind][0](raw, (n, k), DEV) for raw, kind in zip(raws, (T.Q4_K, T.Q6_K))]
    bias = torch.randn(2 * n, generator=torch.Generator().manual_seed(42)).to(DEV)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(43)).to(DEV)
    layer = BlocksLinear(parts, bias)
    y = layer(x)
    assert calls == ([["Q4KWeight", "Q6KWeight"]] if types == "1" else [["Q4KWeight"]])     # once
    want = torch.cat([x.double().cpu() @ dequantize(raw.numpy(), kind, (n, k)).double().T
                      for raw, kind in zip(raws, (T.Q4_K, T.Q6_K))], dim=1) + bias.double().cpu()
    tol = 1e-5 if family == "mma" else 2e-2
    assert torch.allclose(y.double().cpu(), want, rtol=tol, atol=tol * want.abs().max().item())
    assert torch.equal(layer(x[2:3]), y[2:3])            # every part: bitwise a row alone


@pytest.mark.parametrize("shape,family,types", [("tiny-k", "mma", "1"), ("tiny-k2", "mma", "1"),
                                                ("tiny-k", "mma", "q4_k"), ("tiny-k", "dp4a", "1"),
                                                ("tiny-k2", "dp4a", "1"), ("tiny-k", "dp4a", "q4_k")])
def test_the_norms_and_the_glu_make_x_ready_as_a_launch_of_its_own_would(shape, family, types, monkeypatch,
                                                                         tmp_path):
    """With the tensor-core or the dp4a kernels on, a K-quant model's norms, GLU and attention merge write
    their outputs' prepared form (jllm.cuda.fused, jllm.cuda.attention: `prep`, jllm.cuda.ready): no launch of
    its own prepares x, and the logits are bitwise those of every layer preparing its own x; close to the
    float kernels'. tiny-k2: rows of two super-blocks into the norms, nine into the GLU's three programs a row."""
    import importlib.util
    from pathlib import Path

    from jllm.cuda.linear import BlocksLinear
    from jllm.model.loader import load_model

    spec = importlib.util.spec_from_file_location(
        "synthetic_gguf", Path(__file__).resolve().parents[1] / "benchmarks" / "synthetic_gguf.py")
    synthetic_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(synthetic_gguf)
    path = tmp_path / "k.gguf"
    synthetic_gguf.write(str(path), shape, "q4_k_m")                # Q4_K and Q6_K matrices
    m = load_model(path, device=DEV, precision="blocks", cache_weights=False)
    m.graphs = m.prefill_graphs = None
    ids = torch.tensor([5, 17, 300], device=DEV)
    kernels_on(monkeypatch, "mma", "0")
    cores = m.forward(ids, m.new_cache(16)).cpu()                   # the float kernels
    mod = kernels_on(monkeypatch, family, types)
    calls = []
    real = mod.prepare
    monkeypatch.setattr(mod, "prepare", lambda x, ws: calls.append(x.shape) or real(x, ws))
    fused = m.forward(ids, m.new_cache(16)).cpu()
    assert calls == []
    monkeypatch.setattr(BlocksLinear, "empty_prep", lambda self, x: None)
    own = m.forward(ids, m.new_cache(16)).cpu()
    L = m.cfg.n_layers
    if types == "1":        # q|k|v (one for both types), o, gate|up, down; output
        assert len(calls) == 4 * L + 1
    else:                   # Q4_K only: not the output (Q6_K), nor ffn_down where it is Q6_K (even layers)
        assert len(calls) == 3 * L + L // 2
    assert torch.equal(fused, own)
    assert ((fused - cores).abs().max() / cores.abs().max()).item() < (1e-4 if family == "mma" else 5e-2)


def test_a_block_type_runs_in_one_family_at_most(monkeypatch):
    """JLLM_MATVEC_MMA and JLLM_MATVEC_DP4A may not both take a block type: the import says so in one line."""
    import importlib

    import jllm.cuda.ready as ready

    import jllm.cuda.dp4a as dp4a
    import jllm.cuda.mma as mma

    monkeypatch.setattr(mma, "TYPES", mma._types("q4_k"))
    monkeypatch.setattr(dp4a, "TYPES", dp4a._types("1"))
    with pytest.raises(ValueError, match="both ask for.*Q4KWeight"):
        importlib.reload(ready)
    monkeypatch.setattr(dp4a, "TYPES", dp4a._types("q6_k"))
    importlib.reload(ready)
