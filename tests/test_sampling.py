"""The sampler's pure functions (jllm/sampling.py), on hand-made logits; no model."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from jllm.errors import JllmError
from jllm.sampling import SamplingParams, apply_repeat_penalty, argmax, make_generator, probs, sample

pytestmark = pytest.mark.usefixtures("native_kernels")      # argmax runs the native kernel where it is built

# probabilities 1/2, 1/4, 1/8, 1/8: every partial sum is exact in float32, so top-p edges are sharp
DYADIC = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))


def kept(pr: torch.Tensor) -> set[int]:
    return set(torch.nonzero(pr).flatten().tolist())


def random_logits(n: int = 32, seed: int = 0) -> torch.Tensor:
    return 3.0 * torch.randn(n, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------- greedy


def test_greedy_is_argmax():
    gen = make_generator(0)
    for seed in range(5):
        logits = random_logits(seed=seed)
        assert sample(logits, SamplingParams(), [], gen) == int(torch.argmax(logits))


@pytest.mark.parametrize("V", [1, 15, 16, 17, 151936])
def test_argmax_follows_torch_on_ties_nan_and_infinities(V):
    """argmax (the native kernel where it is built) picks what torch.argmax picks: the first index among
    equal largest values, a NaN over everything, index 0 when every value is -inf; row by row."""
    g = torch.Generator().manual_seed(V)
    rows = [torch.randn(V, generator=g)]
    if V > 2:
        tie = torch.randn(V, generator=g)
        tie[V - 1] = tie[V // 2] = tie.max() + 1               # the lower index wins
        nan = torch.randn(V, generator=g)
        nan[V // 2] = nan[V - 1] = float("nan")
        inf = torch.randn(V, generator=g)
        inf[V - 2] = float("inf")
        rows += [tie, nan, inf]
    rows.append(torch.full((V,), float("-inf")))
    x = torch.stack(rows)
    assert argmax(x) == torch.argmax(x, -1).tolist()
    assert [argmax(r)[0] for r in rows] == [int(torch.argmax(r)) for r in rows]


def test_greedy_probs_is_one_hot_at_argmax():
    logits = random_logits()
    pr = probs(logits, SamplingParams(temperature=0.0))
    assert kept(pr) == {int(torch.argmax(logits))}
    assert pr.sum().item() == 1.0


def test_greedy_applies_repeat_penalty():
    logits = torch.tensor([0.0, 4.0, 3.0])
    p = SamplingParams(repeat_penalty=2.0)
    assert sample(logits, p, [], make_generator(0)) == 1
    assert sample(logits, p, [1], make_generator(0)) == 2       # 4 / 2 < 3


# --------------------------------------------------------------------------------------------- repetition penalty


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0, 3.0, 0.0])
    out = apply_repeat_penalty(logits, [0, 1, 4], penalty=2.0, last_n=64)
    assert out.tolist() == [1.0, -4.0, 1.0, 3.0, 0.0]
    assert logits.tolist() == [2.0, -2.0, 1.0, 3.0, 0.0]        # the input is not modified


def test_repeat_penalty_counts_a_repeated_token_once():
    out = apply_repeat_penalty(torch.tensor([8.0, 1.0]), [0, 0, 0], penalty=2.0, last_n=64)
    assert out.tolist() == [4.0, 1.0]


def test_repeat_penalty_sees_only_the_last_n_tokens():
    logits = torch.tensor([2.0, 2.0, 2.0, 2.0])
    out = apply_repeat_penalty(logits, [0, 1, 2, 3], penalty=2.0, last_n=2)
    assert out.tolist() == [2.0, 2.0, 1.0, 1.0]


def test_repeat_last_n_zero_is_off_and_minus_one_is_everything():
    logits = torch.tensor([2.0, 2.0, 2.0])
    assert apply_repeat_penalty(logits, [0, 1], penalty=2.0, last_n=0).tolist() == [2.0, 2.0, 2.0]
    assert apply_repeat_penalty(logits, [0, 1], penalty=2.0, last_n=-1).tolist() == [1.0, 1.0, 2.0]


def test_repeat_penalty_below_one_favours_repeats():
    out = apply_repeat_penalty(torch.tensor([2.0, -2.0]), [0, 1], penalty=0.5, last_n=64)
    assert out.tolist() == [4.0, -1.0]


def test_probs_uses_the_penalized_logits():
    logits = torch.tensor([1.0, 1.0])
    pr = probs(logits, SamplingParams(temperature=1.0, repeat_penalty=2.0), history=[0])
    expected = torch.softmax(torch.tensor([0.5, 1.0]), dim=-1)
    torch.testing.assert_close(pr, expected)


# --------------------------------------------------------------------------------------------- filters


def test_temperature_alone_is_a_scaled_softmax():
    logits = random_logits()
    for t in (0.3, 1.0, 2.5):
        torch.testing.assert_close(probs(logits, SamplingParams(temperature=t)), torch.softmax(logits / t, dim=-1))


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_keeps_the_k_largest(k):
    logits = random_logits()
    pr = probs(logits, SamplingParams(temperature=1.0, top_k=k))
    assert kept(pr) == set(torch.topk(logits, k).indices.tolist())


def test_top_k_keeps_exactly_k_among_ties():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    pr = probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert len(kept(pr)) == 2 and kept(pr) <= {0, 1, 2, 3}


def test_top_k_at_or_above_vocab_size_is_off():
    logits = random_logits(8)
    full = probs(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(probs(logits, SamplingParams(temperature=1.0, top_k=8)), full)
    torch.testing.assert_close(probs(logits, SamplingParams(temperature=1.0, top_k=100)), full)


@pytest.mark.parametrize("top_p, expected", [
    (0.3, {0}), (0.5, {0}), (0.6, {0, 1}), (0.75, {0, 1}), (0.76, {0, 1, 2}), (0.99, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, expected):
    pr = probs(DYADIC, SamplingParams(temperature=1.0, top_p=top_p))
    assert kept(pr) == expected
    base = torch.softmax(DYADIC, dim=-1)
    ids = sorted(expected)
    torch.testing.assert_close(pr[ids], base[ids] / base[ids].sum())   # the survivors keep their ratios


def test_top_p_applies_to_the_top_k_survivors():
    # top-k 2 leaves 2/3, 1/3; top-p 0.6 is reached by the first alone
    pr = probs(DYADIC, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))
    assert kept(pr) == {0}


@pytest.mark.parametrize("min_p, expected", [(0.1, {0, 1, 2, 3}), (0.24, {0, 1, 2, 3}), (0.26, {0, 1}),
                                             (0.6, {0}), (1.0, {0})])
def test_min_p_keeps_tokens_at_least_min_p_times_the_best(min_p, expected):
    assert kept(probs(DYADIC, SamplingParams(temperature=1.0, min_p=min_p))) == expected


@pytest.mark.parametrize("filters", [dict(top_p=0.6), dict(min_p=0.26), dict(top_k=3)])
def test_temperature_does_not_change_which_tokens_survive(filters):
    # llama.cpp's order: the filters choose on the untempered distribution, temperature comes last
    sets = {frozenset(kept(probs(DYADIC, SamplingParams(temperature=t, **filters)))) for t in (0.2, 1.0, 5.0)}
    assert len(sets) == 1


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.1), dict(temperature=7.0), dict(temperature=0.8, top_k=5),
    dict(temperature=0.8, top_p=0.5), dict(temperature=0.8, min_p=0.2), dict(temperature=1.3, top_k=20,
    top_p=0.9, min_p=0.05, repeat_penalty=1.3), dict(temperature=0.0),
])
def test_probs_is_a_distribution(params):
    logits = random_logits(300, seed=3)
    pr = probs(logits, SamplingParams(**params), history=[1, 2, 3])
    assert pr.dtype == torch.float32 and pr.shape == (300,)
    assert bool((pr >= 0).all()) and bool(torch.isfinite(pr).all())
    assert abs(pr.sum().item() - 1.0) < 1e-5


# --------------------------------------------------------------------------------------------- drawing


def test_a_fixed_seed_reproduces_the_draws():
    logits = random_logits()
    p = SamplingParams(temperature=1.5, seed=1234)

    def draws(seed):
        gen = make_generator(seed)
        return [sample(logits, p, [], gen) for _ in range(40)]

    assert draws(1234) == draws(1234)
    assert draws(1234) != draws(4321)


def test_no_seed_gives_a_working_generator():
    logits = random_logits()
    tok = sample(logits, SamplingParams(temperature=1.0), [], make_generator(None))
    assert 0 <= tok < logits.shape[0]


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=6, top_p=0.9), dict(temperature=1.2, min_p=0.1),
])
def test_draw_frequencies_match_probs(params):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    p = SamplingParams(**params)
    pr = probs(logits, p)
    n = 4000
    gen = make_generator(7)
    counts = torch.bincount(torch.tensor([sample(logits, p, [], gen) for _ in range(n)]), minlength=8)
    assert int(counts[pr == 0].sum()) == 0, "drew a token that probs() excludes"
    live = pr > 0
    expected = n * pr[live].double()
    chi2 = float(((counts[live].double() - expected) ** 2 / expected).sum())
    dof = int(live.sum()) - 1
    # 99.99th percentile of chi-square with dof <= 7 is below 30; the seed is fixed, so this never flakes
    assert chi2 < 30, f"chi-square {chi2:.1f} with {dof} degrees of freedom"


# --------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(temperature=math.nan), dict(temperature=math.inf),
    dict(top_k=-1),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-0.5), dict(top_p=math.nan),
    dict(min_p=-0.1), dict(min_p=1.5), dict(min_p=math.nan),
    dict(repeat_penalty=0.0), dict(repeat_penalty=-1.0), dict(repeat_penalty=math.nan),
    dict(repeat_penalty=math.inf), dict(repeat_last_n=-2),
    dict(max_tokens=-1),
    dict(seed=-1), dict(seed=2**64),
])
def test_invalid_params_raise_jllm_error(bad):
    with pytest.raises(JllmError):
        SamplingParams(**bad)


def test_boundary_params_are_accepted():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, max_tokens=0, seed=0)
    SamplingParams(min_p=1.0, top_p=1e-6, repeat_last_n=-1, seed=2**64 - 1)


def _nucleus_by_sorting(pr: torch.Tensor, top_p: float) -> torch.Tensor:
    """top-p's set written the plain way: sort everything (ties by id), keep while the mass before is < top_p."""
    order = sorted(range(pr.shape[0]), key=lambda i: (-float(pr[i]), i))
    keep, mass = torch.zeros(pr.shape[0], dtype=torch.bool), 0.0
    for i in order:
        if mass >= top_p:
            break
        keep[i] = True
        mass += float(pr[i])
    return keep


def test_the_native_nucleus_with_denormals_flushed():
    """Where the whole mass is below top_p every id is kept, zeros too, also with the CPU flushing denormals
    (the gather's compare against the float below 0 would read it as -0 there)."""
    from jllm.kernels import qgemm
    from jllm.sampling import nucleus_torch

    if qgemm() is None:
        pytest.skip("no native kernels here")
    pr = torch.zeros(40)
    pr[0], pr[1], pr[2:5] = 0.5, 0.25, 1e-40
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for top_p in (0.9, 0.99):
            assert torch.equal(qgemm().nucleus(pr, top_p), nucleus_torch(pr, top_p))
            assert bool(qgemm().nucleus(pr, top_p).all())
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize("impl", ["torch", "native"])
@pytest.mark.parametrize("kind", ["peaked", "flat", "flat-zeros", "ties", "small", "topk-zeros", "long-tail"])
def test_the_nucleus_without_a_full_sort_is_the_sorted_one(kind, impl):
    """Both ways of finding top-p's set without sorting everything (torch: the most likely 256, then 4,096;
    native: the ids above a falling share of the largest) give the full sort's set in every case, ties at its
    edge taken by id, and the same set as each other."""
    from jllm.kernels import qgemm
    from jllm.sampling import nucleus_torch

    if impl == "native":
        if qgemm() is None:
            pytest.skip("no native kernels here")
        nucleus = qgemm().nucleus
    else:
        nucleus = nucleus_torch
    g = torch.Generator().manual_seed(zlib.crc32(kind.encode()) % 1000)     # the same data in every run
    for trial in range(6):
        if kind == "flat-zeros":                  # a head's flat distribution over part of the ids: sorts those
            logits = torch.full((20000,), float("-inf"))
            logits[torch.randperm(20000, generator=g)[:6000]] = torch.randn(6000, generator=g) * 0.05
        elif kind == "peaked":                      # ends inside the first 256
            logits = torch.randn(20000, generator=g) * 4
        elif kind == "flat":                      # needs more than 4,096: the sort
            logits = torch.randn(20000, generator=g) * 0.05
        elif kind == "ties":                      # few distinct values: ties at every edge
            logits = torch.randint(0, 6, (20000,), generator=g).float()
        elif kind == "small":                     # fewer ids than the first try
            logits = torch.randn(200, generator=g) * 2
        elif kind == "long-tail":                 # a few likely ids, then a tail holding much of the mass
            logits = torch.randn(20000, generator=g)
            logits[:5] += 9
        else:                                     # top-k's zeros after the candidates
            logits = torch.full((20000,), float("-inf"))
            logits[torch.randperm(20000, generator=g)[:40]] = torch.randn(40, generator=g)
        pr = torch.softmax(logits, -1)
        for top_p in (1e-6, 0.3, 0.5, 0.9, 0.95, 0.999):
            got = nucleus(pr, top_p)
            if impl == "native":
                assert torch.equal(got, nucleus_torch(pr, top_p)), (kind, trial, top_p)
            want = _nucleus_by_sorting(pr, top_p) if not kind.startswith(("flat", "long")) or top_p < 0.5 else None
            if want is None:                      # the plain loop over 20,000 is slow: its mass rule instead
                mass = float(pr[got].double().sum())  # summed in another order than the rule's: a little slack
                assert mass >= top_p - 1e-6 and mass - float(pr[got].min()) < top_p + 1e-6
                assert float(pr[got].min()) >= float(pr[~got].max())
            else:
                assert torch.equal(got, want), (kind, trial, top_p)
