"""jllm.cuda.rounds: greedy speculation with an EAGLE-3 head in rounds that stay on the device. The rounds'
tokens are plain greedy decoding's, whatever the head drafts; the context left behind (the target's ids, keys,
values and captured states, the head's rows) is what plain decoding and the host-driven head leave. On a
machine without CUDA the rounds run eagerly in Triton's interpreter; without triton (CI's CPU torch) those
tests skip."""

import os

import pytest
import torch

from jllm.errors import JllmError

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


def test_the_log_ring_splits_a_run_at_its_end():
    from jllm.cuda.rounds import _segments

    assert _segments(0, 4, 8) == [(0, 4)]
    assert _segments(4, 4, 8) == [(4, 8)]
    assert _segments(6, 4, 8) == [(6, 8), (0, 2)]
    assert _segments(7, 1, 8) == [(7, 8)]


def test_the_rounds_setting_is_read_and_checked(monkeypatch):
    from jllm.cuda.rounds import round_drafts

    monkeypatch.delenv("JLLM_CUDA_ROUNDS", raising=False)
    assert round_drafts() == 3                          # on by default (a GPU with a head, greedy)
    monkeypatch.setenv("JLLM_CUDA_ROUNDS", "0")
    assert round_drafts() == 0
    monkeypatch.setenv("JLLM_CUDA_ROUNDS", "4")
    assert round_drafts() == 4
    for bad in ("four", "-1", "16"):
        monkeypatch.setenv("JLLM_CUDA_ROUNDS", bad)
        with pytest.raises(JllmError, match="JLLM_CUDA_ROUNDS"):
            round_drafts()


def test_rounds_serve_speculation_only(tmp_path, monkeypatch):
    """An engine with rounds uses them for greedy generations while speculation is on, and not once it is
    turned off (as `jllm bench --spec` does for its plain runs): here on the CPU, with rounds that only count."""
    from gguf import GGMLQuantizationType as Q

    from jllm.engine import Engine
    from jllm.sampling import SamplingParams
    from jllm.spec.config import SpecConfig
    from synthetic import write_tiny_model
    from test_eagle3 import write_head

    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "converted"))
    ref = write_tiny_model(tmp_path / "t.gguf", "qwen2", Q.Q8_0)
    write_head(tmp_path / "h.gguf", ref, qtype=Q.Q8_0)
    eng = Engine(str(tmp_path / "t.gguf"), draft_path=str(tmp_path / "h.gguf"), spec=SpecConfig(), ctx_size=64)
    assert eng.rounds is None                                # no GPU: the host's loop

    class Counting:
        used = 0

        def __call__(self, *a, **k):
            Counting.used += 1
            return iter([5, 6])

    monkeypatch.setattr(eng, "_round_tokens", Counting())
    eng.rounds = object()
    assert eng.generate("hi", SamplingParams(max_tokens=2)).token_ids == [5, 6] and Counting.used == 1
    spec, eng.spec = eng.spec, None
    eng.generate("hi", SamplingParams(max_tokens=2))
    assert Counting.used == 1
    eng.spec = spec
    eng.generate("hi", SamplingParams(max_tokens=2, temperature=0.8))   # sampling: the host's loop
    assert Counting.used == 1


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    if not HAS_CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported
    pytest.importorskip("triton", reason="triton is not installed (it comes with torch's CUDA builds)")
    from gguf import GGMLQuantizationType as Q

    from synthetic import write_tiny_model
    from test_eagle3 import write_head

    d = tmp_path_factory.mktemp("rounds")
    if HAS_CUDA:        # graphs need the embedding on the device: a Q4_K table (tiny-k), heads by the exporter
        return _k_files(d)
    ref = write_tiny_model(d / "target.gguf", "qwen2", Q.Q8_0)
    write_head(d / "head.gguf", ref, qtype=Q.Q8_0, d2t=False)     # draft ids are target ids (the oracle below)
    write_head(d / "head_d2t.gguf", ref, qtype=Q.Q8_0, seed=2)
    return str(d / "target.gguf"), str(d / "head.gguf"), str(d / "head_d2t.gguf")


def _k_files(d):
    import importlib.util
    from pathlib import Path

    from gguf import GGMLQuantizationType as Q

    from jllm.gguf.reader import read_gguf
    from jllm.model.config import config_from_gguf
    from jllm.train.eagle3 import Eagle3Head, HeadConfig
    from jllm.train.export import write_head as export

    spec = importlib.util.spec_from_file_location(
        "synthetic_gguf", Path(__file__).resolve().parents[1] / "benchmarks" / "synthetic_gguf.py")
    synthetic_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(synthetic_gguf)
    target = str(d / "target.gguf")
    synthetic_gguf.write(target, "tiny-k", "q4_k_m")
    g = read_gguf(target)
    cfg = config_from_gguf(g.metadata, set(g.tensors), target)
    paths = []
    for name, vocab in (("head", cfg.vocab_size), ("head_d2t", 256)):   # d2t the identity, then the first 256
        torch.manual_seed(len(paths))
        head = Eagle3Head(HeadConfig.for_target(cfg, vocab, 256, (0, 1, 2)), torch.zeros(1, cfg.hidden))
        export(d / f"{name}.gguf", head, target, Q.Q8_0)
        paths.append(str(d / f"{name}.gguf"))
    return target, paths[0], paths[1]


class Oracle:
    """The head, but where `truth` knows the token a row predicts (a target position P + 2 for head row P) its
    logits put it first, except at positions where miss(P) holds: acceptance of every length, which a random
    head never gives. Everything but the logits is the head's own (its cache, states, embedding)."""

    def __init__(self, head, truth: list[int], miss):
        self._head = head
        self.truth = torch.tensor(truth + [0] * 64, device=head.device)
        self.miss = miss

    def __getattr__(self, name):
        return getattr(self._head, name)

    def _blocks_body(self, x, cache, pos):
        logits, out = self._head._blocks_body(x, cache, pos)
        want = self.truth.index_select(0, pos + 2)
        hit = torch.full_like(logits, -1e4).scatter_(1, want.view(-1, 1), 1e4)
        keep = self.miss(pos).view(-1, 1)
        return torch.where(keep, logits, hit), out


def engines(files, tmp_path, monkeypatch, head="head", ctx=96):
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "converted"))
    from jllm.engine import Engine
    from jllm.spec.config import SpecConfig
    from jllm.tokenizer.tokenizer import Tokenizer

    monkeypatch.setattr(Tokenizer, "eot_ids", property(lambda self: frozenset()))   # run the whole budget
    target, heads = files[0], {"head": files[1], "d2t": files[2]}
    plain = Engine(target, device=DEV, precision="blocks", ctx_size=ctx, threads=1)
    spec = Engine(target, device=DEV, precision="blocks", ctx_size=ctx, threads=1, draft_path=heads[head],
                  spec=SpecConfig(mode="draft", p_min=0.0, cost_stop=False))
    ref = Engine(target, device=DEV, precision="blocks", ctx_size=ctx, threads=1, draft_path=heads[head],
                 spec=SpecConfig(mode="draft", p_min=0.0, cost_stop=False))
    return plain, spec, ref


def rounds_for(spec, k, truth=None, miss=None):
    from jllm.cuda.rounds import HeadRounds

    head = spec.head if truth is None else Oracle(spec.head, truth, miss)
    spec.rounds = HeadRounds(spec.model, head, k, graphs=HAS_CUDA)
    spec.round_gate = Scripted([("rounds", 1000)])
    return spec.rounds


class Scripted:
    """A round gate that follows a script of (mode, tokens) stretches, over and over."""

    def __init__(self, script):
        self.script, self.i, self.seen, self.issued = script, 0, [], []

    def next(self):
        self.i += 1
        self.issued.append(self.script[(self.i - 1) % len(self.script)])
        return self.issued[-1]

    def observe(self, mode, tokens, seconds):
        self.seen.append((mode, tokens))


def same_context(plain, spec, ref, last, full=True):
    """spec (rounds) holds what plain decoding holds, and what ref (the host-driven head) holds: the target's
    captured states and the head's rows, bitwise (every row of either is a single step's). last: the newest
    token, not yet evaluated."""
    n = len(plain.target)
    for eng in (spec, ref):
        assert eng.target.ids == plain.target.ids and eng.target.cache.length == n
        assert torch.equal(eng.target.cache.k[:, :, :n], plain.target.cache.k[:, :, :n])
        assert torch.equal(eng.target.cache.v[:, :, :n], plain.target.cache.v[:, :, :n])
    assert torch.equal(ref.target.features[:n], spec.target.features[:n])
    context = spec.target.ids + [last]
    m = spec.head.length
    assert m <= n and spec.draft_proposer.paired == context[1:m + 1]
    assert m == n or not full, (m, n)                        # rounds that ran to the end: every row kept
    ref.draft_proposer.catch_up(context[:m + 1])             # the host's head over the same rows
    assert ref.head.length == m
    assert torch.equal(ref.head.cache.k[:, :, :m], spec.head.cache.k[:, :, :m])
    assert torch.equal(ref.head.cache.v[:, :, :m], spec.head.cache.v[:, :, :m])
    return m


def test_rounds_give_plain_greedy_tokens_and_leave_its_context(files, tmp_path, monkeypatch):
    from jllm.sampling import SamplingParams

    plain, spec, ref = engines(files, tmp_path, monkeypatch)
    ids = plain.encode("the cat sat on the mat and the cat sat on the")
    full = plain.generate(ids, SamplingParams(max_tokens=40)).token_ids
    # the oracle misses at every fifth position: rounds accept 0 .. k drafts
    rounds = rounds_for(spec, 3, ids + full, lambda pos: pos % 5 == 2)
    for n in (1, 2, 5, 17, 40):
        for eng in (plain, spec, ref):
            eng.reset()
        launched = rounds.launched
        want = plain.generate(ids, SamplingParams(max_tokens=n)).token_ids
        got = spec.generate(ids, SamplingParams(max_tokens=n))
        assert got.token_ids == want == full[:n] == ref.generate(ids, SamplingParams(max_tokens=n)).token_ids
        assert (rounds.launched > launched) == (n > 1)
        same_context(plain, spec, ref, want[-1], full=n > 1)
    stats = got.spec_stats.as_dict()
    hist = stats["accept_histogram"]
    assert stats["rounds"] >= 8 and hist.get(3, 0) > 0 and sum(v for a, v in hist.items() if 0 < a < 3) > 0
    assert stats["accepted"] > stats["rounds"] and stats["drafted"] == 3 * stats["rounds"]
    # a consumer that lets go early: the context is what plain decoding holds after as many tokens
    for eng in (plain, spec, ref):
        eng.reset()
        run = eng.stream(ids, SamplingParams(max_tokens=40))
        assert len([next(run) for _ in range(13)]) == 13
        run.close()
    same_context(plain, spec, ref, full[12])
    # the next turn goes on from that context, the head's rows included
    more = spec.target.ids + [7, 8, 9]
    assert spec.generate(more, SamplingParams(max_tokens=9)).token_ids == \
        plain.generate(more, SamplingParams(max_tokens=9)).token_ids
    if HAS_CUDA:
        assert rounds.count() == 1


def test_stretches_of_rounds_and_of_steps_give_plain_greedy_tokens(files, tmp_path, monkeypatch):
    """The round gate's stretches: rounds, then plain steps (chained on a GPU, from the host here), then rounds
    again, which catch the head up over the steps' tokens; each stretch is observed with its tokens."""
    from jllm.sampling import SamplingParams

    plain, spec, ref = engines(files, tmp_path, monkeypatch)
    ids = plain.encode("the cat sat on the mat and the cat sat on the")
    want = plain.generate(ids, SamplingParams(max_tokens=30)).token_ids
    rounds = rounds_for(spec, 3, ids + want, lambda pos: pos % 5 == 2)
    spec.round_gate = gate = Scripted([("rounds", 7), ("steps", 4)])
    got = spec.generate(ids, SamplingParams(max_tokens=30))
    assert got.token_ids == want and rounds.launched > 0
    assert gate.issued == [("rounds", 7), ("steps", 4)] * 2 + [("rounds", 7)]
    # each stretch observed with its tokens, but on a GPU those in which a graph was captured (the first of
    # each mode) are not
    assert set(gate.seen) <= {("rounds", 7), ("steps", 4)} and len(gate.seen) >= (1 if HAS_CUDA else 5)
    ref.generate(ids, SamplingParams(max_tokens=30))
    same_context(plain, spec, ref, want[-1], full=False)


def test_rounds_with_a_random_head_and_a_draft_vocabulary(files, tmp_path, monkeypatch):
    """A head drafting over its own vocabulary (d2t) and mostly wrong: still plain greedy's tokens."""
    from jllm.sampling import SamplingParams

    plain, spec, ref = engines(files, tmp_path, monkeypatch, head="d2t")
    rounds = rounds_for(spec, 2)
    for prompt in ("hello", "the quick brown fox"):
        for eng in (plain, spec, ref):
            eng.reset()
        want = plain.generate(prompt, SamplingParams(max_tokens=24)).token_ids
        got = spec.generate(prompt, SamplingParams(max_tokens=24))
        assert got.token_ids == want == ref.generate(prompt, SamplingParams(max_tokens=24)).token_ids
        assert rounds.launched >= got.spec_stats.rounds > 0 and got.spec_stats.drafted == 2 * got.spec_stats.rounds
        same_context(plain, spec, ref, want[-1])


def test_rounds_end_with_plain_steps_where_the_context_has_no_room(files, tmp_path, monkeypatch):
    from jllm.sampling import SamplingParams

    plain, spec, ref = engines(files, tmp_path, monkeypatch, ctx=40)
    ids = plain.encode("the cat sat on the mat")
    full = plain.generate(ids, SamplingParams(max_tokens=100)).token_ids
    assert len(ids) + len(full) == 40                       # the budget is the context's room
    rounds = rounds_for(spec, 4, ids + full, lambda pos: pos % 7 == 3)
    plain.reset()
    got = spec.generate(ids, SamplingParams(max_tokens=100))
    assert got.token_ids == full == ref.generate(ids, SamplingParams(max_tokens=100)).token_ids
    assert plain.generate(ids, SamplingParams(max_tokens=100)).token_ids == full
    assert rounds.launched > 0 and got.spec_stats.rounds > 0
    assert 0 < len(plain.target) - got.spec_stats.accepted - got.spec_stats.rounds - len(ids) + 1 <= 4 + 1
    same_context(plain, spec, ref, full[-1], full=False)
