"""The drafting policy (jllm/spec/policy.py), pure: the draft gate, the GPU's round gate and the row costs
driven with given times, the length rules, the n-gram cut, the draft's stopping rule and the side leaf's position."""

import torch

from jllm.spec.policy import DraftGate, RoundGate, RowCost, draft_goes_on, leaf_position, next_length, ngram_keep


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
    # 2.2 tokens for 3 * 0.25 + 1.3 = 2.05 steps: the draft pays, it runs every round
    assert drive(DraftGate(explore=5), 40, lambda i: 2.2) == ["draft"] * 40
    # 1.8 tokens for 2.05 steps: it does not; after the 3 rounds of warm-up decoding is plain but for trials
    gate = DraftGate(explore=5, max_explore=5, give_up=99)
    picks = drive(gate, 40, lambda i: 1.8)
    assert picks[:3] == ["draft"] * 3 and picks[3:].count("plain") > 20 and "draft" in picks[10:]
    assert 0.85 < gate.value() < 0.9


def test_draft_gate_backs_off_from_a_draft_that_keeps_losing():
    picks = drive(DraftGate(explore=12, max_explore=96, trial_rounds=2), 400, lambda i: 1)
    trials = [i for i, a in enumerate(picks) if a == "draft"][3:]      # after the three rounds of warm-up
    assert len(trials) == 6, trials                        # 3 trials of 2 rounds, then it gives up
    starts = trials[::2]
    assert [b - a for a, b in zip(starts, starts[1:])] == [1 + 24, 1 + 48]   # doubling, from a trial's end
    # a draft that starts paying again wins its next trial and is kept
    picks = drive(DraftGate(explore=12, give_up=3), 200, lambda i: 1 if i < 30 else 3)
    assert picks[-50:] == ["draft"] * 50


def test_draft_gate_carries_its_estimates_into_the_next_generation():
    gate = DraftGate(explore=12, max_explore=96, give_up=3, trial_rounds=2)
    drive(gate, 400, lambda i: 1)                          # turn 1: the draft always loses, is given up
    assert gate.lost == 3
    gate.new_generation()                                  # turn 2: no free rounds, one more trial
    picks = drive(gate, 100, lambda i: 1)
    assert picks[:11] == ["plain"] * 11 and picks.count("draft") == 2


def test_row_cost_is_fitted_from_the_verify_passes():
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
    gate = DraftGate()
    steps = [1.0, 1.05, 1.12, 1.3, 1.9, 2.3, 2.6, 2.9, 3.2]      # AVX2-like: rows dear from the 4th
    for i in range(180):
        gate.observe(0.030 * steps[i % 9], i % 9)

    def pays(k, chain):
        return gate.extend_pays(k, chain, free=True)

    assert ngram_keep(8, 90, 10, pays) == 8      # copying, 9 in 10 tokens held: even the dear rows pay
    assert ngram_keep(8, 80, 20, pays) == 3      # 8 in 10: the 4th token (0.8^4 = 0.41) is not worth ~0.55
    assert ngram_keep(8, 10, 30, pays) == 1      # the copies keep breaking: one token
    assert ngram_keep(8, 0, 0, lambda k, c: True) == 8 and ngram_keep(1, 0, 0, lambda k, c: False) == 1


def test_draft_goes_on_within_its_bounds():
    assert draft_goes_on(1, 4, 1, 0.9, 0.7)
    assert not draft_goes_on(1, 4, 1, 0.6, 0.7)              # the chain fell below p_min
    assert draft_goes_on(1, 4, 2, 0.1, 0.7)                  # below k_min it always goes on
    assert not draft_goes_on(4, 4, 1, 1.0, 0.7)              # k reached
    assert not draft_goes_on(2, 8, 1, 0.9, 0.7, extend=lambda n, chain: n < 3)
    assert draft_goes_on(1, 8, 1, 0.9, 0.7, extend=lambda n, chain: n < 3)


def test_next_length():
    assert next_length("draft", 8, 8, 0, 1, 8) == 2         # wrong from its first token: 0 + 2
    assert next_length("draft", 2, 2, 2, 1, 8) == 4
    assert next_length("draft", 8, 8, 8, 1, 8) == 8
    assert next_length("ngram", 5, 5, 5, 1, 8) == 6         # fully accepted: one more
    assert next_length("ngram", 8, 8, 8, 1, 8) == 8
    assert next_length("ngram", 6, 6, 2, 1, 8) == 3         # broke after 2: as far as it held, plus one
    assert next_length("ngram", 6, 6, 0, 2, 8) == 2         # never below k_min


def test_leaf_position_is_the_least_confident_token_below_the_threshold():
    assert leaf_position([0.9, 0.4, 0.6, 0.4], 0.7) == 1    # the first of the least confident
    assert leaf_position([0.9, 0.8], 0.7) is None
    assert leaf_position([], 0.7) is None


def run_round_gate(gate, stretches: int, per_token) -> list[str]:
    """Drive a RoundGate: a stretch of n tokens in mode m takes n * per_token(m, i) seconds (i: its index)."""
    modes = []
    for i in range(stretches):
        mode, n = gate.next()
        modes.append(mode)
        gate.observe(mode, n, n * per_token(mode, i))
    return modes


def test_round_gate_keeps_rounds_that_pay_and_probes_steps():
    gate = RoundGate(stretch=48, probe=16, probe_every=6)
    modes = run_round_gate(gate, 30, lambda m, i: 1.0 if m == "rounds" else 1.6)
    assert modes[:2] == ["rounds", "steps"]                  # each measured once
    assert modes[2:].count("steps") == 5 and modes[2:].count("rounds") == 23     # a probe every 6th stretch
    assert [gate.next() for _ in range(5)] == [("rounds", 48)] * 5


def test_round_gate_drops_rounds_that_do_not_pay_and_takes_them_back_when_the_text_suits_them():
    gate = RoundGate(stretch=48, probe=16, probe_every=6, decay=0.5)
    # a weak head for 20 stretches (rounds at 1.3 steps a token), then a strong one (0.6)
    modes = run_round_gate(gate, 40, lambda m, i: 1.0 if m == "steps" else (1.3 if i < 20 else 0.6))
    assert modes[2:20].count("rounds") <= 3                  # only probes while rounds lose
    assert modes[30:].count("rounds") >= 8                   # back once a probe shows them paying
    assert gate.next()[1] in (16, 48)


def test_round_gate_ignores_empty_stretches():
    gate = RoundGate()
    gate.observe("rounds", 0, 1.0)
    gate.observe("steps", 5, 0.0)
    assert gate.per_token == {"rounds": None, "steps": None} and gate.next() == ("rounds", 48)


def test_a_fixed_round_gate_keeps_its_mode():
    gate = RoundGate(fixed="rounds")
    for _ in range(10):
        gate.observe("rounds", 10, 100.0)
        gate.observe("steps", 10, 1.0)
    assert {gate.next() for _ in range(12)} == {("rounds", 48)}
