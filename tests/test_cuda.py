"""The same model on CUDA: logits match the CPU exact path; the engine generates. Skipped without a GPU
(CI has none; run on the borrowed H200, see BENCHMARKS.md)."""

import pytest
import torch

from cuda_checks import cuda_vs_cpu_exact
from jllm.engine import Engine
from jllm.sequence import CUDA_PREFILL_CHUNK
from jllm.sampling import SamplingParams
from synthetic import write_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_cuda_exact_matches_cpu(arch, tmp_path):
    assert cuda_vs_cpu_exact(tmp_path / f"{arch}.gguf", arch) < 1e-3


def test_cuda_bf16_engine_generates(tmp_path):
    path = tmp_path / "qwen2.gguf"
    write_tiny_model(path, "qwen2")
    eng = Engine(str(path), device="cuda", precision="bf16", ctx_size=128)
    assert eng.precision == "bf16"
    res = eng.generate("hello", SamplingParams(max_tokens=8))
    assert len(res.token_ids) == 8
    sampled = eng.generate("hello", SamplingParams(max_tokens=8, temperature=0.8, seed=1))
    assert len(sampled.token_ids) == 8


def test_cuda_defaults_to_the_gguf_blocks_where_triton_is_there(tmp_path):
    pytest.importorskip("triton")
    path = tmp_path / "qwen2.gguf"
    write_tiny_model(path, "qwen2")
    eng = Engine(str(path), device="cuda", ctx_size=128)
    assert eng.precision == "blocks"
    assert len(eng.generate("hello", SamplingParams(max_tokens=8)).token_ids) == 8


def test_cuda_bench_reports_the_devices_memory(tmp_path):
    from jllm.bench import measure, print_table

    path = tmp_path / "qwen2.gguf"
    write_tiny_model(path, "qwen2")
    eng = Engine(str(path), device="cuda", ctx_size=128)
    r = measure(eng, prompt_tokens=16, decode_tokens=4, max_k=2, repeats=1)
    g = r["gpu_memory"]
    assert r["weights_mb"] > 0 and g["kv_mb"] > 0 and g["peak_mb"] >= r["weights_mb"] + g["kv_mb"]
    print_table(r)


def _blocks_model(tmp_path):
    from gguf import GGMLQuantizationType as T

    from jllm.model.loader import load_model

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "qwen2", qtype=T.Q8_0)
    return path, load_model(path, device="cuda", precision="blocks", cache_weights=False)


def test_blocks_graph_replays_are_the_eager_pass_bitwise(tmp_path):
    """Decode and verify steps replayed from CUDA graphs give the eager pass's logits bit for bit, and a verify
    pass's rows are those of single steps."""
    _, m = _blocks_model(tmp_path)
    graphs = m.graphs
    assert graphs is not None and m.kv_dtype == torch.float16
    ids = torch.arange(3, 40, device="cuda")
    runs, caches = [], []                         # (the graphs live as long as their cache)
    for use in (graphs, None):
        m.graphs = use
        cache = m.new_cache(64)
        caches.append(cache)
        m.forward(ids[:20], cache)                                    # a prefill (eager: more rows than graphs)
        steps = [m.forward(ids[t:t + 1], cache)[0] for t in range(20, 30)]    # captured, then replayed
        verify = [m.forward(ids[30:35], cache)]                       # 5 rows: captured
        cache.truncate(30)
        verify.append(m.forward(ids[30:35], cache))                   # replayed at the same positions
        runs.append((steps, verify))
    m.graphs = graphs
    assert graphs.count() >= 2
    (g_steps, g_verify), (e_steps, e_verify) = runs
    assert all(torch.equal(a, b) for a, b in zip(g_steps, e_steps))
    assert all(torch.equal(v, e_verify[0]) for v in g_verify + e_verify)
    cache = m.new_cache(64)
    m.forward(ids[:30], cache)
    for t in range(30, 35):                                           # the verify rows as single steps
        assert torch.equal(m.forward(ids[t:t + 1], cache)[0], g_verify[0][t - 30])


def test_prefill_chunks_replay_from_graphs_as_the_eager_pass(tmp_path):
    """A prefill chunk runs as a padded graph (PrefillGraphs): captured once per bucket and cache, replayed
    after, its logits and captured features the eager unpadded pass's (bit for bit: Q8_0's products are row
    by row), and the decode steps after it the same; where the padding would pass the cache's end, eager."""
    _, m = _blocks_model(tmp_path)
    pg = m.prefill_graphs
    assert pg is not None and m.prefill_chunk == CUDA_PREFILL_CHUNK
    ids = torch.arange(3, 60, device="cuda")
    capture = (1, m.cfg.n_layers)

    def run(cache):
        m.forward(ids[:4], cache)
        logits = m.forward(ids[4:21], cache, last_only=True)                  # 17 rows: bucket 32
        cache.truncate(4)
        again = m.forward(ids[4:21], cache, last_only=True)
        cache.truncate(4)
        feats = m.forward(ids[4:21], cache, last_only=True, capture=capture)
        steps = [m.forward(ids[t:t + 1], cache)[0] for t in range(21, 24)]
        return logits, again, feats, steps

    m.prefill_graphs = None
    want = run(m.new_cache(64))
    m.prefill_graphs = pg
    cache = m.new_cache(64)
    got = run(cache)
    assert pg.count() == 2                                     # (32, no capture) and (32, capture)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    assert all(torch.equal(a, b) for a, b in zip(got[3], want[3]))
    outs = []                                                  # 4 + 32 > 24: no bucket fits, eager
    for use in (pg, None):                                     # (attention's key chunks follow the cache size)
        m.prefill_graphs = use
        short = m.new_cache(24)
        m.forward(ids[:4], short)
        outs.append(m.forward(ids[4:21], short, last_only=True))
        assert short.length == 21
    m.prefill_graphs = pg
    assert torch.equal(outs[0], outs[1])
    assert pg.count() == 2


def test_blocks_speculative_greedy_is_plain_greedy_on_the_gpu(tmp_path):
    from jllm.spec.config import SpecConfig

    from gguf import GGMLQuantizationType as T

    path, _ = _blocks_model(tmp_path)
    draft = tmp_path / "draft.gguf"                 # other weights, same tokenizer: rejections and rollbacks
    write_tiny_model(draft, "qwen2", qtype=T.Q8_0, seed=1)
    plain = Engine(str(path), device="cuda", precision="blocks", ctx_size=256)
    spec = Engine(str(path), device="cuda", precision="blocks", ctx_size=256, draft_path=str(draft),
                  spec=SpecConfig(mode="draft"))
    for prompt in ("hello", "the quick brown fox"):
        want = plain.generate(prompt, SamplingParams(max_tokens=40)).token_ids
        assert spec.generate(prompt, SamplingParams(max_tokens=40)).token_ids == want


def test_greedy_steps_chained_on_the_device_are_plain_greedy(tmp_path):
    """jllm.cuda.chain: greedy decoding replayed back to back on the GPU gives plain steps' tokens, and leaves
    the context (ids, cache length, keys) that plain steps leave, also when the consumer lets go early."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location(
        "synthetic_gguf", Path(__file__).resolve().parents[1] / "benchmarks" / "synthetic_gguf.py")
    synthetic_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(synthetic_gguf)
    path = tmp_path / "k.gguf"
    synthetic_gguf.write(str(path), "tiny-k", "q4_k_m")          # a Q4_K embedding: looked up on the device
    chained = Engine(str(path), device="cuda", ctx_size=256)
    plain = Engine(str(path), device="cuda", ctx_size=256)
    plain.model.chain = None
    assert chained.target.chains() and not plain.target.chains()

    def same_context():
        n = len(plain.target)
        assert chained.target.ids == plain.target.ids and chained.target.cache.length == n
        assert torch.equal(chained.target.cache.k[:, :, :n], plain.target.cache.k[:, :, :n])

    for n in (1, 2, 8, 9, 40):                                   # runs of 8: one, two, and past the log's wrap
        for eng in (plain, chained):
            eng.reset()
        want = plain.generate("hello", SamplingParams(max_tokens=n)).token_ids
        assert chained.generate("hello", SamplingParams(max_tokens=n)).token_ids == want
        same_context()
    for eng in (plain, chained):
        eng.reset()
        run = eng.stream(eng.encode("the quick brown fox"), SamplingParams(max_tokens=60))
        assert len([next(run) for _ in range(13)]) == 13
        run.close()
    same_context()
    assert chained.model.chain.count() >= 1
    # with an EAGLE-3 head's capture: each chained step writes its captured row, as a step does
    import itertools

    from jllm.sequence import Sequence

    cap = (1, chained.model.cfg.n_layers)
    a, b = (Sequence(chained.model, 64, capture=cap) for _ in range(2))
    for s in (a, b):
        s.sync(chained.encode("hello world"))
    got = list(itertools.islice(a.chain_tokens(5, 12), 12))
    a.rollback(len(a))
    want, t = [], 5
    for _ in range(12):
        t = int(torch.argmax(b.step(t)))
        want.append(t)
    n = len(b)
    assert got == want and a.ids == b.ids and a.cache.length == n
    assert torch.equal(a.features[:n], b.features[:n]) and torch.equal(a.cache.v[:, :, :n], b.cache.v[:, :, :n])
