"""The EAGLE-3 head as a proposer (spec/proposers.py HeadProposer) in the engine: `-md HEAD.gguf` loads it,
greedy output stays plain decoding's over 64 tokens, the head's catch-up pairs each target state with the
token after it exactly as a head prefilled from scratch, and the persistent KV store keeps the head's state."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from jllm.engine import Engine
from jllm.errors import JllmError
from jllm.sampling import SamplingParams
from jllm.spec.config import SpecConfig
import two_token_chi2
from synthetic import write_tiny_model
from test_eagle3 import write_head

pytestmark = pytest.mark.usefixtures("native_kernels")      # built before the first model runs

PROMPT = "the cat sat on the mat and the cat sat on the"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("headprop")
    ref = write_tiny_model(d / "target.gguf", "qwen2", Q.Q8_0)
    write_head(d / "head.gguf", ref, qtype=Q.Q8_0)
    other = write_tiny_model(d / "other.gguf", "llama", Q.Q8_0)
    write_head(d / "wrong.gguf", other, qtype=Q.Q8_0)          # a head made for another target
    return {k: str(d / f"{k}.gguf") for k in ("target", "head", "wrong")}


@pytest.fixture(autouse=True)
def _dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "converted"))
    from jllm.tokenizer.tokenizer import Tokenizer

    monkeypatch.setattr(Tokenizer, "eot_ids", property(lambda self: frozenset()))   # run the whole budget


def engine(path, head=None, mode="draft", **kw):
    return Engine(path, ctx_size=256, threads=1, draft_path=head, precision="native",
                  spec=SpecConfig(mode=mode, p_min=0.0, cost_stop=False), **kw)


def test_head_proposes_and_the_output_is_plain_decodings(files):
    p = SamplingParams(max_tokens=64)
    ref = engine(files["target"], mode="none").generate(PROMPT, p)
    eng = engine(files["target"], files["head"])
    assert eng.head is not None and eng.draft is None
    out = eng.generate(PROMPT, p)
    assert len(out.token_ids) == 64 and out.token_ids == ref.token_ids
    st = out.spec_stats.as_dict()
    assert st["by_proposer"]["head"]["drafted"] > 0
    # sampled generations run through the head's distributions and stay reproducible
    s = SamplingParams(max_tokens=32, temperature=1.0, seed=5)
    eng.reset()
    a = eng.generate(PROMPT, s).token_ids
    eng.reset()
    assert eng.generate(PROMPT, s).token_ids == a and len(a) == 32


def test_a_one_token_prompt_drafts_from_the_second_token_on(files):
    """A prompt of one token gives the head no (state, next token) pair to prepare: the first round drafts
    nothing, the later ones do: greedy output is plain decoding's, sampled output comes whole and repeats."""
    one = engine(files["target"], mode="none").encode(PROMPT)[:1]
    p = SamplingParams(max_tokens=24)
    ref = engine(files["target"], mode="none").generate(one, p)
    out = engine(files["target"], files["head"]).generate(one, p)
    assert out.token_ids == ref.token_ids and len(out.token_ids) == 24
    assert out.spec_stats.as_dict()["by_proposer"]["head"]["drafted"] > 0
    s = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    a, b = (engine(files["target"], files["head"]).generate(one, s) for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24


def test_a_sampled_generation_repeats_for_its_seed_whatever_the_clock(files, monkeypatch):
    """The default policy (p_min, the cost stop, the gate) with the clock made erratic, as a loaded machine's
    is: a sampled generation must still repeat for its seed, since how far a round drafts decides how many
    random numbers it draws (the policy of a sampled generation runs on fixed costs); greedy stays plain's."""
    import random
    import time

    def erratic(seed):
        rng, now = random.Random(seed), [0.0]

        def clock():
            now[0] += rng.choice((1e-4, 3e-3, 4e-2))
            return now[0]
        return clock

    eng = Engine(files["target"], ctx_size=256, threads=1, draft_path=files["head"], precision="native",
                 spec=SpecConfig(mode="draft"))
    s = SamplingParams(max_tokens=48, temperature=1.0, seed=11)
    runs = []
    for seed in range(4):
        monkeypatch.setattr(time, "perf_counter", erratic(seed))
        eng.reset()
        runs.append(eng.generate(PROMPT, s).token_ids)
    monkeypatch.undo()
    assert all(r == runs[0] for r in runs) and len(runs[0]) == 48


def test_a_round_stopped_inside_undoes_itself(files, monkeypatch):
    """Ctrl-C between a tree round's verify pass and keep(): the sequence goes back to where the round began
    (its tree rows are not where their tokens are), so a next generation that reuses the prefix reads only
    rows that match their tokens: greedy output stays plain decoding's."""
    from jllm.spec import loop

    p = SamplingParams(max_tokens=40)
    ref = engine(files["target"], mode="none").generate(PROMPT, p)
    eng = Engine(files["target"], ctx_size=256, threads=1, draft_path=files["head"], precision="native",
                 spec=SpecConfig(mode="draft", p_min=0.0, cost_stop=False, tree_width=3, tree_branches=2,
                                 tree_nodes=6))
    real, seen = loop.verify_tree, []

    def verify_then_stop(*args):
        seen.append(len(eng.target))              # the sequence after the pass: the block's tokens added
        if len(seen) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(loop, "verify_tree", verify_then_stop)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(PROMPT, p)
    monkeypatch.undo()
    block = seen[2]
    assert len(eng.target) < block and len(eng.target.ids) == eng.target.cache.length
    assert eng.generate(PROMPT, p).token_ids == ref.token_ids


def test_a_head_given_as_the_model_says_where_it_goes(files):
    with pytest.raises(JllmError, match=r"is an EAGLE-3 draft head, not a model: give it with -md"):
        engine(files["head"], mode="none")


def test_catch_up_pairs_states_with_the_next_token(files):
    eng = engine(files["target"], files["head"])
    eng.generate(PROMPT, SamplingParams(max_tokens=20))
    prop, head = eng.draft_proposer, eng.head
    context = eng.target.ids + [7]
    got = prop.catch_up(context)
    assert head.length == len(context) - 1 and prop.paired == context[1:]
    # a head prefilled from scratch over the target's states of the whole context
    _, hidden = eng.model.forward(torch.tensor(context[:-1]), eng.model.new_cache(256),
                                  capture=head.target_layers)
    head.truncate(0)
    want = head.prefill(hidden.bfloat16(), context[1:])       # the states as the Sequence keeps them
    assert torch.equal(got.logits, want.logits) and torch.equal(got.state, want.state)


def test_the_store_keeps_the_heads_state(files, tmp_path):
    kv = str(tmp_path / "kv")
    p = SamplingParams(max_tokens=24)
    first = engine(files["target"], files["head"], kv_store_dir=kv)
    turn1 = first.generate(PROMPT, p, conv_id="c")
    first.wait_saves()
    ids = first.encode(PROMPT) + turn1.token_ids + first.encode(" and then")
    again = engine(files["target"], files["head"], kv_store_dir=kv)
    res = again.generate(ids, p, conv_id="c")
    assert res.timings.cached_tokens > 0
    n = res.timings.cached_tokens
    assert again.draft_proposer.paired[:n] == ids[1:n + 1]      # the head's stored positions came back
    assert res.spec_stats.as_dict()["by_proposer"]["head"]["drafted"] > 0
    plain = engine(files["target"], mode="none").generate(ids, p)
    assert res.token_ids == plain.token_ids


def test_a_head_for_another_target_is_refused_in_one_line(files):
    with pytest.raises(JllmError, match="was not made for") as e:
        engine(files["target"], files["wrong"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_sampled_with_the_head_follows_the_targets_distribution(files, tau):
    """Speculative sampling with the head drafting follows the target's distribution (chi-square), also with
    the head's drafts drawn at a lower temperature than the target's (head_tau)."""
    target = engine(files["target"], mode="none")
    ids = target.encode(PROMPT)
    exact = two_token_chi2.exact_joint(target, ids)
    spec = Engine(files["target"], ctx_size=256, threads=1, draft_path=files["head"], precision="native",
                  spec=SpecConfig(mode="draft", draft_max=1, p_min=0.0, head_tau=tau))
    assert two_token_chi2.check(spec, ids, exact) == 1500          # the head drafted the second token each time


def test_the_heads_draft_temperature_factor_reaches_its_drafts(files, monkeypatch):
    """head_tau scales the temperature the head's sampled drafts are drawn at (q is the softmax of its logits
    over tau T), for the head only: the draft model's chooser sees 1."""
    from jllm.sampling import SamplingParams, probs
    from jllm.spec.proposers import Chooser

    seen = []
    real = Chooser.__call__
    monkeypatch.setattr(Chooser, "__call__", lambda self, *a, **k: seen.append(a[4] if len(a) > 4 else 1.0)
                        or real(self, *a, **k))
    spec = Engine(files["target"], ctx_size=256, threads=1, draft_path=files["head"], precision="native",
                  spec=SpecConfig(mode="draft", p_min=0.0, head_tau=0.6))
    spec.generate(PROMPT, SamplingParams(temperature=0.9, seed=3, max_tokens=12))
    assert seen and set(seen) == {0.6}
    logits = torch.randn(40, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.9, top_p=0.95)
    _, p, q = Chooser()(logits, params, torch.Generator().manual_seed(0), [], 0.6)
    assert torch.allclose(q, probs(logits / 0.6, params, []), atol=1e-6)
    _, _, q1 = Chooser()(logits, params, torch.Generator().manual_seed(0), [])
    assert torch.allclose(q1, probs(logits, params, []), atol=1e-6) and q.max() > q1.max()


def test_plan_budgets_the_head(files):
    from jllm.plan import plan

    rows = plan(files["target"], files["head"], 4096, "native")
    assert [r.name for r in rows] == ["target.gguf", "head.gguf"]
    head = rows[1]
    assert head.kv == 2 * 2 * 16 * 4096 * 2                      # one layer, 2 kv heads of 16, f16
    assert head.scratch >= 4096 * 3 * 64 * 2                     # the target's captured states, bf16
    assert 0 < head.weights < rows[0].weights


def test_an_always_wrong_head_keeps_the_output(files):
    from jllm.spec.bench import make_draft_wrong

    p = SamplingParams(max_tokens=64)
    ref = engine(files["target"], mode="none").generate(PROMPT, p)
    eng = engine(files["target"], files["head"])
    make_draft_wrong(eng)
    out = eng.generate(PROMPT, p)
    assert out.token_ids == ref.token_ids
    st = out.spec_stats.as_dict()
    assert st["drafted"] > 0 and st["accepted"] == 0


def test_a_head_drafting_trees_keeps_the_output(files):
    """tree_width 3: the head drafts trees (several branches a depth in one batched step); the output is plain
    decoding's, and the target's captured states, which tree rows computed and keep() moved, are those of a
    prefill of the same tokens (the head's next catch-up reads them)."""
    p = SamplingParams(max_tokens=64)
    ref = engine(files["target"], mode="none").generate(PROMPT, p)
    eng = Engine(files["target"], ctx_size=256, threads=1, draft_path=files["head"], precision="native",
                 spec=SpecConfig(mode="draft", p_min=0.0, cost_stop=False, tree_width=3, tree_branches=2,
                                 tree_nodes=6))
    out = eng.generate(PROMPT, p)
    assert out.token_ids == ref.token_ids
    st = out.spec_stats.as_dict()
    assert st["tree_rounds"] > 0 and st["drafted"] > 2 * st["rounds"]
    ids = list(eng.target.ids)
    fresh = Engine(files["target"], ctx_size=256, threads=1, draft_path=files["head"], precision="native",
                   spec=SpecConfig(mode="draft"))
    fresh.target.sync(ids + [0])
    n = len(ids)
    assert torch.equal(eng.target.features[:n], fresh.target.features[:n])


def test_tree_steps_are_the_chains_steps(files):
    """Eagle3Head.tree_step over two branches (7 then 9, 11 then 13) gives each row the logits and state of
    step() along its own path: at depth 2 each row sees its own ancestor, not the other branch's."""
    eng = engine(files["target"], files["head"])
    head = eng.head
    ids = eng.encode(PROMPT)
    eng.target.sync(ids)
    head.truncate(0)
    first = head.prefill(eng.target.features[:len(ids) - 1], ids[1:])
    base = head.length
    chains = []
    for t1, t2 in ((7, 9), (11, 13)):
        a = head.step(t1, first.state)
        chains.append((a, head.step(t2, a.state)))
        head.truncate(base)
    la, sa, own = head.tree_step([7, 11], torch.stack([first.state, first.state]), [[], []])
    lb, sb, _ = head.tree_step([9, 13], sa, [[own[0]], [own[1]]])
    assert head.length == base
    for r, (a, b) in enumerate(chains):
        assert torch.allclose(la[r], a.logits, atol=1e-4) and torch.allclose(sa[r], a.state, atol=1e-4)
        assert torch.allclose(lb[r], b.logits, atol=1e-4) and torch.allclose(sb[r], b.state, atol=1e-4)
    assert not torch.allclose(lb[0], lb[1], atol=1e-3)          # the branches differ


def test_the_heads_sampled_draft_is_drawn_over_its_own_vocabulary():
    """A head with a draft vocabulary (d2t) samples over those ids alone and returns q over the target's ids:
    the same distribution as the softmax over the target's vocabulary with -inf elsewhere (filters included),
    the drawn ids follow it, and a repeat penalty (which reads the target's ids) takes that full path."""
    from jllm.sampling import SamplingParams, make_generator
    from jllm.spec.proposers import Chooser

    V, ids = 50, [1, 4, 7, 9, 20, 21, 33, 40, 41, 49]
    logits = torch.randn(len(ids), generator=torch.Generator().manual_seed(0)) * 2

    def to_target(lg):
        out = torch.full((V,), float("-inf"))
        out[ids] = lg
        return out

    fast, full = Chooser(None, ids, to_target, V), Chooser(None, ids, to_target)
    for params in (SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.3, top_k=4),
                   SamplingParams(temperature=1.0, repeat_penalty=1.3)):
        gen = make_generator(1)
        tok, p, q = fast(logits, params, gen, [4, 20])
        _, _, want = full(logits, params, make_generator(1), [4, 20])
        assert q.shape == (V,) and torch.allclose(q, want, atol=1e-6) and tok in ids and p == q[tok].item()
        counts = torch.zeros(V)
        for _ in range(4000):
            counts[fast(logits, params, gen, [4, 20])[0]] += 1
        support = want > 0
        assert counts[~support].sum() == 0
        expected = want[support] * 4000
        stat = ((counts[support] - expected) ** 2 / expected).sum().item()
        critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}
        assert stat < critical[int(support.sum()) - 1], stat             # chi-square at p = 0.001
