"""Verification rules (jllm/spec/verify.py): greedy cases by hand, and chi-square tests that speculative
sampling emits exactly the target's distribution, on a 6-token vocabulary with no model."""

from __future__ import annotations

import pytest
import torch

from jllm.spec.verify import (draw, recovery_probs, verify_greedy, verify_sampled, verify_sampled_batch,
                              verify_sampled_lazy)

V, N = 6, 200_000
# chi-square critical values at alpha = 0.001, by degrees of freedom
CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def dist(seed: int, zeros: tuple[int, ...] = ()) -> torch.Tensor:
    """A fixed random distribution over V tokens, no entry below ~3 % except the listed zeros."""
    w = torch.rand(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.25
    w[list(zeros)] = 0.0
    return (w / w.sum()).float()


def chi2(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """tokens: [n] draws; p: [V] -> (chi-square statistic over p's support, degrees of freedom)."""
    counts = torch.bincount(tokens, minlength=V).double()
    support = p > 0
    assert counts[~support].sum() == 0, f"drew tokens the target never emits: {counts.tolist()}"
    expected = p.double()[support] * len(tokens)
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


def assert_matches(tokens: torch.Tensor, p: torch.Tensor) -> None:
    stat, df = chi2(tokens, p)
    assert stat < CRIT_001[df], f"chi2 = {stat:.1f} >= {CRIT_001[df]} (df {df}) over {len(tokens)} draws"


def emitted(draft: torch.Tensor, n: torch.Tensor, nxt: torch.Tensor, pos: int) -> torch.Tensor:
    """The token each verification emitted at position pos, over those that reached it (n >= pos)."""
    reached = n >= pos
    return torch.where(n[reached] > pos, draft[reached, min(pos, draft.shape[1] - 1)], nxt[reached])


def run(p_rows: list[torch.Tensor], q_rows: list[torch.Tensor] | None, fixed_draft: list[int] | None = None,
        seed: int = 0):
    """N verifications of a k-token draft (k = len(p_rows) - 1) against position-only target rows."""
    gen = torch.Generator().manual_seed(seed)
    k = len(p_rows) - 1
    if q_rows is None:            # n-gram: the same fixed draft every time, no distribution
        draft = torch.tensor([fixed_draft]).expand(N, k)
        draft_probs = None
    else:
        draft = torch.stack([torch.multinomial(q, N, replacement=True, generator=gen) for q in q_rows], 1)
        draft_probs = torch.stack(q_rows)[None].expand(N, k, V)
    target_probs = torch.stack(p_rows)[None].expand(N, k + 1, V)
    n, nxt = verify_sampled_batch(draft, draft_probs, target_probs, gen)
    return draft, n, nxt


# --------------------------------------------------------------------------------------------- greedy


def test_greedy_all_accepted_gives_the_bonus_token():
    assert verify_greedy([4, 5, 6], [4, 5, 6, 7]) == (3, 7)


def test_greedy_first_rejected_gives_the_targets_token():
    assert verify_greedy([4, 5, 6], [9, 5, 6, 7]) == (0, 9)


def test_greedy_rejection_in_the_middle():
    assert verify_greedy([4, 5, 6, 1], [4, 5, 8, 1, 2]) == (2, 8)


def test_greedy_empty_draft_and_length_check():
    assert verify_greedy([], [3]) == (0, 3)
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])


def test_sampled_with_one_hot_target_is_greedy():
    onehot = torch.eye(V)
    gen = torch.Generator().manual_seed(0)
    for draft, argmax in [([1, 2], [1, 2, 3]), ([1, 2], [4, 2, 3]), ([1, 2], [1, 0, 3])]:
        want = verify_greedy(draft, argmax)
        assert verify_sampled(draft, None, onehot[argmax], gen) == want
        assert verify_sampled(draft, torch.full((2, V), 1 / V), onehot[argmax], gen) == want


# ------------------------------------------------------------------------------------ exact distribution


def test_draft_model_output_follows_the_target_at_every_position():
    p, q = [dist(1), dist(2), dist(3)], [dist(4), dist(5)]
    draft, n, nxt = run(p, q)
    for pos in range(3):                          # first token, second token, bonus token
        assert_matches(emitted(draft, n, nxt, pos), p[pos])
    # acceptance rate of the first token is sum(min(p, q)) (Leviathan et al., Definition 3.1)
    alpha = torch.minimum(p[0], q[0]).sum().item()
    assert abs((n >= 1).double().mean().item() - alpha) < 0.005


def test_ngram_point_mass_draft_follows_the_target():
    p = [dist(6), dist(7), dist(8)]
    draft, n, nxt = run(p, None, fixed_draft=[2, 4])
    for pos in range(3):
        assert_matches(emitted(draft, n, nxt, pos), p[pos])
    assert abs((n >= 1).double().mean().item() - p[0][2].item()) < 0.005


def test_ngram_draft_of_a_token_the_target_never_emits_is_always_rejected():
    p = [dist(9, zeros=(3,)), dist(10)]
    draft, n, nxt = run(p, None, fixed_draft=[3])
    assert (n == 0).all()
    assert_matches(nxt, p[0])


def test_draft_mass_where_the_target_has_none():
    # the target's filters (top-k / top-p) removed tokens 4 and 5; the draft still proposes them
    p = [dist(11, zeros=(4, 5)), dist(12, zeros=(0,))]
    q = [dist(13)]
    draft, n, nxt = run(p, q)
    assert_matches(emitted(draft, n, nxt, 0), p[0])
    assert_matches(emitted(draft, n, nxt, 1), p[1])


def test_draft_without_mass_where_the_target_has_some():
    p = [dist(14), dist(15)]
    q = [dist(16, zeros=(0, 1, 2))]               # a draft with its own top-k
    draft, n, nxt = run(p, q)
    assert_matches(emitted(draft, n, nxt, 0), p[0])


def test_the_chi_square_test_catches_a_wrong_recovery_rule():
    """Negative control: resampling from p instead of max(0, p - q) is caught at the same N."""
    p, q = [dist(1), dist(2)], [dist(4)]
    gen = torch.Generator().manual_seed(1)
    draft, n, _ = run(p, q)
    wrong = torch.where(n >= 1, draft[:, 0], torch.multinomial(p[0], N, replacement=True, generator=gen))
    stat, df = chi2(wrong, p[0])
    assert stat > CRIT_001[df]


# ---------------------------------------------------------------------------------------- robustness


def test_draft_token_with_zero_draft_probability_is_accepted_if_the_target_allows_it():
    p = torch.stack([dist(17), dist(18)])
    q = dist(19, zeros=(1,))[None]
    for seed in range(20):
        assert verify_sampled([1], q, p, torch.Generator().manual_seed(seed))[0] == 1


def test_recovery_when_residual_has_no_mass():
    p = dist(20)[None]
    token = torch.tensor([2])
    r = recovery_probs(p, p.clone(), token)        # p == q: max(0, p - q) is all zero
    assert r[0, 2] == 0 and torch.equal(r[0, [0, 1, 3, 4, 5]], p[0, [0, 1, 3, 4, 5]])
    point = torch.eye(V)[[2]]
    assert torch.equal(recovery_probs(point, point.clone(), token), point)   # nothing else: p itself
    assert torch.equal(recovery_probs(point, None, token), point)


def test_draw_never_picks_zero_weights_and_handles_unnormalised_rows():
    w = torch.tensor([[0.0, 3.0, 0.0, 1.0], [0.0, 0.0, 0.0, 2.0]]).expand(2, 4)
    gen = torch.Generator().manual_seed(0)
    got = torch.stack([draw(w, gen) for _ in range(2000)])                 # [2000, 2]
    assert set(got[:, 0].tolist()) == {1, 3} and set(got[:, 1].tolist()) == {3}
    assert abs((got[:, 0] == 1).double().mean().item() - 0.75) < 0.05


def test_lazy_walk_is_the_batch_rule_and_makes_only_the_rows_it_reaches():
    """verify_block's sampled path (rows made as the walk reaches them, q narrower than the vocabulary as the
    head's is) against verify_sampled_batch on the full padded rows: the same (n, token) for the same seed, in
    every case; and no row after the first rejection is made."""
    g = torch.Generator().manual_seed(5)
    W, narrow = 64, 40                                   # vocabulary, the draft's (ids >= narrow have q = 0)
    for case in range(300):
        k = case % 5
        sharp = 1.0 + 3.0 * torch.rand((), generator=g).item()
        p = torch.softmax(torch.randn(k + 1, W, generator=g) * sharp, -1)
        if case % 7 == 0:
            p[:, :narrow // 2] = 0.0                      # target mass where the draft has none, and no mass where it has
            p = p / p.sum(-1, keepdim=True)
        near = torch.log(p[:k, :narrow] + 1e-6) + 0.5 * torch.randn(k, narrow, generator=g)
        q = None if case % 3 == 0 else torch.softmax(near, -1)      # a draft near the target: long walks too
        if q is None:
            draft = [int(p[i].argmax()) if case % 2 else int(torch.randint(W, (), generator=g)) for i in range(k)]
        else:
            draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        made = []

        def row(i):
            made.append(i)
            return p[i]

        seed = 1000 + case
        lazy = verify_sampled_lazy(draft, q, row, torch.Generator().manual_seed(seed))
        q_full = None if q is None else torch.nn.functional.pad(q, (0, W - narrow))
        assert lazy == verify_sampled(draft, q_full, p, torch.Generator().manual_seed(seed)), case
        n = lazy[0]
        assert made == list(range(n + 1)), (case, made, n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lazy_walk_on_the_gpu_is_the_cpu_walk():
    """The target's rows on the GPU (as --device cuda gives them), the draft's on the CPU or the GPU: the same
    outcome as on the CPU, rejections included."""
    g = torch.Generator().manual_seed(9)
    for case in range(200):
        k = 1 + case % 4
        p = torch.softmax(torch.randn(k + 1, 64, generator=g) * 2, -1)
        q = torch.softmax(torch.log(p[:k, :40] + 1e-6) + torch.randn(k, 40, generator=g), -1)
        draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        want = verify_sampled_lazy(draft, q, lambda i: p[i], torch.Generator().manual_seed(case))
        for qd in (q, q.cuda()):
            got = verify_sampled_lazy(draft, qd, lambda i: p[i].cuda(), torch.Generator().manual_seed(case))
            assert got == want, case


def test_shape_errors():
    with pytest.raises(ValueError):
        verify_sampled([1, 2], None, torch.full((2, V), 1 / V), torch.Generator())
    with pytest.raises(ValueError):
        verify_sampled([1, 2], torch.full((3, V), 1 / V), torch.full((3, V), 1 / V), torch.Generator())


def test_verify_tree_follows_the_targets_argmax_through_the_branches():
    from jllm.spec.verify import verify_tree

    V = 10

    def rows(argmaxes):
        out = torch.zeros(len(argmaxes), V)
        for i, a in enumerate(argmaxes):
            out[i, a] = 1.0
        return out

    # rows: 0 last; 1 d=3 (chain), 2 d=4 (chain); 3 d=5 (sibling of row 1), 4 d=6 (child of row 3)
    drafts, parents = [3, 4, 5, 6], [0, 1, 0, 3]
    v = verify_tree(drafts, parents, rows([5, 9, 9, 6, 2]))        # the target goes 5 6 2: the branch
    assert v.accepted == [5, 6] and v.rows == [3, 4] and v.next == 2
    v = verify_tree(drafts, parents, rows([3, 4, 8, 0, 0]))        # the chain holds, then the bonus 8
    assert v.accepted == [3, 4] and v.rows == [1, 2] and v.next == 8
    v = verify_tree(drafts, parents, rows([7, 0, 0, 0, 0]))        # nothing holds
    assert v.accepted == [] and v.rows == [] and v.next == 7
    with pytest.raises(ValueError):
        verify_tree(drafts, [0, 2, 0, 3], rows([0] * 5))            # a parent after its row
