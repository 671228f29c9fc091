"""The speculative loop (jllm/spec/loop.py) with fake proposers over a fake target (fake_model.py): greedy
output identical to plain decoding however right or wrong the proposals are, over 64 tokens or more; the
target's sequence ends where plain decoding's does; end of turn inside an accepted run; the budget; side
leaves taken; the n-gram proposer alone."""

import random

import pytest

from fake_model import FakeModel
from jllm.sampling import SamplingParams
from jllm.sequence import Sequence
from jllm.spec.config import SpecConfig
from jllm.spec.loop import SpeculativeDecoder
from jllm.spec.policy import DraftGate
from jllm.spec.proposers import Proposal

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
N = 80


class AlwaysDraft(DraftGate):
    """A gate that never turns the draft off: on a fake model the measured times say nothing."""

    def choose(self) -> str:
        return "draft"


class Oracle:
    """Proposes the target's own greedy continuation, each token wrong with probability `wrong` (then
    offering the right one as a side leaf when `leaves`)."""

    kind = "draft"

    def __init__(self, model, wrong: float = 0.0, leaves: bool = False, seed: int = 0):
        self.model, self.wrong, self.leaves = model, wrong, leaves
        self.rng = random.Random(seed)
        self.asked: list[int] = []

    def propose(self, context, k, limits):
        self.asked.append(k)
        right = self.model.greedy(context, k)
        tokens, leaf = [], None
        for i, t in enumerate(right):
            if self.rng.random() < self.wrong:
                tokens.append((t + 1) % self.model.vocab)
                if self.leaves and leaf is None and limits.leaf_p > 0:
                    leaf = (i, t)
            else:
                tokens.append(t)
        return Proposal(tokens, kind="draft", leaf=leaf, forwards=len(tokens), step_s=1e-4)


def run(model, proposer, n=N, eot=frozenset(), cfg=None, params=None, prompt=PROMPT):
    cfg = cfg or SpecConfig(mode="draft", p_min=0.0, leaf_gate=False, cost_stop=False)
    target = Sequence(model, 512)
    logits = target.sync(prompt)
    dec = SpeculativeDecoder(target, proposer, cfg, eot, gate=AlwaysDraft())
    out = list(dec.tokens(logits, params or SamplingParams(max_tokens=n), n))
    return out, target, dec.stats


@pytest.mark.parametrize("wrong", [0.0, 0.1, 0.5, 1.0])
def test_greedy_output_is_plain_decoding_whatever_the_proposals(wrong):
    model = FakeModel(seed=1)
    want = model.greedy(PROMPT, N)
    out, target, stats = run(model, Oracle(model, wrong=wrong, seed=2))
    assert len(out) == N and out == want
    # the target holds what plain decoding would: everything but the newest token, keys matching ids
    assert target.ids == PROMPT + want[:-1]
    assert target.cache.k[0, 0, :len(target.ids), 0].long().tolist() == target.ids
    assert stats.rounds > 0 and stats.drafted > 0
    if wrong == 0.0:
        assert stats.accepted == stats.drafted
    if wrong == 1.0:
        assert stats.accepted == 0


def test_length_limits_follow_what_was_accepted():
    model = FakeModel(seed=1)
    proposer = Oracle(model, wrong=1.0)
    run(model, proposer, cfg=SpecConfig(mode="draft", p_min=0.0, draft_max=8, cost_stop=False, leaf_p=0.0))
    assert proposer.asked[0] == 8 and set(proposer.asked[1:-1]) == {2}     # nothing accepted: 0 + 2


def test_end_of_turn_inside_an_accepted_run_stops_there():
    model = FakeModel(seed=3)
    want = model.greedy(PROMPT, N)
    cut = next(i for i in range(8, N) if want[i] not in want[:i])
    out, target, stats = run(model, Oracle(model), eot=frozenset({want[cut]}))
    assert out == want[:cut + 1] and stats.accepted > 0
    assert want[cut] not in target.ids[len(PROMPT):]             # the cache never holds the end of turn


def test_the_budget_is_exact():
    model = FakeModel(seed=4)
    for n in (1, 2, 7, 65):
        out, _, _ = run(model, Oracle(model), n=n)
        assert out == model.greedy(PROMPT, n)


def test_side_leaves_are_taken_and_keep_the_output():
    model = FakeModel(seed=5)
    want = model.greedy(PROMPT, N)
    out, target, stats = run(model, Oracle(model, wrong=0.3, leaves=True, seed=6))
    assert out == want and target.ids == PROMPT + want[:-1]
    assert target.cache.k[0, 0, :len(target.ids), 0].long().tolist() == target.ids
    assert stats.leaves > 0 and stats.leaves_taken == stats.leaves     # the leaf is always the right token


def test_ngram_alone_on_repeating_text():
    model = FakeModel(vocab=4, seed=7)              # four tokens: the greedy text soon repeats itself
    prompt = [1, 2, 3, 0, 1]
    want = model.greedy(prompt, N)
    cfg = SpecConfig(mode="ngram", cost_stop=False)
    out, _, stats = run(model, None, cfg=cfg, prompt=prompt)
    assert out == want
    assert stats.by_proposer["ngram"][2] > 0        # accepted n-gram tokens


def test_sampled_run_is_reproducible_by_seed():
    model = FakeModel(seed=8)
    params = SamplingParams(max_tokens=N, temperature=1.0, seed=11)
    a, _, _ = run(model, Oracle(model, wrong=0.3), params=params)
    b, _, _ = run(model, Oracle(model, wrong=0.3), params=params)
    assert a == b and len(a) == N
