"""Adaptive draft trees: the cost model, the calibration and the cut (no model needed).

Budget: ~5 s on 2 cores.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.speculative import Drafter, DraftTree
from treeattn.speculative.adaptive import (
    AdaptiveDrafter,
    Calibrator,
    Candidates,
    CostModel,
    LearningDrafter,
    StepGate,
    takes_floor,
)


class FixedChains:
    """A scoring drafter: for every context, a chain of ``tokens`` with prior ``p`` per edge, all in bucket 7."""

    def __init__(self, tokens, p=0.9):
        self.tokens, self.p = list(tokens), p

    def candidates(self, contexts, hidden=None):
        out = []
        for c in contexts:
            n = len(self.tokens) + 1
            tree = DraftTree(np.array([c[-1]] + self.tokens), np.arange(-1, n - 1))
            out.append(Candidates(tree, np.full(n, 7), np.full(n, self.p)))
        return out


def measured(cost: CostModel, a: float, b: float, sizes=(1, 2, 4, 8, 16, 32), noise=0.0, seed=0, c: float = 0.0):
    rng = np.random.default_rng(seed)
    for n in sizes:
        cost.add(n, a + b * n + c * (n > 1) + noise * rng.standard_normal())
    return cost


def test_cost_model_fits_measured_times():
    cost = measured(CostModel(forget=1.0), 0.05, 0.004, sizes=list(range(1, 33)) * 3, noise=0.001, c=0.02)
    a, b, c = cost.coefficients
    assert a == pytest.approx(0.05, rel=0.05) and b == pytest.approx(0.004, rel=0.05)
    assert c == pytest.approx(0.02, rel=0.1)
    assert cost.seconds(10) == pytest.approx(0.11, rel=0.03)
    assert cost.seconds(10, drafted=False) == pytest.approx(0.09, rel=0.03)  # a batch of 10 plain decodes
    assert cost.seconds(1) == pytest.approx(0.054, rel=0.03)


def test_cost_model_follows_a_changing_machine():
    cost = measured(CostModel(forget=0.9), 0.05, 0.004, sizes=[1, 8, 16] * 10)
    measured(cost, 0.10, 0.010, sizes=[1, 8, 16] * 20)  # the machine got busier: recent steps win
    a, b, c = cost.coefficients
    assert a == pytest.approx(0.10, rel=0.05) and b == pytest.approx(0.010, rel=0.05) and c < 0.005


def test_cost_model_slope_comes_from_the_prior_until_sizes_vary():
    cost = CostModel(ratio=0.1)
    assert np.isnan(cost.coefficients[0])
    for _ in range(5):
        cost.add(1, 0.11)
    a, b, c = cost.coefficients
    assert a + b == pytest.approx(0.11, rel=1e-3) and b == pytest.approx(0.1 * a, rel=1e-2)
    assert c == pytest.approx(0.0, abs=1e-6)  # no drafting step seen: optimistic, so drafting gets tried
    with pytest.raises(ValueError, match="nodes"):
        cost.add(0, 0.1)


def test_never_drafts_when_the_cost_model_says_it_cannot_pay():
    # Every node would be accepted with probability 0.9, but costs about as much as a one-token step
    # (a step's time is nearly all per node): a node brings less than the token a step would.
    drafter = AdaptiveDrafter(FixedChains([5, 6, 7]), cost=measured(CostModel(forget=1.0), 0.001, 0.05))
    trees = drafter.propose([np.array([1, 2]), np.array([3])])
    assert [t.size for t in trees] == [1, 1]
    assert [int(t.tokens[0]) for t in trees] == [2, 3]


def test_drafts_when_nodes_are_cheap_and_likely():
    drafter = AdaptiveDrafter(FixedChains([5, 6, 7]), cost=measured(CostModel(forget=1.0), 0.05, 0.001))
    tree = drafter.propose([np.array([1, 2])])[0]
    assert tree.tokens.tolist() == [2, 5, 6, 7] and tree.parents.tolist() == [-1, 0, 1, 2]


def test_never_drafts_when_the_gain_does_not_cover_the_price_of_drafting():
    # Nodes are nearly free, but any drafting step costs 40% more than a plain one: one likely node
    # (p = 0.3 per edge, chain of 3: expected 0.3 + 0.09 + 0.027 tokens) cannot pay for that.
    cost = measured(CostModel(forget=1.0), 0.05, 0.0005, c=0.02)
    drafter = AdaptiveDrafter(FixedChains([5, 6, 7], p=0.3), cost=cost)
    drafter.calibrators[0].strength = 1e9  # trust the prior: the test is about the cut
    assert drafter.propose([np.array([1])])[0].size == 1
    likely = AdaptiveDrafter(FixedChains([5, 6, 7], p=0.9), cost=cost)
    assert likely.propose([np.array([1])])[0].size == 4  # 2.4 expected tokens pay for it


def test_drafting_steps_are_recorded_as_such():
    drafter = AdaptiveDrafter(FixedChains([5, 6], p=0.9), cost=measured(CostModel(forget=1.0), 0.05, 0.001))
    trees = drafter.propose([np.array([1]), np.array([2])])
    assert sum(t.size for t in trees) > 2
    before = drafter.cost._gram[2, 2]
    drafter.observe([[5, 6, 0], [5, 6, 0]], 0.06)
    assert drafter.cost._gram[2, 2] == pytest.approx(before + 1)
    drafter.cost = measured(CostModel(forget=1.0), 0.001, 0.05)  # nodes dear: the next step is plain
    trees = drafter.propose([np.array([1]), np.array([2])])
    assert [t.size for t in trees] == [1, 1]
    before = drafter.cost._gram.copy()
    drafter.observe([[5], [5]], 0.05)  # a batch of two plain decodes: 2 nodes, not a drafting step
    assert drafter.cost._gram[0, 1] == before[0, 1] + 2 and drafter.cost._gram[2, 2] == before[2, 2]
    drafter.propose([np.array([1]), np.array([2])])
    steps, hits = drafter.cost.steps, dict(drafter.calibrators[0].hits)
    drafter.observe([[5, 6], [9]], None)  # an untimed step (it also prefilled): calibration only
    assert drafter.cost.steps == steps and drafter.calibrators[0].hits != hits


def test_first_step_with_nothing_measured_is_a_plain_decode():
    drafter = AdaptiveDrafter(FixedChains([5, 6]))
    assert drafter.propose([np.array([1])])[0].size == 1
    assert isinstance(drafter, Drafter) and isinstance(drafter, LearningDrafter)


def test_calibration_learns_from_steps_that_drafted_nothing():
    # The prior says 0.9, but the target never emits the drafted token: the drafter must learn that
    # from lone-root steps too (counterfactual labels), and keep not drafting.
    cost = measured(CostModel(forget=1.0), 0.05, 0.004)
    drafter = AdaptiveDrafter(FixedChains([5, 6], p=0.9), cost=cost)
    assert drafter.propose([np.array([1])])[0].size == 3
    for _ in range(30):
        drafter.propose([np.array([1])])
        drafter.observe([[9]], 0.05)  # the target emitted 9, not 5
    assert drafter.calibrators[0].probability(np.array([7]), np.array([0.9]))[0] < 0.1
    assert drafter.propose([np.array([1])])[0].size == 1


def test_calibrator_labels_only_nodes_on_the_emitted_path():
    cal = Calibrator(decay=1.0)
    # root 0; children 1 (token 5, key 1) and 2 (token 6, key 2); node 3 (token 7, key 3) below node 1;
    # node 4 (token 8, key 4) below node 2.
    tree = DraftTree(np.array([0, 5, 6, 7, 8]), np.array([-1, 0, 0, 1, 2]))
    cal.learn(Candidates(tree, np.array([0, 1, 2, 3, 4]), np.full(5, 0.5)), [5, 9, 4])
    assert cal.trials == {1: 1.0, 2: 1.0, 3: 1.0}  # node 4's parent was not emitted: no label
    assert cal.hits == {1: 1.0, 2: 0.0, 3: 0.0}
    cal.learn(Candidates(tree, np.array([0, 1, 2, 3, 4]), np.full(5, 0.5)), [5])  # depth 2 unknown yet
    assert cal.trials[3] == 1.0 and cal.trials[1] == 2.0


def test_sources_merge_by_path_with_the_best_probability():
    a = FixedChains([5, 6], p=0.2)
    b = FixedChains([5, 8], p=0.9)
    drafter = AdaptiveDrafter(a, b, cost=measured(CostModel(forget=1.0), 0.05, 0.0001))
    drafter.calibrators[0].strength = drafter.calibrators[1].strength = 1.0
    tree = drafter.propose([np.array([1])])[0]
    paths = {tuple(int(tree.tokens[i]) for i in tree.path(n)[1:]) for n in range(tree.size)}
    assert paths == {(), (5,), (5, 6), (5, 8)}
    assert tree.size == 4


class Asked(FixedChains):
    """``FixedChains`` that records the contexts' last tokens and the hidden rows it was asked about."""

    def __init__(self, tokens, p=0.9):
        super().__init__(tokens, p)
        self.asked = []

    def candidates(self, contexts, hidden=None):
        self.asked.append(([int(c[-1]) for c in contexts], None if hidden is None else hidden[:, 0].tolist()))
        return super().candidates(contexts, hidden)


class SureAfterOne:
    """Three likely nodes after a context ending in 1, nothing after any other."""

    def candidates(self, contexts, hidden=None):
        return [FixedChains([5, 6, 7]).candidates([c])[0] if c[-1] == 1 else Candidates.root_only(int(c[-1]))
                for c in contexts]


def test_a_later_source_is_asked_only_where_the_earlier_ones_are_unsure():
    import torch

    contexts, hidden = [np.array([1]), np.array([2]), np.array([3])], torch.tensor([[10.0], [20.0], [30.0]])
    later = Asked([8], p=0.5)
    drafter = AdaptiveDrafter(SureAfterOne(), later, cost=measured(CostModel(forget=1.0), 0.05, 0.0001))
    trees = drafter.propose(contexts, hidden=hidden)
    assert later.asked == [([2, 3], [20.0, 30.0])]  # 0.9 + 0.81 + 0.73 expected tokens after 1: enough
    assert trees[0].tokens.tolist() == [1, 5, 6, 7] and trees[1].tokens.tolist() == [2, 8]
    drafter.observe([[5, 6, 7, 9], [8, 4], [8, 4]], 0.06)  # a source not asked learns nothing there
    assert drafter.calibrators[1].trials == pytest.approx({7: 1 + 0.98})  # two labels (decay 0.98), none for 1
    everywhere = Asked([8], p=0.5)
    AdaptiveDrafter(SureAfterOne(), everywhere, enough=None, cost=measured(CostModel(forget=1.0), 0.05, 0.0001)
                    ).propose(contexts, hidden=hidden)
    assert everywhere.asked == [([1, 2, 3], [10.0, 20.0, 30.0])]


class Floored(FixedChains):
    """A source that takes ``floor`` and records what it was told."""

    def __init__(self, tokens, p=0.9):
        super().__init__(tokens, p)
        self.floors = []

    def candidates(self, contexts, hidden=None, *, floor=0.0):
        self.floors.append(floor)
        return super().candidates(contexts, hidden)


def test_sources_that_take_a_floor_are_told_what_cannot_pay():
    """A node of probability p pays only if p > per_node * rate, and the best rate is at least the plain
    step's: floor = b * B / (a + b * B), rising with the batch; 0 before anything was measured."""
    floored, plain = Floored([5]), FixedChains([6])
    assert takes_floor(floored) and not takes_floor(plain)
    drafter = AdaptiveDrafter(plain, floored, enough=None)
    drafter.propose([np.array([1])])
    assert floored.floors == [0.0]  # nothing measured: no floor (a plain decode measures the step)
    drafter.cost = CostModel.fixed(0.045, 0.0015)
    for batch in (1, 16):
        drafter.propose([np.array([1])] * batch)
        assert floored.floors[-1] == pytest.approx(0.0015 * batch / (0.045 + 0.0015 * batch))
    assert floored.floors[1] < 0.05 < 0.3 < floored.floors[2]  # alone a long shot pays, at 16 it must be likely


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=8), min_size=1, max_size=4),
       st.floats(0.0, 1.0), st.floats(1e-4, 0.05), st.integers(1, 12), st.sampled_from([0.0, 0.01, 0.05]))
def test_adaptive_trees_are_valid_and_within_max_nodes(chains, p, per_node, max_nodes, jump):
    class Multi:
        def candidates(self, contexts, hidden=None):
            return [FixedChains(chains[b % len(chains)], p).candidates([c])[0] for b, c in enumerate(contexts)]

    cost = measured(CostModel(forget=1.0), 0.05, per_node, c=jump)
    drafter = AdaptiveDrafter(Multi(), cost=cost, max_nodes=max_nodes)
    contexts = [np.array([b, 40 + b]) for b in range(3)]
    trees = drafter.propose(contexts)
    for b, tree in enumerate(trees):
        assert 1 <= tree.size <= max_nodes and tree.tokens[0] == 40 + b
        chain = chains[b % len(chains)]
        assert tree.tokens[1:].tolist() == chain[:tree.size - 1]  # a prefix of the candidate chain
    # The cut maximises expected tokens per second: brute force over every per-request depth.
    def rate(depths):
        gain = 3 + sum(p ** (d + 1) for k in depths for d in range(k))
        return gain / cost.seconds(3 + sum(depths), drafted=sum(depths) > 0)

    limits = [min(len(chains[b % len(chains)]), max_nodes - 1) for b in range(3)]
    best = max(rate((i, j, k)) for i in range(limits[0] + 1) for j in range(limits[1] + 1)
               for k in range(limits[2] + 1))
    assert rate([t.size - 1 for t in trees]) >= best * (1 - 1e-9)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="at least one"):
        AdaptiveDrafter()
    with pytest.raises(TypeError, match="sources"):
        AdaptiveDrafter(object())
    with pytest.raises(ValueError, match="max_nodes"):
        AdaptiveDrafter(FixedChains([1]), max_nodes=0)
    with pytest.raises(ValueError, match="enough must be > 0 or None"):
        AdaptiveDrafter(FixedChains([1]), enough=0)
    with pytest.raises(ValueError, match="forget"):
        CostModel(forget=0)
    with pytest.raises(ValueError, match="seconds_to_draft"):
        CostModel.fixed(0.05, 0.001, -0.01)
    with pytest.raises(ValueError, match="one entry per tree node"):
        Candidates(DraftTree.root_only(1), np.zeros(2), np.zeros(1))


# ---------------------------------------------------------------- the step gate (batched engines)


def test_step_gate_measures_both_arms_then_runs_the_better_and_probes_the_other():
    gate = StepGate(probe_every=4, try_steps=1)
    assert gate.drafts(8) is False  # nothing measured: a plain step first
    gate.record(8, False, 8, 0.1)  # 10 tokens per request per second
    assert gate.drafts(8) is True  # drafting not measured yet: try it
    gate.record(8, True, 24, 0.2)  # 15
    assert gate.rate(8, True) == pytest.approx(15) and gate.rate(15, False) == pytest.approx(10)  # one class: 8-15
    # drafting measured 1.5x faster: plain is tried again after 4 * 1.5 = 6 steps
    assert [gate.drafts(9) for _ in range(6)] == [True] * 5 + [False]
    assert gate.drafts(9) is False  # a try lasts until its step is measured
    gate.record(9, False, 9, 0.1)  # plain still at 10: the next try waits twice as long
    assert [gate.drafts(9) for _ in range(12)] == [True] * 11 + [False]
    gate.record(9, False, 9, 0.1)  # and the one after it 4x
    assert np.isnan(gate.rate(16, False)) and gate.drafts(16) is False  # another batch size, measured apart
    for _ in range(10):
        gate.record(12, True, 12, 0.2)  # drafting stopped paying (5): recent steps outweigh the old
    assert 5 < gate.rate(8, True) < 6  # plain is now ~1.8x faster: it runs, drafting is tried after 4 x 4 x 1.8 steps
    wait = math.ceil(4 * 4 * gate.rate(8, False) / gate.rate(8, True))
    assert [gate.drafts(8) for _ in range(wait)] == [False] * (wait - 1) + [True]


def test_step_gate_backs_off_while_the_tried_arm_keeps_losing():
    gate = StepGate(probe_every=4, max_backoff=4, forget=0.5, try_steps=1)  # binary fractions: rates exact
    gate.record(8, False, 8, 0.125)  # plain: 8 tokens per request per second
    gate.record(8, True, 8, 0.25)  # drafting: 4

    def wait(arm: bool) -> int:  # steps until the gate tries `arm` (the try included)
        n = 1
        while gate.drafts(8) is not arm:
            n += 1
        return n

    waits = []
    for _ in range(4):
        waits.append(wait(True))
        gate.record(8, True, 8, 0.25)  # tried: drafting still at 4
    assert waits == [8, 16, 32, 32]  # 4 x 2 (plain measured 2x faster), doubled per losing try up to 4x
    assert wait(True) == 32
    gate.record(8, True, 80, 0.25)  # tried, and drafting now pays (rate ~22): it runs, the wait starts over
    assert gate.rate(8, True) > gate.rate(8, False)
    assert wait(False) <= 4 * 3


def test_step_gate_tries_again_after_a_one_off_stall():
    """A drafting step that stalled (here 100x slower: the kernel was built inside it) makes drafting look
    100x worse; it is tried again within probe_every x MAX_RATIO steps, not 100x later."""
    gate = StepGate(probe_every=4, try_steps=1)
    gate.record(8, False, 8, 0.1)
    gate.record(8, True, 24, 20.0)
    tries = [gate.drafts(8) for _ in range(int(4 * StepGate.MAX_RATIO))]
    assert tries.count(True) == 1 and tries[-1] is True


def test_step_gate_tries_an_arm_for_try_steps_steps_in_a_row():
    """One drafting step that accepted little must not decide: a try runs ``try_steps`` steps, judged on
    them together (with ``forget``), and the first measurement of an arm is a try too; a try ends at once
    when the arm measures ``CLEAR`` times worse (a real loss, not noise)."""
    gate = StepGate(probe_every=4, try_steps=3, forget=0.5)
    gate.record(8, False, 8, 0.1)  # plain: 10 tokens per request per second
    assert [gate.drafts(8) for _ in range(3)] == [True] * 3  # drafting unmeasured: tried until 3 steps are in
    gate.record(8, True, 8, 0.125)  # 8: an unlucky step, within CLEAR of plain
    assert gate.drafts(8) is True  # the try goes on
    gate.record(8, True, 24, 0.1)  # 30
    gate.record(8, True, 24, 0.1)  # 30
    assert gate.rate(8, True) == pytest.approx((8 / 4 + 30 / 2 + 30) / 1.75)  # 26.9 > 10: drafting runs
    tried = [gate.drafts(8) for _ in range(11)]  # plain re-tried after 4 x 2.69 steps, for 3 steps
    assert tried == [True] * 10 + [False] and [gate.drafts(8) for _ in range(3)] == [False] * 3
    for _ in range(3):
        gate.record(8, False, 8, 0.1)  # plain still at 10: the re-try's verdict, the wait doubles
    assert gate.drafts(8) is True and gate._backoff[(8).bit_length()] == 2
    gate.record(16, False, 16, 0.1)
    assert gate.drafts(16) is True
    gate.record(16, True, 16, 0.2)  # 5: CLEAR-ly worse than plain's 10, but one step alone does not end a try
    assert gate.drafts(16) is True
    gate.record(16, True, 16, 0.2)  # two steps at 5: the try ends
    assert gate.drafts(16) is False


def test_step_gate_judges_a_tried_arm_on_its_new_steps_not_its_old_rate():
    """Every step of a class ages both arms' weights: an arm that did not run for long keeps its rate
    until it runs again, and then its new steps decide. Plain measured 25 tokens per request-second early
    on (a slow moment) and would now give 31: the try of plain must say 31, not a blend with the old 25."""
    gate = StepGate(try_steps=2)
    gate.record(16, False, 16, 0.04)  # plain: 25
    assert [gate.drafts(16) for _ in range(2)] == [True, True]
    gate.record(16, True, 144, 0.2)  # drafting: 45
    gate.record(16, True, 144, 0.2)
    drafted = 0
    while gate.drafts(16):  # drafting runs, plain is tried again after 16 x 1.8 steps
        gate.record(16, True, 144, 0.2)
        drafted += 1
    assert drafted == math.ceil(16 * 45 / 25) - 1 and gate.rate(16, False) == pytest.approx(25)  # kept while unrun
    gate.record(16, False, 16, 1 / 31)  # the try of plain, 2 steps
    gate.record(16, False, 16, 1 / 31)
    # the old 25 weighs 0.8^32 against the new steps' 1.8 (aged by plain's own steps alone, 0.8^2: 29.4)
    assert gate.rate(16, False) == pytest.approx(31, rel=1e-4)
    assert gate.rate(16, True) == pytest.approx(45)  # the running arm's rate is only aged, not moved


def test_step_gate_does_not_drop_a_retried_arm_on_its_first_step():
    """A re-tried arm's rate is its new steps alone, and the first drafting step after plain ones is slow
    (the drafters catch up on the tokens they skipped): judged on that step, drafting would be dropped at
    every try while it pays once caught up."""
    gate = StepGate(probe_every=4, try_steps=4)
    gate.record(16, False, 16, 1 / 30)  # plain: 30
    assert gate.drafts(16) is True
    for _ in range(4):
        gate.record(16, True, 16, 1 / 20)  # drafting: 20, 1.5x worse: plain runs
    assert gate.drafts(16) is False
    while not gate.drafts(16):  # plain runs until drafting's re-try
        gate.record(16, False, 16, 1 / 30)
    gate.record(16, True, 16, 1 / 18)  # the catching-up step: 18, 1.67x worse than plain, alone
    assert gate.drafts(16) is True  # the try goes on
    for _ in range(3):
        gate.record(16, True, 160, 1 / 4)  # 40 once caught up
    assert gate.rate(16, True) > gate.rate(16, False) and gate.drafts(16) is True  # drafting runs


@pytest.mark.parametrize("kwargs, match", [({"probe_every": 1}, "probe_every"), ({"forget": 1.0}, "forget"),
                                           ({"max_backoff": 0}, "max_backoff"), ({"try_steps": 0}, "try_steps")])
def test_step_gate_refuses_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepGate(**kwargs)
    with pytest.raises(ValueError, match="tokens >= batch"):
        StepGate().record(4, True, 3, 0.1)


def _serve(drafter, batch: int, steps: int, per_token: float, fixed: float, per_draft: float):
    """A simulated engine: ``batch`` requests whose target always continues 5, 6, 7, 8, a step costing
    ``fixed + per_token * (its tokens)`` plus ``per_draft`` per request when the drafter drafted;
    returns (tokens per second, share of steps that drafted)."""
    tokens = seconds = drafting = 0.0
    contexts = [np.array([1])] * batch
    for _ in range(steps):
        trees = drafter.propose(contexts)
        drafted = drafter.gate is None or drafter._gated
        emitted = [[5, 6, 7, 8][:t.size] for t in trees]  # the chain is always right: each node is accepted
        step = fixed + per_token * sum(t.size for t in trees) + per_draft * batch * drafted
        drafter.observe(emitted, step)
        tokens, seconds, drafting = tokens + sum(map(len, emitted)), seconds + step, drafting + drafted
    return tokens / seconds, drafting / steps


def test_gated_drafter_keeps_its_wins_alone_and_never_loses_in_a_compute_bound_batch():
    # One request: a step is mostly fixed cost, a tree of 4 emits 4 tokens: drafting wins big.
    alone = AdaptiveDrafter(FixedChains([5, 6, 7]), gate=StepGate())
    rate, share = _serve(alone, 1, 200, per_token=0.002, fixed=0.04, per_draft=0.003)
    assert share > 0.85 and rate > 2.5 / 0.042  # well above a plain step's 1 token per 42 ms
    # Sixteen requests, compute-bound (the step's time is in its tokens), and drafting for each request
    # costs more than its accepted tokens save: without the gate the drafter still drafts every step
    # (it pays for drafting before it can cut), with it the engine decodes plainly but for its probes.
    plain = 16 / (0.01 + 0.02 * 16)
    ungated, share = _serve(AdaptiveDrafter(FixedChains([5, 6, 7])), 16, 200, per_token=0.02, fixed=0.01,
                            per_draft=0.02)
    assert share == 1 and ungated < 0.9 * plain
    rate, share = _serve(AdaptiveDrafter(FixedChains([5, 6, 7]), gate=StepGate()), 16, 200, per_token=0.02,
                         fixed=0.01, per_draft=0.02)
    assert share < 0.1 and rate > 0.95 * plain

