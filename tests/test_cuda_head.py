"""An EAGLE-3 head on the GPU's kernels (the blocks precision, issue 23): its rows independent of the other rows
of their call, close to the same head in f32, and speculation with it exact. On a machine without CUDA the
kernels run in Triton's interpreter; without triton (CI's CPU torch) the tests skip."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")          # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (it comes with torch's CUDA builds)")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from jllm.eagle3.head import Eagle3Head  # noqa: E402
from jllm.engine import Engine  # noqa: E402
from jllm.errors import JllmError  # noqa: E402
from jllm.model.loader import load_model  # noqa: E402
from jllm.sampling import SamplingParams  # noqa: E402
from jllm.spec.config import SpecConfig  # noqa: E402
from synthetic import write_tiny_model  # noqa: E402
from test_eagle3 import write_head  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cudahead")
    ref = write_tiny_model(d / "target.gguf", "qwen2", Q.Q8_0)
    write_head(d / "head.gguf", ref, qtype=Q.Q8_0)
    return ref, str(d / "target.gguf"), str(d / "head.gguf")


def test_a_blocks_head_is_row_exact_and_close_to_the_head_in_f32(files):
    ref, target_path, head_path = files
    model = load_model(target_path, device=DEV, precision="blocks", max_positions=64, cache_weights=False)
    model.graphs = model.prefill_graphs = None             # the eager pass (test_cuda.py replays the graphs)
    head = Eagle3Head.load(head_path, model, use_cache=False)
    assert head.precision == "blocks" and head.cache.k.device.type == DEV and head.cache.k.dtype == torch.float16
    tokens = [5, 77, 260, 9, 130, 41, 3]
    _, hidden = model.forward(torch.tensor(tokens), model.new_cache(64), capture=head.target_layers)
    assert hidden.device.type == DEV
    whole = head.prefill(hidden[:6], tokens[1:7])
    after = head.step(11, whole.state)
    assert whole.logits.device.type == DEV
    head.truncate(0)
    for p in range(6):                                       # the same positions one row at a time
        one = head.prefill(hidden[p:p + 1], tokens[p + 1:p + 2])
    assert torch.equal(one.logits, whole.logits) and torch.equal(one.state, whole.state)
    assert torch.equal(head.step(11, one.state).logits, after.logits)
    exact = Eagle3Head.load(head_path, model, precision="exact", use_cache=False)
    want = exact.prefill(hidden[:6], tokens[1:7])
    scale = want.logits.abs().max()
    assert ((whole.logits.float() - want.logits.float()).abs().max() / scale).item() < 2e-2
    full = head.target_logits(whole.logits)                  # the draft vocabulary's rows at their target ids
    assert full.device.type == DEV and full.shape[-1] == model.cfg.vocab_size
    assert torch.equal(full[head._d2t_here], whole.logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_heads_passes_replay_as_cuda_graphs_bitwise_the_eager_ones(files):
    ref, target_path, head_path = files
    model = load_model(target_path, device=DEV, precision="blocks", max_positions=64, cache_weights=False)
    head = Eagle3Head.load(head_path, model, use_cache=False)
    assert head.graphs is not None
    tokens = [5, 77, 260, 9, 130, 41, 3]
    _, hidden = model.forward(torch.tensor(tokens), model.new_cache(64), capture=head.target_layers)
    runs = []
    for _ in range(3):                                      # the first call captures, the others replay
        head.truncate(0)
        whole = head.prefill(hidden[:6], tokens[1:7])
        runs.append((whole, head.step(11, whole.state), head.step(12, whole.state)))
    assert head.graphs.count() == 2                         # a pass of 6 rows, and of 1
    for whole, a, b in runs[1:]:
        assert torch.equal(whole.logits, runs[0][0].logits) and torch.equal(whole.state, runs[0][0].state)
        assert torch.equal(a.logits, runs[0][1].logits) and torch.equal(b.logits, runs[0][2].logits)
    assert not torch.equal(runs[0][1].logits, runs[0][2].logits)


def test_a_blocks_head_needs_a_blocks_target(files):
    _, target_path, head_path = files
    model = load_model(target_path, device="cpu", precision="exact", max_positions=64, cache_weights=False)
    with pytest.raises(JllmError, match="blocks precision needs its target in it too"):
        Eagle3Head.load(head_path, model, precision="blocks", use_cache=False)


def test_speculation_with_a_blocks_head_is_plain_greedy(files, monkeypatch, tmp_path):
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "converted"))
    from jllm.tokenizer.tokenizer import Tokenizer

    monkeypatch.setattr(Tokenizer, "eot_ids", property(lambda self: frozenset()))   # run the whole budget
    _, target_path, head_path = files
    prompt, p = "the cat sat on the mat and the cat sat on the", SamplingParams(max_tokens=12)
    plain = Engine(target_path, device=DEV, precision="blocks", ctx_size=96, threads=1)
    spec = Engine(target_path, device=DEV, precision="blocks", ctx_size=96, threads=1, draft_path=head_path,
                  spec=SpecConfig(mode="draft", p_min=0.0, cost_stop=False))
    assert spec.head is not None and spec.head.precision == "blocks"
    assert spec.target.features.device.type == DEV
    want = plain.generate(prompt, p).token_ids
    out = spec.generate(prompt, p)
    assert out.token_ids == want and len(want) == 12
    assert out.spec_stats.as_dict()["by_proposer"]["head"]["drafted"] > 0


def test_the_store_hydrates_the_target_and_the_head_onto_the_device(files, monkeypatch, tmp_path):
    """A conversation's next turn in a new process (a new engine): its KV state and the head's come back from
    the persistent store onto the device, only the new tokens are evaluated, and the output is plain greedy."""
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "converted"))
    from jllm.tokenizer.tokenizer import Tokenizer

    monkeypatch.setattr(Tokenizer, "eot_ids", property(lambda self: frozenset()))
    _, target_path, head_path = files
    kv, p = str(tmp_path / "kv"), SamplingParams(max_tokens=6)

    def engine(**kw):
        return Engine(target_path, device=DEV, precision="blocks", ctx_size=96, threads=1, **kw)

    def spec_engine():
        return engine(draft_path=head_path, kv_store_dir=kv, spec=SpecConfig(mode="draft", p_min=0.0,
                                                                             cost_stop=False))

    first = spec_engine()
    prompt = "the cat sat on the mat"
    turn1 = first.generate(prompt, p, conv_id="c")
    first.wait_saves()
    ids = first.encode(prompt) + turn1.token_ids + first.encode(" and then")
    again = spec_engine()
    res = again.generate(ids, p, conv_id="c")
    n = res.timings.cached_tokens
    assert n > 0 and again.target.evaluated == len(ids) - n
    assert again.cache.k.device.type == DEV and again.head.cache.k.device.type == DEV
    assert again.draft_proposer.paired[:n] == ids[1:n + 1]      # the head's stored positions came back
    assert res.token_ids == engine().generate(ids, p).token_ids


def test_serve_answers_from_the_device_with_the_head(files, monkeypatch, tmp_path):
    """`jllm serve --device cuda`'s app over an engine on the GPU's kernels with the head: a completion, plain
    and streamed, is the engine's plain greedy text, drafted by the head."""
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "converted"))
    from fastapi.testclient import TestClient

    from jllm.server import create_app
    from jllm.tokenizer.tokenizer import Tokenizer

    monkeypatch.setattr(Tokenizer, "eot_ids", property(lambda self: frozenset()))
    _, target_path, head_path = files
    prompt = "the cat sat on the mat"
    want = Engine(target_path, device=DEV, precision="blocks", ctx_size=96, threads=1).generate(
        prompt, SamplingParams(max_tokens=6))
    eng = Engine(target_path, device=DEV, precision="blocks", ctx_size=96, threads=1, draft_path=head_path,
                 spec=SpecConfig(mode="draft", p_min=0.0, cost_stop=False))
    with TestClient(create_app(eng, "tiny")) as client:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text and r.json()["usage"]["completion_tokens"] == 6
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            pieces = [line for line in s.iter_lines() if line.startswith("data: {")]
        assert "".join(json.loads(p[6:])["choices"][0]["text"] for p in pieces) == want.text
    assert eng.head is not None and eng.head.cache.k.device.type == DEV
