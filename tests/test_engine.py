"""The engine's decode loop on a tiny synthetic model: determinism, prefix reuse, stops, limits."""

import pytest
import torch

from jllm.engine import Engine
from jllm.errors import JllmError
from jllm.sampling import SamplingParams
from synthetic import write_tiny_model

pytestmark = pytest.mark.usefixtures("native_kernels")      # built before the first model runs


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "tiny-qwen2.gguf"
    write_tiny_model(path, "qwen2", seed=3)
    return str(path)


@pytest.fixture(scope="module")
def engine(model_path, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("JLLM_CONVERTED_DIR", str(tmp_path_factory.mktemp("converted")))
    return Engine(model_path, ctx_size=128, threads=1)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def fresh(engine):
    engine.reset()
    return engine


def test_greedy_is_deterministic_and_stream_matches_result(engine):
    p = SamplingParams(max_tokens=12)
    a = fresh(engine).generate("hello world", p)
    b = fresh(engine).generate("hello world", p)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert a.finish_reason == "length"
    run = fresh(engine).stream(engine.encode("hello world"), p)
    pieces = list(run)
    assert "".join(x.text for x in pieces) == a.text
    assert [x.token_id for x in pieces if x.token_id >= 0] == a.token_ids
    assert run.finish_reason == "length" and run.spec_stats is None and run.timings.decode_tokens == 12


def test_prefix_reuse_evaluates_only_new_tokens_and_changes_nothing(engine, model_path):
    p = SamplingParams(max_tokens=6)
    first = fresh(engine).generate("the cache keeps", p)
    follow = engine.encode("the cache keeps") + first.token_ids + engine.encode(" and more text")
    reused = engine.generate(follow, p)
    assert reused.timings.cached_tokens >= len(engine.encode("the cache keeps"))
    assert reused.timings.prompt_tokens_evaluated == len(follow) - reused.timings.cached_tokens
    scratch = fresh(engine).generate(follow, p)
    assert scratch.timings.cached_tokens == 0
    assert reused.token_ids == scratch.token_ids      # batch invariance: chunking does not change the output


def test_prompt_fully_cached_still_evaluates_one_token(engine):
    ids = engine.encode("same prompt twice")
    fresh(engine).generate(ids, SamplingParams(max_tokens=1))
    again = engine.generate(ids, SamplingParams(max_tokens=1))
    assert again.timings.prompt_tokens_evaluated == 1


def test_end_of_turn_token_stops_and_is_not_printed(engine):
    eot = min(engine.tokenizer.eot_ids)
    a, b = engine.encode("ab")[:2] if len(engine.encode("ab")) >= 2 else (ord("a"), ord("b"))

    def source(logits, params, budget):
        yield from [a, b, eot, a]

    run = fresh(engine).stream(engine.encode("x"), SamplingParams(max_tokens=10), token_source=source)
    res = list(run)
    assert [p.token_id for p in res] == [a, b, eot]
    assert res[-1].text == ""
    assert run.finish_reason == "stop"


def test_stop_string_truncates_output(engine):
    full = fresh(engine).generate("stop here", SamplingParams(max_tokens=12)).text
    stop = full[3:6]
    assert stop
    res = fresh(engine).generate("stop here", SamplingParams(max_tokens=12, stop=(stop,)))
    assert res.text == full[:full.find(stop)]
    assert res.finish_reason == "stop"


def test_seeded_sampling_reproducible(engine):
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=10)
    a = fresh(engine).generate("seed", p).token_ids
    b = fresh(engine).generate("seed", p).token_ids
    c = fresh(engine).generate("seed", SamplingParams(temperature=1.0, seed=8, max_tokens=10)).token_ids
    assert a == b
    assert a != c


def test_prompt_longer_than_context_is_refused(engine):
    with pytest.raises(JllmError, match="context size"):
        fresh(engine).generate(list(range(3, 3 + 200)), SamplingParams(max_tokens=1))


def test_generation_stops_at_context_end(engine):
    res = fresh(engine).generate(list(range(3, 3 + 120)), SamplingParams(max_tokens=50))
    assert len(res.token_ids) == 128 - 120
    assert res.finish_reason == "length"


def test_chat_ids_use_template(engine):
    ids = engine.chat_ids([{"role": "user", "content": "hi"}])
    text = engine.tokenizer.decode(ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("assistant")


def test_kv_cache_export_import_roundtrip(engine):
    fresh(engine).generate("export me", SamplingParams(max_tokens=3))
    n = engine.cache.length
    k, v = engine.cache.export()
    logits_a = engine.model.forward(torch.tensor([5]), engine.cache)
    engine.cache.truncate(0)
    engine.cache.load(k, v)
    assert engine.cache.length == n
    logits_b = engine.model.forward(torch.tensor([5]), engine.cache)
    assert torch.equal(logits_a, logits_b)


def test_public_load_builds_an_engine_with_a_draft(model_path):
    import jllm

    eng = jllm.load(model_path, draft=model_path, ctx_size=64, threads=1)
    assert isinstance(eng, jllm.Engine) and eng.draft is not None and eng.spec is not None
    assert len(eng.generate("hi", jllm.SamplingParams(max_tokens=4)).token_ids) == 4


class _AheadChain:
    """jllm.cuda.chain.GreedyChain's part on the CPU: every greedy step up to its limit is computed before the
    first token is yielded, so the cache runs ahead of what the caller keeps, as on a GPU (by up to two runs)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def tokens(self, token, cache, start, limit, capture=None, features=None):
        assert cache.length == start and capture is None
        self.calls += 1
        out = []
        for _ in range(limit):
            token = int(self.model.forward(torch.tensor([token]), cache)[0].argmax())
            out.append(token)
        yield from out


def test_greedy_steps_chained_ahead_are_plain_greedy_and_leave_the_same_context(model_path):
    plain = Engine(model_path, ctx_size=128, threads=1)
    chained = Engine(model_path, ctx_size=128, threads=1)
    chained.model.chain = _AheadChain(chained.model)
    assert chained.target.chains() and not plain.target.chains()
    full = plain.generate("chain me", SamplingParams(max_tokens=20)).text
    assert full[5:8]

    def same_context():
        n = len(plain.target)
        assert chained.target.ids == plain.target.ids and chained.target.cache.length == n
        assert torch.equal(chained.target.cache.k[:, :, :n], plain.target.cache.k[:, :, :n])

    for p in [SamplingParams(max_tokens=n) for n in (1, 2, 20)] + [SamplingParams(max_tokens=20, stop=(full[5:8],))]:
        want, got = fresh(plain).generate("chain me", p), fresh(chained).generate("chain me", p)
        assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == want.finish_reason
        same_context()
    for eng in (plain, chained):                         # a consumer that lets go after 7 tokens
        run = fresh(eng).stream(eng.encode("chain me"), SamplingParams(max_tokens=20))
        assert len([next(run) for _ in range(7)]) == 7
        run.close()
    same_context()
    assert len(plain.target) == len(plain.encode("chain me")) + 6
    assert chained.model.chain.calls == 4                # every case but max_tokens=1 chained
    # a generation dropped unclosed is finalised during another one: it must not touch the live one's context
    import gc

    want = fresh(plain).generate("another prompt", SamplingParams(max_tokens=20)).token_ids
    gc.disable()
    try:
        stale = fresh(chained).stream(chained.encode("chain me"), SamplingParams(max_tokens=20))
        assert len([next(stale) for _ in range(5)]) == 5
        del stale
        live = chained.stream(chained.encode("another prompt"), SamplingParams(max_tokens=20))
        got = [next(live).token_id for _ in range(4)]
        gc.collect()
        got += [p.token_id for p in live if p.token_id >= 0]
    finally:
        gc.enable()
    assert got == want and len(chained.target) == len(chained.encode("another prompt")) + 19
    assert chained.target.cache.length == len(chained.target)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=3)   # not greedy: never chained
    chained.model.chain = None
    want = fresh(chained).generate("chain me", sampled).token_ids
    chained.model.chain = _AheadChain(chained.model)
    assert fresh(chained).generate("chain me", sampled).token_ids == want
