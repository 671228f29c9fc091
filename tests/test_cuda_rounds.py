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
    assert round_drafts() == 0
    monkeypatch.setenv("JLLM_CUDA_ROUNDS", "4")
    assert round_drafts() == 4
    for bad in ("four", "-1", "16"):
        monkeypatch.setenv("JLLM_CUDA_ROUNDS", bad)
        with pytest.raises(JllmError, match="JLLM_CUDA_ROUNDS"):
            round_drafts()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    if not HAS_CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported
    pytest.importorskip("triton", reason="triton is not installed (it comes with torch's CUDA builds)")
    from gguf import GGMLQuantizationType as Q

    from synthetic import write_tiny_model
    from test_eagle3 import write_head

    d = tmp_path_factory.mktemp("rounds")
    ref = write_tiny_model(d / "target.gguf", "qwen2", Q.Q8_0)
    write_head(d / "head.gguf", ref, qtype=Q.Q8_0, d2t=False)     # draft ids are target ids (the oracle below)
    write_head(d / "head_d2t.gguf", ref, qtype=Q.Q8_0, seed=2)
    return str(d / "target.gguf"), str(d / "head.gguf"), str(d / "head_d2t.gguf")


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
    return spec.rounds


def same_context(plain, spec, ref, last):
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
    ref.draft_proposer.catch_up(context[:m + 1])             # the host's head over the same rows
    assert ref.head.length == m
    assert torch.equal(ref.head.cache.k[:, :, :m], spec.head.cache.k[:, :, :m])
    assert torch.equal(ref.head.cache.v[:, :, :m], spec.head.cache.v[:, :, :m])
    return m


def test_rounds_with_a_random_head_and_a_draft_vocabulary(files, tmp_path, monkeypatch):
    """A head drafting over its own vocabulary (d2t) and mostly wrong: still plain greedy's tokens."""
    from jllm.sampling import SamplingParams

    plain, spec, ref = engines(files, tmp_path, monkeypatch, head="d2t")
    rounds_for(spec, 2)
    for prompt in ("hello", "the quick brown fox"):
        for eng in (plain, spec, ref):
            eng.reset()
        want = plain.generate(prompt, SamplingParams(max_tokens=24)).token_ids
        got = spec.generate(prompt, SamplingParams(max_tokens=24))
        assert got.token_ids == want == ref.generate(prompt, SamplingParams(max_tokens=24)).token_ids
        assert got.spec_stats.rounds > 0
        same_context(plain, spec, ref, want[-1])


def test_rounds_end_with_plain_steps_where_the_context_has_no_room(files, tmp_path, monkeypatch):
    from jllm.sampling import SamplingParams

    plain, spec, ref = engines(files, tmp_path, monkeypatch, ctx=40)
    ids = plain.encode("the cat sat on the mat")
    full = plain.generate(ids, SamplingParams(max_tokens=100)).token_ids
    assert len(ids) + len(full) == 40                       # the budget is the context's room
    rounds_for(spec, 4, ids + full, lambda pos: pos % 7 == 3)
    plain.reset()
    got = spec.generate(ids, SamplingParams(max_tokens=100))
    assert got.token_ids == full == ref.generate(ids, SamplingParams(max_tokens=100)).token_ids
    assert plain.generate(ids, SamplingParams(max_tokens=100)).token_ids == full
    same_context(plain, spec, ref, full[-1])
