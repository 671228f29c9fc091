"""Speculative decoding end to end in the engine, on tiny synthetic models: greedy output identical to plain
decoding over 64 tokens for every proposer (a good draft, a bad draft, n-gram), caches rolled back exactly,
sampled output distributed as the target's (chi-square against the exact joint distribution), side leaves
on the native stack, and the tokenizer gate. The loop itself is tested with fake proposers in test_loop.py,
the policy in test_policy.py."""


import pytest
import torch

from jllm.engine import Engine
from jllm.errors import JllmError
from jllm.sampling import SamplingParams
from jllm.spec.config import SpecConfig
from jllm.spec.policy import DraftGate
from jllm.spec.proposers import DraftModelProposer, Proposal
import two_token_chi2
from synthetic import write_tiny_model

pytestmark = pytest.mark.usefixtures("native_kernels")      # built before the first model runs

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


@pytest.fixture
def no_end_of_turn(monkeypatch):
    """The tiny random models soon write an end-of-turn token; without one, outputs run the whole budget."""
    from jllm.tokenizer.tokenizer import Tokenizer

    monkeypatch.setattr(Tokenizer, "eot_ids", property(lambda self: frozenset()))


def engine(path, draft=None, mode="none", precision="int8", **kw):
    return Engine(path, ctx_size=256, threads=1, draft_path=draft, precision=precision,
                  spec=SpecConfig(mode=mode, **kw))


@pytest.mark.parametrize("draft_name,mode,precision", [
    (None, "ngram", "int8"), ("target", "draft", "int8"), ("target", "draft", "native"),
    ("other", "draft", "int8"), ("other", "draft", "native"), ("other", "draft+ngram", "int8"),
    ("other", "draft+ngram", "native")])
def test_greedy_output_identical_to_plain(paths, draft_name, mode, precision, no_end_of_turn):
    plain = engine(paths["target"], precision=precision)
    p = SamplingParams(max_tokens=64)
    # n-gram alone: a prompt that repeats itself, so its lookup drafts whatever the tiny model then writes
    prompt = PROMPT + " " + PROMPT if draft_name is None else PROMPT
    ref = plain.generate(prompt, p)
    # p_min 0: the tiny random models are never confident, and a self-draft should draft whole blocks
    # a self-draft computes exactly as the target (not at the lighter default draft precision)
    same = {"draft_precision": precision} if draft_name == "target" else {}
    spec = engine(paths["target"], paths[draft_name] if draft_name else None, mode=mode, p_min=0.0,
                  precision=precision, **same)
    out = spec.generate(prompt, p)
    assert len(out.token_ids) == 64 and out.token_ids == ref.token_ids
    st = out.spec_stats.as_dict()
    assert st["rounds"] > 0
    if draft_name == "target":                 # the draft is the target itself: everything is accepted
        assert st["acceptance_rate"] == 1.0 and st["tokens_per_verify"] > 2
    # the cache ends exactly where plain decoding's does
    assert spec.target.ids == plain.target.ids
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
    eng.reset()
    out = eng.generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=3))
    assert len(out.token_ids) == 20


def test_always_wrong_ngram_proposals_are_still_exact(paths, monkeypatch, no_end_of_turn):
    eng = engine(paths["target"], mode="ngram", draft_max=4)
    ref = engine(paths["target"]).generate(PROMPT, SamplingParams(max_tokens=64)).token_ids
    vocab = eng.model.cfg.vocab_size

    def wrong(self, context, k, limits=None):
        return Proposal([(context[-1] + 7 + i) % vocab for i in range(k)], kind="ngram", match=4)

    from jllm.spec.proposers import NgramProposer

    monkeypatch.setattr(NgramProposer, "propose", wrong)
    out = eng.generate(PROMPT, SamplingParams(max_tokens=64))
    assert len(out.token_ids) == 64 and out.token_ids == ref
    assert 0 < out.spec_stats.drafted and out.spec_stats.accepted < out.spec_stats.drafted


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
    assert out.spec_stats.accepted > 0


def test_sampled_distribution_matches_target(paths):
    """Speculative sampling with a different draft model follows the target's distribution (chi-square)."""
    target = engine(paths["target"])
    ids = target.encode(PROMPT)
    exact = two_token_chi2.exact_joint(target, ids)
    spec = engine(paths["target"], paths["other"], mode="draft", draft_max=1, p_min=0.0)
    assert two_token_chi2.check(spec, ids, exact) == 1500          # every run verified one drafted token


def test_tokenizer_gate_refuses_cross_family_draft(paths):
    with pytest.raises(JllmError, match="tokenizers differ"):
        engine(paths["target"], paths["llama"], mode="draft")


def test_engine_keeps_one_gate_across_turns(paths):
    eng = engine(paths["target"], paths["other"], mode="draft", p_min=0.0, precision="native")
    eng.generate(PROMPT, SamplingParams(max_tokens=8))
    gate = eng.gate
    assert gate is not None and gate.value() is not None
    eng.generate(PROMPT + " again", SamplingParams(max_tokens=8))
    assert eng.gate is gate
    eng.reset()
    assert eng.gate is None and eng.target.ids == [] and eng.draft.ids == []


def test_an_always_wrong_draft_keeps_the_output(paths, no_end_of_turn):
    """The worst case `jllm bench --spec --wrong-draft` measures: every proposal wrong, output unchanged.
    (Whether the gate then stops drafting depends on measured times, sub-millisecond on this tiny model; the
    gate's policy is tested with given costs above.)"""
    from jllm.spec.bench import make_draft_wrong

    plain = engine(paths["target"], precision="native")
    p = SamplingParams(max_tokens=64)
    ref = plain.generate(PROMPT, p)
    spec = engine(paths["target"], paths["target"], mode="draft", p_min=0.0, precision="native",
                  draft_precision="native")
    make_draft_wrong(spec)
    out = spec.generate(PROMPT, p)
    assert len(out.token_ids) == 64 and out.token_ids == ref.token_ids
    st = out.spec_stats.as_dict()
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

    held = cache_after(prefix)
    start = held.length
    out = model.forward(torch.tensor(chain + [alt]), held, tree=[j - 1])    # its parent: chain[j - 1]
    plain = cache_after(prefix)
    assert torch.equal(out[:-1], model.forward(torch.tensor(chain), plain))
    step = cache_after(prefix + chain[:j])
    assert torch.equal(out[-1], model.forward(torch.tensor([alt]), step)[0])
    # moved to its position, the leaf's key and value are the decode step's
    held.move(start + len(chain), start + j)
    n = start + j + 1
    assert torch.equal(held.k[:, :, :n], step.k[:, :, :n]) and torch.equal(held.v[:, :, :n], step.v[:, :, :n])
    with pytest.raises(RuntimeError, match="parent"):
        model.forward(torch.tensor(chain + [alt]), held, tree=[-2])


def test_a_tree_computes_what_decode_steps_along_its_paths_would(paths):
    """The native stack's tree rows: the chain's rows are bitwise those of the pass without them, each tree
    row's logits those of a decode step at the end of its path, and an accepted path kept by Sequence.keep
    leaves the cache bitwise as decoding that path would."""
    from jllm.sequence import Sequence

    eng = engine(paths["target"], precision="native")
    model = eng.model
    prefix = eng.encode(PROMPT)
    chain = [5, 17, 42, 99]                             # rows 0-3
    extra = [61, 33, 7, 8, 12]                          # rows 4-8
    parents = [1, 4, 0, 2, 5]                           # 61 after 17, 33 after 61, 7 after 5, 8 after 42, 12 after 33
    block = chain + extra

    def path(r):
        out = []
        while r >= 0:
            out.append(block[r])
            r = r - 1 if r < len(chain) else parents[r - len(chain)]
        return out[::-1]

    def cache_after(ids):
        cache = model.new_cache(64)
        model.forward(torch.tensor(ids), cache)
        return cache

    seq = Sequence(model, 64)
    seq.sync(prefix + [3])
    start = len(seq)
    out = seq.forward(block, tree=parents)
    assert torch.equal(out[:len(chain)], model.forward(torch.tensor(chain), cache_after(prefix + [3])))
    for r in range(len(chain), len(block)):
        p = path(r)
        step = cache_after(prefix + [3] + p[:-1])
        assert torch.equal(out[r], model.forward(torch.tensor(p[-1:]), step)[0]), r
    # keep the path 5 17 61 33 12 (rows 0 1 4 5 8): the cache is that of decoding it
    seq.keep(start, [5, 17, 61, 33, 12], rows=[0, 1, 4, 5, 8])
    ref = cache_after(prefix + [3, 5, 17, 61, 33, 12])
    n = ref.length
    assert seq.ids == prefix + [3, 5, 17, 61, 33, 12] and seq.cache.length == n
    assert torch.equal(seq.cache.k[:, :, :n], ref.k[:, :, :n]) and torch.equal(seq.cache.v[:, :, :n], ref.v[:, :, :n])
    with pytest.raises(ValueError, match="rows"):
        seq.keep(start, [5, 17], rows=[1, 0])
    for bad in ([0, 4, 0, 2, 9], [-1, 4, 0, 2, 5]):      # a parent after its row; none
        with pytest.raises(RuntimeError, match="parent"):
            model.forward(torch.tensor(block), cache_after(prefix), tree=bad)


def test_trees_keep_the_output_and_their_branches_are_taken(paths, monkeypatch, no_end_of_turn):
    """Rounds whose first chain is wrong from its first token while a branch holds the target's next three:
    the branch is taken, and the output and the cache stay those of plain decoding."""
    plain = engine(paths["target"], precision="native")
    p = SamplingParams(max_tokens=64)
    ref = plain.generate(PROMPT, p)
    spec = engine(paths["target"], paths["other"], mode="draft", p_min=0.0, precision="native")
    n_prompt = len(spec.encode(PROMPT))
    vocab = spec.model.cfg.vocab_size
    target_text = ref.token_ids

    def propose(self, context, k, limits):
        at = len(context) - n_prompt
        want = target_text[at:at + 3]
        if len(want) < 3 or k < 3:                     # the budget's end: a chain within it
            return Proposal(want[:k] or [0], kind="draft", forwards=1, step_s=1e-3)
        wrong = (want[0] + 1) % vocab
        # rows: 1 wrong, 2 its child; 3-5 the right branch from the root; 6 a sibling of the right second
        return Proposal([wrong, want[1], want[0], want[1], want[2], (want[1] + 7) % vocab], kind="draft",
                        tree=[0, 1, 0, 3, 4, 3], forwards=1, step_s=1e-3)

    monkeypatch.setattr(DraftModelProposer, "propose", propose)
    monkeypatch.setattr(DraftGate, "choose", lambda self: "draft")
    out = spec.generate(PROMPT, p)
    assert len(out.token_ids) == 64 and out.token_ids == ref.token_ids
    st = out.spec_stats.as_dict()
    assert st["tree_rounds"] > 0 and st["off_chain"] == 3 * st["tree_rounds"]       # every branch taken, whole
    assert spec.target.ids == plain.target.ids
    n = plain.cache.length
    assert torch.equal(spec.cache.k[:, :, :n], plain.cache.k[:, :, :n])
    assert torch.equal(spec.cache.v[:, :, :n], plain.cache.v[:, :, :n])


def test_side_leaves_keep_the_output_and_are_taken(paths, monkeypatch, no_end_of_turn):
    """Rounds whose chain breaks exactly where the leaf is: the leaf is taken, one more token a round, and
    the output and the cache stay those of plain decoding (the native stack computes the leaf's row)."""
    plain = engine(paths["target"], precision="native")
    p = SamplingParams(max_tokens=64)
    ref = plain.generate(PROMPT, p)
    spec = engine(paths["target"], paths["other"], mode="draft", p_min=0.0, precision="native", leaf_gate=False)
    n_prompt = len(spec.encode(PROMPT))
    vocab = spec.model.cfg.vocab_size
    target_text = ref.token_ids

    def propose(self, context, k, limits):
        at = len(context) - n_prompt                   # index of the next token in the output
        want = target_text[at:at + 3]
        if len(want) < 3:
            return Proposal(want or [0], kind="draft", forwards=1, step_s=1e-3)
        leaf = (1, want[1]) if limits.leaf_p > 0 else None
        return Proposal([want[0], (want[1] + 1) % vocab, want[2]], kind="draft", leaf=leaf, forwards=1,
                        step_s=1e-3)                   # wrong at index 1: the leaf is right

    monkeypatch.setattr(DraftModelProposer, "propose", propose)
    # every round drafts: the gate's measured costs (a slow host's noise) must not turn rounds plain here,
    # where the comparison below is of leaves against none, round for round
    monkeypatch.setattr(DraftGate, "choose", lambda self: "draft")
    out = spec.generate(PROMPT, p)
    assert len(out.token_ids) == 64 and out.token_ids == ref.token_ids
    st = out.spec_stats.as_dict()
    assert st["leaves"] > 0 and st["leaves_taken"] == st["leaves"]
    assert spec.target.ids == plain.target.ids
    n = plain.cache.length
    assert torch.equal(spec.cache.k[:, :, :n], plain.cache.k[:, :, :n])
    # the same rounds without leaves: one token fewer a round
    off = engine(paths["target"], paths["other"], mode="draft", p_min=0.0, precision="native", leaf_p=0.0)
    res_off = off.generate(PROMPT, p)
    assert res_off.token_ids == ref.token_ids
    st_off = res_off.spec_stats.as_dict()
    assert st_off["leaves"] == 0 and st_off["tokens_per_verify"] < st["tokens_per_verify"]


def test_side_leaves_with_a_real_draft_keep_the_output(paths, no_end_of_turn):
    plain = engine(paths["target"], precision="native")
    p = SamplingParams(max_tokens=64)
    ref = plain.generate(PROMPT, p)
    spec = engine(paths["target"], paths["other"], mode="draft", p_min=0.0, precision="native", leaf_p=1.01,
                  leaf_gate=False)
    out = spec.generate(PROMPT, p)
    assert len(out.token_ids) == 64 and out.token_ids == ref.token_ids
    assert out.spec_stats.as_dict()["leaves"] > 0
    assert spec.target.ids == plain.target.ids


def test_the_corpus_bench_runs_greedy_or_sampled(paths, no_end_of_turn, capsys):
    """`jllm bench --spec` on two corpus prompts: greedy, speculation's output is the plain run's; with --temp,
    both runs sample from one seed, the table drops the identical column and the result records how."""
    from jllm.spec.bench import print_summary, run_corpus

    eng = Engine(paths["target"], ctx_size=2048, threads=1, draft_path=paths["target"], precision="native",
                 spec=SpecConfig(mode="draft", p_min=0.0, draft_precision="native"))   # the corpus's prompts
    greedy = run_corpus(eng, eng.spec, limit=2, log=lambda s: None, params=SamplingParams(max_tokens=24))
    g = greedy["categories"]["ALL"]
    assert g["prompts"] == 2 and g["identical"] == 2 and g["alpha"] > 0.9    # the draft is the target
    print_summary(greedy)
    assert "identical" in capsys.readouterr().out
    sampled = run_corpus(eng, eng.spec, limit=2, log=lambda s: None,
                         params=SamplingParams(temperature=0.8, seed=5, max_tokens=24))
    s = sampled["categories"]["ALL"]
    assert sampled["sampling"]["temperature"] == 0.8 and sampled["sampling"]["seed"] == 5
    assert all(r["spec_tokens"] == 24 and r["tokens"] == 24 for r in sampled["prompts"])
    assert s["alpha"] > 0.9 and s["spec_tok_s"] > 0          # the same model's q and p: (nearly) all accepted
    print_summary(sampled)
    out = capsys.readouterr().out
    assert "identical" not in out and "speedup" in out
