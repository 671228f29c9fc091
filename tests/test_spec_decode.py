"""Speculative decoding end to end on tiny synthetic models: greedy output identical to plain decoding for
every proposer (a good draft, a bad draft, n-gram), caches rolled back exactly, sampled output distributed as
the target's (chi-square against the exact joint distribution), and the tokenizer gate."""

import math

import pytest
import torch

from jllm.engine import Engine
from jllm.errors import JllmError
from jllm.sampling import SamplingParams, probs
from jllm.spec.decode import SpecConfig, SpeculativeDecoder
from synthetic import write_tiny_model

PROMPT = "the cat sat on the mat and the cat sat on the"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    out = {}
    for name, arch, seed in (("target", "qwen2", 1), ("other", "qwen2", 2), ("llama", "llama", 1)):
        out[name] = str(d / f"{name}.gguf")
        write_tiny_model(out[name], arch, seed=seed)
    return out


@pytest.fixture(autouse=True)
def _converted_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "converted"))


def engine(path, draft=None, mode="none", precision="int8", **kw):
    return Engine(path, ctx_size=256, threads=1, draft_path=draft, precision=precision,
                  spec=SpecConfig(mode=mode, **kw))


# int8 and native compute different logits, so the tiny model's text differs: under native it ends early with
# an end-of-turn token inside an accepted draft.
@pytest.mark.parametrize("draft_name,mode,precision", [
    (None, "ngram", "int8"), ("target", "draft", "int8"), ("target", "draft", "native"),
    ("other", "draft", "int8"), ("other", "draft", "native"), ("other", "draft+ngram", "int8"),
    ("other", "draft+ngram", "native")])
def test_greedy_output_identical_to_plain(paths, draft_name, mode, precision):
    plain = engine(paths["target"], precision=precision)
    p = SamplingParams(max_tokens=40)
    # n-gram alone: a prompt that repeats itself, so its lookup drafts whatever the tiny model then writes
    prompt = PROMPT + " " + PROMPT if draft_name is None else PROMPT
    ref = plain.generate(prompt, p)
    # p_min 0: the tiny random models are never confident, and a self-draft should draft whole blocks
    # a self-draft computes exactly as the target (not at the lighter default draft precision)
    same = {"draft_precision": precision} if draft_name == "target" else {}
    spec = engine(paths["target"], paths[draft_name] if draft_name else None, mode=mode, p_min=0.0,
                  precision=precision, **same)
    out = spec.generate(prompt, p)
    assert out.token_ids == ref.token_ids
    st = spec.spec_stats.as_dict()
    assert st["rounds"] > 0
    if draft_name == "target":                 # the draft is the target itself: everything is accepted
        assert st["acceptance_rate"] == 1.0 and st["tokens_per_verify"] > 2
    # the cache ends exactly where plain decoding's does
    assert spec.cached_ids == plain.cached_ids
    n = plain.cache.length
    assert spec.cache.length == n
    assert torch.equal(spec.cache.k[:, :, :n], plain.cache.k[:, :, :n])


def test_draft_vocabulary_subset_stays_exact(paths):
    """FR-Spec: the draft scores only ids < 200 of 300; greedy output is still the target's, sampling works."""
    p = SamplingParams(max_tokens=30)
    ref = engine(paths["target"]).generate(PROMPT, p).token_ids
    eng = engine(paths["target"], paths["target"], mode="draft", draft_vocab=200)
    assert eng.draft.model.w.output.out_features == 200
    assert eng.generate(PROMPT, p).token_ids == ref
    eng.cache.truncate(0)
    eng.cached_ids = []
    out = eng.generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=3))
    assert len(out.token_ids) == 20


def test_always_wrong_draft_is_still_exact(paths, monkeypatch):
    eng = engine(paths["target"], mode="ngram", draft_max=4)
    ref = engine(paths["target"]).generate(PROMPT, SamplingParams(max_tokens=30)).token_ids
    vocab = eng.model.cfg.vocab_size

    def wrong(self, context, k, params, gen):
        return "ngram", [(context[-1] + 7 + i) % vocab for i in range(k)], None

    monkeypatch.setattr(SpeculativeDecoder, "_propose", wrong)
    out = eng.generate(PROMPT, SamplingParams(max_tokens=30))
    assert out.token_ids == ref
    assert eng.spec_stats.accepted < eng.spec_stats.drafted


def test_stops_on_budget_and_end_of_turn(paths, monkeypatch):
    eng = engine(paths["target"], paths["target"], mode="draft")
    out = eng.generate(PROMPT, SamplingParams(max_tokens=7))
    assert len(out.token_ids) == 7
    assert out.finish_reason == "length"
    # End of turn: a token that plain greedy decoding first writes at position >= 8 is made an end-of-turn
    # token; the draft (the target itself) proposes it inside an accepted run, and the loop must stop there.
    plain = engine(paths["target"]).generate(PROMPT, SamplingParams(max_tokens=40)).token_ids
    cut = next(i for i in range(8, len(plain)) if plain[i] not in plain[:i])
    monkeypatch.setattr(type(eng.tokenizer), "eot_ids", property(lambda self: frozenset({plain[cut]})))
    eng = engine(paths["target"], paths["target"], mode="draft")
    out = eng.generate(PROMPT, SamplingParams(max_tokens=40))
    assert out.finish_reason == "stop" and out.token_ids == plain[:cut + 1]
    assert eng.spec_stats.accepted > 0


def test_sampled_distribution_matches_target(paths):
    """Joint distribution of the first two sampled tokens (top-k 3, so 9 outcomes) under speculative
    sampling with a different draft model, against the exact p(t1) p(t2 | t1) from the target."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=2)
    target = engine(paths["target"])
    ids = target.encode(PROMPT)
    logits, _ = target.prefill(ids)
    p1 = probs(logits, params, ids)
    exact = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        target.cache.truncate(len(ids))
        target.cached_ids = list(ids)
        p2 = probs(target.step(t1), params, ids + [t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            exact[(t1, t2)] = p1[t1].item() * p2[t2].item()
    spec = engine(paths["target"], paths["other"], mode="draft", draft_max=1, p_min=0.0)
    n = 1500
    counts = dict.fromkeys(exact, 0)
    drafted = 0
    for seed in range(n):
        spec.cache.truncate(0)
        spec.cached_ids = []
        spec.spec_gate = None                  # a fresh gate: its first rounds always draft
        # 3 tokens: t1 from the prefill, t2 drafted and verified (accepted or recovered), t3 a by-product
        out = spec.generate(ids, SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=seed)).token_ids
        assert tuple(out[:2]) in counts, f"sampled {out}, impossible under the target"
        counts[tuple(out[:2])] += 1
        drafted += spec.spec_stats.drafted
    chi2 = sum((counts[o] - n * pr) ** 2 / (n * pr) for o, pr in exact.items())
    dof = len(exact) - 1
    critical = {8: 26.12, 7: 24.32, 6: 22.46, 5: 20.52, 4: 18.47}.get(dof, dof + 5 * math.sqrt(2 * dof))
    assert chi2 < critical, f"chi2 {chi2:.1f} >= {critical} (dof {dof}): {counts} vs {exact}"
    assert drafted == n                       # every run verified one drafted token


def test_tokenizer_gate_refuses_cross_family_draft(paths):
    with pytest.raises(JllmError, match="tokenizers differ"):
        engine(paths["target"], paths["llama"], mode="draft")


def drive(gate, rounds: int, tokens) -> list[str]:
    """Run a gate for some rounds: a target step takes 40 ms, a draft step 10 ms (d = 0.25), a draft round
    drafts 3 tokens in 3 forward passes and emits tokens(i) of them (i: the round's index)."""
    picks = []
    for i in range(rounds):
        arm = gate.choose()
        picks.append(arm)
        if arm == "draft":
            gate.observe(0.04 * (1 + 0.1 * 3), 3, 0.01)
            gate.record(tokens(i), 3, 3)
        else:
            gate.observe(0.04, 0)
    return picks


def test_draft_gate_keeps_a_draft_that_pays_and_drops_one_that_does_not():
    from jllm.spec.decode import DraftGate

    # 2.2 tokens for 3 * 0.25 + 1.3 = 2.05 steps: the draft pays, it runs every round
    assert drive(DraftGate(explore=5), 40, lambda i: 2.2) == ["draft"] * 40
    # 1.8 tokens for 2.05 steps: it does not; after the 3 rounds of warm-up decoding is plain but for trials
    gate = DraftGate(explore=5, max_explore=5, give_up=99)
    picks = drive(gate, 40, lambda i: 1.8)
    assert picks[:3] == ["draft"] * 3 and picks[3:].count("plain") > 20 and "draft" in picks[10:]
    assert 0.85 < gate.value() < 0.9


def test_draft_gate_backs_off_from_a_draft_that_keeps_losing():
    from jllm.spec.decode import DraftGate

    picks = drive(DraftGate(explore=12, max_explore=96, trial_rounds=2), 400, lambda i: 1)
    trials = [i for i, a in enumerate(picks) if a == "draft"][3:]      # after the three rounds of warm-up
    assert len(trials) == 6, trials                        # 3 trials of 2 rounds, then it gives up
    starts = trials[::2]
    assert [b - a for a, b in zip(starts, starts[1:])] == [1 + 24, 1 + 48]   # doubling, from a trial's end
    # a draft that starts paying again wins its next trial and is kept
    picks = drive(DraftGate(explore=12, give_up=3), 200, lambda i: 1 if i < 30 else 3)
    assert picks[-50:] == ["draft"] * 50


def test_draft_gate_carries_its_estimates_into_the_next_generation():
    from jllm.spec.decode import DraftGate

    gate = DraftGate(explore=12, max_explore=96, give_up=3, trial_rounds=2)
    drive(gate, 400, lambda i: 1)                          # turn 1: the draft always loses, is given up
    assert gate.lost == 3
    gate.new_generation()                                  # turn 2: no free rounds, one more trial
    picks = drive(gate, 100, lambda i: 1)
    assert picks[:11] == ["plain"] * 11 and picks.count("draft") == 2


def test_row_cost_is_fitted_from_the_verify_passes():
    from jllm.spec.costs import RowCost

    rows = RowCost(prior=0.1)
    for _ in range(20):
        rows.add(3, 0.030)                                 # one draft count only: nothing to fit, the prior
    assert rows.fit() is None and rows.value == 0.1
    g = torch.Generator().manual_seed(0)
    for i in range(200):                                   # 20 ms a step and 5 ms a row, 2 % noise
        k = i % 6
        rows.add(k, (0.020 + 0.005 * k) * (1 + 0.02 * torch.randn(1, generator=g).item()))
    assert abs(rows.value - 0.25) < 0.03
    for i in range(200):                                   # memory gets faster, the rows' compute stays
        k = i % 6
        rows.add(k, 0.012 + 0.005 * k)
    assert abs(rows.value - 0.005 / 0.012) < 0.02          # the old rounds have decayed away


def test_draft_gate_runs_side_leaves_only_where_rows_are_cheap():
    from jllm.spec.decode import DraftGate

    def gate_on(row_s, taken):
        gate = DraftGate()
        for i in range(60):
            k = 1 + i % 4
            gate.observe(0.020 + row_s * k, k, 0.005)
            gate.record(1 + 0.6 * k, k, k)
            gate.observe_leaf(i % 4 < 4 * taken)
        return gate

    cheap = gate_on(0.001, 0.25)                           # rows at 0.05 of a step: a leaf taken 1 in 4 pays
    assert abs(cheap.rows.value - 0.05) < 0.01 and cheap.leaf_pays()
    dear = gate_on(0.005, 0.25)                            # at 0.25 of a step (AVX2): it does not
    assert abs(dear.rows.value - 0.25) < 0.01 and not dear.leaf_pays()
    assert gate_on(0.005, 0.75).leaf_pays()                # unless leaves are taken far more often


def test_draft_gate_stops_the_draft_where_one_more_row_costs_too_much():
    from jllm.spec.decode import DraftGate

    def gate_with(verify_steps):
        """A gate that saw verify passes over k = 0..5 drafts take verify_steps[k] steps of 30 ms, and draft
        rounds of 3 forwards (7.5 ms each: d = 0.25) bring 2.6 tokens."""
        gate = DraftGate()
        for i in range(120):
            k = i % 6
            gate.observe(0.030 * verify_steps[k], k, 0.0075)
            gate.record(2.6, 3, 3)
        return gate

    avx2 = gate_with([1.0, 1.05, 1.12, 1.3, 1.9, 2.3])      # a 5th row starts a second pass over the tiles
    assert 0.45 < avx2.verify[4] - avx2.verify[3] < 0.65    # in the gate's unit of a step (its target_step)
    assert avx2.extend_pays(2, 0.6) and avx2.extend_pays(4, 0.2) is False
    assert avx2.extend_pays(4, 0.95) is False                # even a sure token is not worth 0.85 of a step
    assert avx2.extend_pays(3, 0.8) and not avx2.extend_pays(3, 0.4)
    cheap = gate_with([1.0, 1.02, 1.04, 1.06, 1.08, 1.1])    # AVX-512 while memory is slow: rows nearly free
    assert cheap.extend_pays(4, 0.5) and cheap.extend_pays(5, 0.5)
    assert DraftGate().extend_pays(8, 0.01)                  # nothing measured yet: p_min alone decides
    # an n-gram token costs no draft step, only its row
    assert avx2.extend_pays(4, 0.8, free=True) and not avx2.extend_pays(4, 0.5, free=True)


def test_ngram_proposals_are_cut_where_their_rows_do_not_pay():
    from jllm.spec.decode import DraftGate, SpecConfig, SpeculativeDecoder

    class Eng:                       # what the decoder reads of an engine before decoding
        class model:
            stack = None

    gate = DraftGate()
    steps = [1.0, 1.05, 1.12, 1.3, 1.9, 2.3, 2.6, 2.9, 3.2]      # AVX2-like: rows dear from the 4th
    for i in range(180):
        gate.observe(0.030 * steps[i % 9], i % 9)
    dec = SpeculativeDecoder(Eng(), None, SpecConfig(mode="ngram"), gate=gate)
    proposal = list(range(8))
    dec.ngram_rounds = [90, 10]      # copying, 9 in 10 tokens held: even the dear rows pay
    assert dec._ngram_worth(proposal) == proposal
    dec.ngram_rounds = [80, 20]      # 8 in 10: the 4th token (0.8^4 = 0.41) is not worth its ~0.55 step
    assert dec._ngram_worth(proposal) == [0, 1, 2]
    dec.ngram_rounds = [10, 30]      # the copies keep breaking: one token
    assert dec._ngram_worth(proposal) == [0]
    dec.cfg.cost_stop = False
    assert dec._ngram_worth(proposal) == proposal


def test_engine_keeps_one_gate_across_turns(paths):
    eng = engine(paths["target"], paths["other"], mode="draft", p_min=0.0, precision="native")
    eng.generate(PROMPT, SamplingParams(max_tokens=8))
    gate = eng.spec_gate
    assert gate is not None and gate.value() is not None
    eng.generate(PROMPT + " again", SamplingParams(max_tokens=8))
    assert eng.spec_gate is gate


def test_an_always_wrong_draft_keeps_the_output(paths):
    """The worst case `jllm bench --spec --wrong-draft` measures: every proposal wrong, output unchanged.
    (Whether the gate then stops drafting depends on measured times, sub-millisecond on this tiny model; the
    gate's policy is tested with given costs above.)"""
    from jllm.spec.bench import make_draft_wrong

    plain = engine(paths["target"], precision="native")
    p = SamplingParams(max_tokens=40)
    ref = plain.generate(PROMPT, p)
    spec = engine(paths["target"], paths["target"], mode="draft", p_min=0.0, precision="native",
                  draft_precision="native")
    make_draft_wrong(spec)
    out = spec.generate(PROMPT, p)
    assert out.token_ids == ref.token_ids
    st = spec.spec_stats.as_dict()
    assert st["drafted"] > 0 and st["accepted"] == 0
    # p_min 0 lets the draft go the full 8 while confident; after a round with nothing accepted it gets 2
    assert st["drafted"] <= 8 + 2 * (st["rounds"] - 1), st


def test_a_side_leaf_computes_what_a_decode_step_of_it_would(paths):
    """The native stack's side leaf: the chain's rows are bitwise those of the pass without it, and the leaf's
    logits and key/value those of decoding the leaf right after the tokens before its position."""
    eng = engine(paths["target"], precision="native")
    model = eng.model
    assert model.stack is not None
    prefix = eng.encode(PROMPT)
    chain, alt, j = [5, 17, 42, 99], 61, 2             # the leaf is an alternative to chain[j]

    def cache_after(ids):
        cache = model.new_cache(64)
        model.forward(torch.tensor(ids), cache)
        return cache

    tree = cache_after(prefix)
    start = tree.length
    out = model.forward(torch.tensor(chain + [alt]), tree, leaf=start + j)
    plain = cache_after(prefix)
    assert torch.equal(out[:-1], model.forward(torch.tensor(chain), plain))
    step = cache_after(prefix + chain[:j])
    assert torch.equal(out[-1], model.forward(torch.tensor([alt]), step)[0])
    # moved to its position, the leaf's key and value are the decode step's
    tree.move(start + len(chain), start + j)
    n = start + j + 1
    assert torch.equal(tree.k[:, :, :n], step.k[:, :, :n]) and torch.equal(tree.v[:, :, :n], step.v[:, :, :n])
    with pytest.raises(RuntimeError, match="leaf"):
        model.forward(torch.tensor(chain + [alt]), tree, leaf=start - 1)


def test_side_leaves_keep_the_output_and_are_taken(paths, monkeypatch):
    """Rounds whose chain breaks exactly where the leaf is: the leaf is taken, one more token a round, and
    the output and the cache stay those of plain decoding."""
    from jllm.spec.decode import DraftRunner

    plain = engine(paths["target"], precision="native")
    p = SamplingParams(max_tokens=40)
    ref = plain.generate(PROMPT, p)
    spec = engine(paths["target"], paths["other"], mode="draft", p_min=0.0, precision="native", leaf_gate=False)
    n_prompt = len(spec.encode(PROMPT))
    vocab = spec.model.cfg.vocab_size
    target_text = ref.token_ids

    def propose(self, context, k, p_min, params, gen, k_min=1, leaf_p=0.0, extend=None):
        at = len(context) - n_prompt                   # index of the next token in the output
        want = target_text[at:at + 3]
        self.forwards, self.step_s = 1, 1e-3
        if len(want) < 3:
            self.leaf = None
            return want or [0], None
        self.leaf = (1, want[1]) if leaf_p > 0 else None
        return [want[0], (want[1] + 1) % vocab, want[2]], None      # wrong at index 1: the leaf is right

    monkeypatch.setattr(DraftRunner, "propose", propose)
    out = spec.generate(PROMPT, p)
    assert out.token_ids == ref.token_ids
    st = spec.spec_stats.as_dict()
    assert st["leaves"] > 0 and st["leaves_taken"] == st["leaves"]
    assert spec.cached_ids == plain.cached_ids
    n = plain.cache.length
    assert torch.equal(spec.cache.k[:, :, :n], plain.cache.k[:, :, :n])
    # the same rounds without leaves: one token fewer a round
    off = engine(paths["target"], paths["other"], mode="draft", p_min=0.0, precision="native", leaf_p=0.0)
    assert off.generate(PROMPT, p).token_ids == ref.token_ids
    st_off = off.spec_stats.as_dict()
    assert st_off["leaves"] == 0 and st_off["tokens_per_verify"] < st["tokens_per_verify"]


def test_side_leaves_with_a_real_draft_keep_the_output(paths):
    plain = engine(paths["target"], precision="native")
    p = SamplingParams(max_tokens=40)
    ref = plain.generate(PROMPT, p)
    spec = engine(paths["target"], paths["other"], mode="draft", p_min=0.0, precision="native", leaf_p=1.01,
                  leaf_gate=False)
    assert spec.generate(PROMPT, p).token_ids == ref.token_ids
    assert spec.spec_stats.as_dict()["leaves"] > 0
    assert spec.cached_ids == plain.cached_ids
