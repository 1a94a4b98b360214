"""Roofline latency model, its calibration, and the BASTION controller's choices."""

from __future__ import annotations

import heapq
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import bastion.budget.latency
import bastion.models.attention
from bastion.budget.controller import BastionBudget, merge_best_first
from bastion.budget.hardware import HardwareProfile, cpu_model, profile_from_config
from bastion.budget.latency import RECENT, SIZE_POINTS, ForwardCost, LatencyModel, calibrated, probe, probe_problem
from bastion.budget.stretch import ARStretch
from bastion.models.attention import attention_path
from bastion.models.target import load_target
from bastion.models.transformer import ModelArgs
from bastion.tree.draft_tree import DraftTree
from tests.conftest import target_config

ARGS = ModelArgs(arch="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
                 n_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position=512, tie_word_embeddings=True,
                 attention_bias=False, output_bias=False, qk_norm=False)
H100 = HardwareProfile("h100", {"float32": 67, "bfloat16": 989}, 3350, 3.0)
CPU = HardwareProfile("cpu", {"float32": 0.14}, 8, 2.0)


def test_forward_cost_counts_by_hand():
    cost = ForwardCost(ARGS, bytes_per_param=4)
    layer = 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128  # q,o + k,v ; gate, up, down
    assert cost.layer_params == 2 * layer and cost.head_params == 64 * 1000
    flops, moved = cost.flops_bytes(np.array([3]), np.array([10]))
    assert flops == 2 * (2 * layer + 64000) * 3 + 4 * 2 * 4 * 16 * (3 * 13)
    assert moved == (2 * layer + 64000) * 4 + (2 * 2 * 2 * 16 * 4) * 13


SMOL = ModelArgs(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, n_layers=30, n_heads=9,
                 n_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position=8192, tie_word_embeddings=True,
                 attention_bias=False, output_bias=False, qk_norm=False)


def synthetic_truth(theta, args=SMOL) -> LatencyModel:
    return LatencyModel(ForwardCost(args, 4), CPU.flops_per_s(torch.float32), CPU.bytes_per_s, np.asarray(theta, dtype=float))


# SmolLM2-135M on a 2-core CPU: ~5 ms fixed, compute at ~50 GFLOP/s, memory at ~7.5 GB/s, summed
TRUE_CPU = [math.log(0.005), math.log(2.8), math.log(1.07), math.log(1e-3)]


def test_fit_recovers_the_parameters_that_made_the_times():
    truth = synthetic_truth(TRUE_CPU)
    model = synthetic_truth([math.log(0.001), 0.0, 0.0, math.log(7.0)])  # starts far off
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        seconds = float(truth.predict(np.array([n]), np.array([256])))
        error = model.observe_forward([n], [256], seconds)  # the curve's own error at it, before this point refits it
        assert error == pytest.approx(math.log(seconds / float(model.predict(np.array([n]), np.array([256]), corrected=False))))
    model.fit(fit_shape=True, prior_weight=1e-6)
    sizes = np.arange(1, 300)[:, None]
    errors = np.abs(model.predict(sizes, np.full_like(sizes, 256)) / truth.predict(sizes, np.full_like(sizes, 256)) - 1)
    assert errors.max() < 0.02


def chain(n, p=0.8, root=0) -> DraftTree:
    return DraftTree(tuple(range(root, root + n + 1)), tuple(range(-1, n)), tuple(k * math.log(p) for k in range(n + 1)))


def test_merge_takes_the_best_next_node_of_any_row_keeping_prefixes():
    a, b = chain(3, 0.9), chain(3, 0.7)  # path probabilities .9 .81 .73 and .7 .49 .34
    counts, gained = merge_best_first([a, b])
    assert counts.tolist() == [[0, 0], [1, 0], [2, 0], [3, 0], [3, 1], [3, 2], [3, 3]]
    c = chain(3, 0.85)  # .85 .72 .61 interleave with a's nodes
    counts, _ = merge_best_first([a, c])
    assert counts.tolist() == [[0, 0], [1, 0], [1, 1], [2, 1], [3, 1], [3, 2], [3, 3]]
    assert gained[-1] == pytest.approx(a.expected_accepted() + b.expected_accepted())
    counts, gained = merge_best_first([a])  # one row: its nodes in order
    assert counts.tolist() == [[0], [1], [2], [3]] and gained == pytest.approx([0, 0.9, 0.9 + 0.81, 0.9 + 0.81 + 0.729])
    counts, gained = merge_best_first([a, b], np.array([1.0, 0.5, 0.1]))  # nodes valued by their rank's ratio
    assert counts.tolist() == [[0, 0], [1, 0], [1, 1], [2, 1], [2, 2], [3, 2], [3, 3]]
    assert gained[-1] == pytest.approx(0.9 + 0.7 + 0.5 * (0.81 + 0.49) + 0.1 * (0.729 + 0.343))


def heap_merge(trees: list[DraftTree]) -> list[list[int]]:
    """The greedy merge as stated: pop the best next node of any row, ties to the lower row."""
    heap = [(-math.exp(t.logq[1]), b) for b, t in enumerate(trees) if t.n_nodes]
    heapq.heapify(heap)
    taken = [0] * len(trees)
    counts = [list(taken)]
    while heap:
        _, b = heapq.heappop(heap)
        taken[b] += 1
        counts.append(list(taken))
        if taken[b] < trees[b].n_nodes:
            heapq.heappush(heap, (-math.exp(trees[b].logq[taken[b] + 1]), b))
    return counts


@pytest.mark.parametrize("seed", range(5))
def test_merge_equals_the_greedy_heap_on_rows_whose_values_rise_and_fall(seed):
    """Static trees list nodes in a fixed order, not by value: a row's values may rise again."""
    rng = np.random.default_rng(seed)
    trees = []
    for b in range(4):
        n = int(rng.integers(0, 9))
        logq = (0.0, *np.log(rng.choice([0.1, 0.2, 0.5, 0.9], size=n)).tolist())  # repeated values: ties
        trees.append(DraftTree(tuple(range(n + 1)), (-1, *[0] * n), logq))
    assert merge_best_first(trees)[0].tolist() == heap_merge(trees)


def controller(theta, profile=CPU, args=SMOL) -> BastionBudget:
    budget = BastionBudget(max_nodes=256, probe=False)
    budget.latency = LatencyModel.from_profile(args, torch.float32, profile)
    if theta is not None:
        budget.latency.theta = budget.latency.prior = np.asarray(theta, dtype=float)
    return budget


def test_bigger_trees_when_verifying_is_cheap():
    tree = chain(200, 0.97)
    flat = controller([math.log(0.01), math.log(1e-6), math.log(1e-6), 0.0], args=ARGS)  # verify cost ~constant
    steep = controller([math.log(1e-4), math.log(50.0), math.log(1e-6), 0.0], args=ARGS)  # compute-bound from 1 token
    assert flat.size([tree], [100])[0].n_nodes == 200
    assert steep.size([tree], [100])[0].n_nodes < 20


def test_the_controller_asks_for_trees_one_level_deeper_than_its_last():
    from bastion.budget.fixed import FixedBudget

    assert FixedBudget(5).max_depth() == 5  # n nodes are at most n deep
    steep = controller([math.log(1e-4), math.log(50.0), math.log(1e-6), 0.0], args=ARGS)
    assert steep.max_depth() == 256  # nothing chosen yet: as deep as its budget
    n = steep.size([chain(200, 0.97)], [100])[0].n_nodes
    assert 1 <= n < 20 and steep.max_depth() == n + 1
    steep.reset()  # a new prompt
    assert steep.max_depth() == 256


def stepped(n: int) -> float:
    """A verify time that moves in steps of 4 tokens, as tiled matmul kernels cost: 1-4, 5-8, ..."""
    return 0.020 + 0.004 * ((n - 1) // 4)


@pytest.mark.parametrize("noise", [0.0, 0.01])
def test_measured_sizes_correct_the_curve_and_the_controller_takes_a_steps_last_size(noise):
    """The curve cannot follow steps; sizes measured correct it (to their median, through a
    little timing noise), and a controller that sees them stops at the last size a step pays
    for, not short of it."""
    rng = np.random.default_rng(0)
    budget = controller(TRUE_CPU)
    model = budget.latency
    for n in range(1, 17):
        for _ in range(3):
            model.observe_forward([n], [300], stepped(n) * math.exp(rng.normal(0, noise)))
    model.fit(fit_shape=True)
    sizes = np.arange(1, 17)[:, None]
    predicted = model.predict(sizes, np.full_like(sizes, 300))
    np.testing.assert_allclose(predicted, [stepped(n) for n in range(1, 17)], rtol=1e-9 + 3 * noise)
    past = model.predict(np.array([[17, 16]]).T, np.array([[300, 300]]).T) / model.predict(np.array([[17, 16]]).T, np.array([[300, 300]]).T, corrected=False)
    assert past[0] == pytest.approx(past[1])  # past the measured sizes: the largest's correction
    budget.recent.drafted.append((0.0, 0.0, 2.0, 0.02))
    chosen = budget.size([chain(15, 0.9)], [300])[0].n_nodes + 1  # tokens forwarded: the root too
    assert chosen % 4 == 0  # the last size of its step


def smooth(n: int) -> float:
    """A verify time that grows smoothly with the tokens forwarded."""
    return 0.020 + 0.002 * n


@pytest.mark.parametrize("seed", range(6))
def test_sizes_whose_corrections_are_noise_are_forecast_by_the_curve(seed, monkeypatch):
    """Every size measured twice with 10% timing noise around a smooth cost: their medians are
    noise, and a controller trusting them takes the size the noise made cheapest; shrunk, it
    forecasts every size near its true cost and takes a size within 1% of the best."""
    rng = np.random.default_rng(seed)
    exact, noisy = controller(TRUE_CPU), controller(TRUE_CPU)
    for n in range(1, 17):
        for _ in range(2):
            exact.latency.observe_forward([n], [300], smooth(n))
            noisy.latency.observe_forward([n], [300], smooth(n) * math.exp(rng.normal(0, 0.1)))
    tree = chain(15, 0.9)
    for budget in (exact, noisy):
        budget.latency.fit(fit_shape=True)
        budget.recent.drafted.append((0.0, 0.0, 2.0, 0.02))
    *_, true_speedup = exact.curve([tree], [300])
    sizes = np.arange(1, 17)[:, None]
    error = np.log(noisy.latency.predict(sizes, np.full_like(sizes, 300)) / [smooth(n) for n in range(1, 17)])
    assert np.abs(error).mean() < 0.04
    assert true_speedup[noisy.size([tree], [300])[0].n_nodes] >= 0.99 * true_speedup.max()
    monkeypatch.setattr(bastion.budget.latency, "shrunk", lambda residuals: np.array([np.median(r) for r in residuals]))
    noisy.latency.correct()  # unshrunk medians: the noise itself
    raw = np.log(noisy.latency.predict(sizes, np.full_like(sizes, 300)) / [smooth(n) for n in range(1, 17)])
    assert np.abs(raw).mean() > max(1.5 * np.abs(error).mean(), 0.04)


@pytest.mark.parametrize("drift", [1.4, 0.7])
def test_a_probe_taken_at_another_pace_keeps_its_shape_not_its_level(drift):
    """The probe ran when the machine was `drift` times slower (or faster) than today; today's
    run measures only the sizes it picks. Every size is then forecast at today's pace, steps
    included: a size only the probe measured is not priced at the probe's pace."""
    model = controller(TRUE_CPU).latency
    for n in range(1, 17):
        flops, moved = model.cost.flops_bytes(np.array([n]), np.array([300]))
        model.probed[n] = (float(flops), float(moved), drift * stepped(n))
    model.fit(fit_shape=True, prior_weight=1e-3)
    for _ in range(SIZE_POINTS):
        for n in (6, 7):
            model.observe_forward([n], [300], stepped(n))
    model.fit(fit_shape=True)
    assert model.level == pytest.approx(math.log(drift), abs=0.02)
    sizes = np.arange(1, 17)[:, None]
    np.testing.assert_allclose(model.predict(sizes, np.full_like(sizes, 300)), [stepped(n) for n in range(1, 17)], rtol=0.02)


def measured(verify_s, accepted=0.0, a_hat=0.0, draft_s=0.0, nodes=1, path=None):
    """A one-row Step as the engine reports it (nodes=0: an AR step; `path`: its accepted tree
    indices, root included, where known)."""
    return SimpleNamespace(draft_s=draft_s, other_s=0.0, verify_s=verify_s, produced=[1 + accepted], expected=[a_hat],
                           tree_sizes=[nodes], drafted=nodes > 0, paths=[] if path is None else [path])


def test_wrong_profile_corrects_itself_online():
    """Started with the H100 prior on a (simulated) CPU, the chosen size approaches the one the
    true latency gives, from measured verify times alone."""
    truth = synthetic_truth(TRUE_CPU)
    tree = chain(256, 0.93)
    right = controller(TRUE_CPU).size([tree], [300])[0].n_nodes
    wrong = controller(None, H100)
    chosen = []
    for _ in range(20):
        sized = wrong.size([tree], [300])[0]
        n, a_hat = sized.n_nodes, sized.expected_accepted()
        chosen.append(n)
        seconds = float(truth.predict(np.array([n + 1]), np.array([300])))
        wrong.observe(measured(seconds, a_hat, a_hat), [300], n + 1)  # the drafter as good as it believes
    assert all(abs(n - right) <= 0.2 * right for n in chosen[-5:]), (right, chosen)
    assert chosen[0] > 2 * right  # it did start far off


@pytest.mark.parametrize("refit_every", [1000, 16])
@pytest.mark.parametrize("follow_pace", [True, False])
def test_verify_prices_follow_the_machines_pace_within_a_few_steps(refit_every, follow_pace):
    """The machine slows by 30% in the middle of a decode (another process took part of it):
    within a few drafted steps every verify price runs at the new pace, not only from the next
    refit on, as the step's other costs do (without the pace: 30% low until then), and refits
    do not leave it off."""
    truth = synthetic_truth(TRUE_CPU)
    budget = controller(TRUE_CPU)
    budget.refit_every, budget.follow_pace = refit_every, follow_pace
    budget.recent.drafted.append((0.001, 0.0, 2.0, 0.02))
    errors = []  # log(measured / forecast) verify time, step by step
    for step in range(40):
        sized = budget.size([chain(15, 0.9)], [300])[0]
        seconds = (1.3 if step >= 4 else 1.0) * float(truth.predict(np.array([sized.n_nodes + 1]), np.array([300])))
        errors.append(math.log(seconds / budget.predicted_s))
        budget.observe(measured(seconds, 1.0, sized.expected_accepted(), nodes=sized.n_nodes), [300], sized.n_nodes + 1)
    assert max(abs(e) for e in errors[:4]) < 0.01 and errors[4] == pytest.approx(math.log(1.3), abs=0.01)
    if not follow_pace:  # budget.follow_pace=false, the ablation: 30% low until a refit
        assert min(errors[4:15]) > 0.25
        return
    assert np.mean(np.abs(errors[9:])) < 0.03 and max(abs(e) for e in errors[-8:]) < 0.02, np.round(errors, 3)
    assert budget.predict(6, [300]) == pytest.approx(1.3 * float(truth.predict(np.array([6]), np.array([300]))), rel=0.05)


def test_an_overconfident_drafter_gets_smaller_trees():
    """Accepted tokens at 30% of A_hat (MT-Bench's measured ratio): the controller learns the
    ratio and sizes trees by it."""
    truth = synthetic_truth(TRUE_CPU)
    tree = chain(256, 0.93)
    budget = controller(TRUE_CPU)
    trusting = budget.size([tree], [300])[0].n_nodes
    for _ in range(60):
        sized = budget.size([tree], [300])[0]
        seconds = float(truth.predict(np.array([sized.n_nodes + 1]), np.array([300])))
        budget.observe(measured(seconds, 0.3 * sized.expected_accepted(), sized.expected_accepted()), [300], sized.n_nodes + 1)
    assert budget.acceptance_ratio == pytest.approx(0.3, abs=0.03)
    assert budget.size([tree], [300])[0].n_nodes < trusting
    assert controller(TRUE_CPU).size([tree], [300])[0].n_nodes == trusting  # the uncalibrated choice


@pytest.mark.parametrize("seed", range(3))
def test_a_drafter_overconfident_past_its_first_nodes_gets_the_best_size(seed):
    """A chain drafter right about its first 3 nodes (each accepted w.p. 0.93 after its parent,
    as it believes) and overconfident past them (0.55): measured per rank from the accepted
    paths, the controller sizes at the true best; with one ratio over all ranks (paths unknown,
    as for children drawn after sizing, or budget.per_rank=false) it values the 4th node
    onwards at the average and sizes far past it."""
    truth, tree = synthetic_truth(TRUE_CPU), chain(64, 0.93)
    follows = np.array([0.93 if j <= 3 else 0.55 for j in range(1, 65)])  # P(node j accepted | its parent was)
    reach = np.cumprod(follows)  # P(node j accepted)

    def true_speedup(n):
        seconds = truth.predict(np.array([[1], [n + 1]]), np.array([[300], [300]]))  # [2]: AR, the tree
        return (1 + reach[:n].sum()) * seconds[0] / seconds[1]

    best = max(true_speedup(n) for n in range(1, 65))
    for paths_known, per_rank, lo, hi in ((True, True, 0.98, 1.0), (False, True, 0.0, 0.85), (True, False, 0.0, 0.85)):
        rng, budget = np.random.default_rng(seed), controller(TRUE_CPU)
        budget.per_rank = per_rank
        chosen = []
        for _ in range(80):
            n = budget.size([tree], [300])[0].n_nodes
            accepted = rng.random(n) < follows[:n]
            k = n if accepted.all() else int(np.argmin(accepted))  # the accepted path's draft nodes
            seconds = float(truth.predict(np.array([n + 1]), np.array([300])))
            budget.observe(measured(seconds, k, tree.truncate(n).expected_accepted(), nodes=n,
                                    path=list(range(k + 1)) if paths_known else None), [300], n + 1)
            chosen.append(n)
        speedups = sorted(true_speedup(n) / best for n in chosen[-20:])
        assert lo <= speedups[10] <= hi, (paths_known, per_rank, chosen[-20:])  # the median of the last 20 choices
        assert budget.rank_ratios()[-1] == pytest.approx(budget.acceptance_ratio)  # ranks never verified: the pooled ratio
        assert (budget.rank_ratios()[3] < 0.8 * budget.rank_ratios()[0]) == (paths_known and per_rank)


def test_acceptance_is_measured_against_the_trees_the_controller_priced():
    """Sampled children (T > 0) replace the sized trees by drawn ones of lower A_hat (the step's
    `expected`); the ratio that scales the sized trees' A_hat must be taken against theirs."""
    budget, tree = controller(TRUE_CPU), chain(256, 0.93)
    for _ in range(60):
        sized = budget.size([tree], [300])[0]
        budget.observe(measured(0.05, 0.5 * sized.expected_accepted(), 0.1 * sized.expected_accepted()), [300], sized.n_nodes + 1)
    assert budget.acceptance_ratio == pytest.approx(0.5, abs=0.05)


def test_drafting_stops_while_no_tree_beats_ar_and_is_retried():
    """Before any measurement the forecast judges; a retry after an AR stretch is judged on
    the drafted steps measured since the stretch alone (failing on its first, paying after
    EVIDENCE), each failed retry doubles the next stretch, and a stretch outlives its decode."""
    budget = controller(TRUE_CPU)
    budget.recent.drafted.append((0.03, 0.0, 1.0, 0.1))  # drafting costs ~half an AR step (one drafted step measured)
    weak = chain(8, 0.05)
    assert budget.drafts()
    budget.size([weak], [300])  # no size beats AR: an AR stretch of at least 8 steps follows
    budget.observe(measured(0.1, accepted=1.0, a_hat=0.1, draft_s=0.003), [300], 9)  # the step it judged, measured after
    first = budget.stretch.left
    assert first >= 8 and [budget.drafts() for _ in range(first)] == [False] * (first - 1) + [True]  # the last one retries
    measured_cost = 0.1 / float(budget.predict(1, [300]))  # its retry priced by the drafted step measured, not the forecast
    assert first == max(8, math.ceil((measured_cost - 1) / budget.stretch.waste - 1e-9))

    def retry(seconds):  # drafted steps of 2 tokens: the step whose measurement starts a stretch
        for n in range(budget.recent.EVIDENCE + 2):
            budget.size([weak], [300])
            budget.observe(measured(seconds, accepted=1.0, a_hat=0.1, draft_s=0.003), [300], 9)
            if budget.stretch.left > 0:
                return n
        return None

    for _ in range(3):
        budget.observe(measured(0.025, nodes=0), [300], 1)  # AR steps: 25 ms
    assert retry(0.1) == 0  # 2 tokens in 100 ms: the retry fails once measured, before another draft is spent
    second, retry_cost = budget.stretch.left, budget.recent.quickest_s / 0.025  # a drafted step measured at ~4 AR steps
    assert second == max(2 * first, math.ceil((retry_cost - 1) / budget.stretch.waste))  # doubled, and its retry wastes <= 5%
    assert [budget.drafts() for _ in range(second)] == [False] * (second - 1) + [True]
    assert retry(0.031) is None and budget.drafts()  # 2 tokens in 31 ms: drafting is back, whatever the forecast
    assert budget.stretch.next == 8
    assert retry(0.3) is not None  # drafting stops paying again
    left = budget.stretch.left
    budget.reset()  # a new decode (another prompt): the stretch runs on into it, and its retry is judged alone
    assert [budget.drafts() for _ in range(left)] == [False] * (left - 1) + [True] and budget.recent.retrying
    for _ in range(left - 1):
        budget.observe(measured(0.025, nodes=0), [300], 1)
    assert retry(0.3) == 0  # the retry, its decode's first drafted step but not its first step, is judged once measured


@pytest.mark.parametrize("tokens, retry_stops", [((2, 5, 3, 6), False), ((1, 2, 1, 2), True)])
def test_one_unlucky_retry_does_not_stop_a_drafter_that_pays(tokens, retry_stops):
    """Drafted steps cost 3 AR steps. A drafter whose steps give 2-6 tokens (4 on average: it
    pays 1.33x) retries after a stretch and its first step gives 2 tokens: within a standard
    error of paying, so it drafts on and pays after EVIDENCE steps. One whose steps give 1-2
    tokens is stopped by its first retry step, as before."""
    budget = controller(TRUE_CPU)
    for _ in range(3):
        budget.observe(measured(0.025, nodes=0), [300], 1)  # AR steps: 25 ms
    for t in tokens * 2:
        budget.recent.drafted.append((0.03, 0.0, float(t), 0.075))  # drafted before the stretch: 75 ms each
    budget.stretch.failed(retry_cost=3.0)
    budget.recent.restart()
    left = budget.stretch.left
    assert [budget.drafts() for _ in range(left)] == [False] * (left - 1) + [True]  # the retry
    budget.observe(measured(0.075, accepted=min(tokens) - 1.0), [300], 8)  # its first step: the drafter's fewest tokens
    assert (budget.stretch.left > 0) == retry_stops
    if not retry_stops:
        for t in tokens[1:]:
            budget.observe(measured(0.075, accepted=t - 1.0), [300], 8)
            assert budget.drafts()
        assert budget.stretch.next == budget.stretch.first  # judged to pay: the next stretch starts short again


def test_an_ar_step_is_measured_before_drafting_stops_on_a_forecast_of_one():
    """Drafted steps give 3 tokens in 300 ms (their verify forwards as forecast). Priced by the
    probe-fitted model (an AR step forecast at ~85 ms) they would not pay, so one AR step is
    measured first: at 120 ms they pay 1.2x and drafting goes on; at 90 ms they do not, and
    drafting stops."""
    def stops(ar_measured_s):
        budget = controller(TRUE_CPU)
        assert budget.ar_step_s([300]) == pytest.approx(0.085, abs=0.001)
        drafted = measured(float(budget.predict(8, [300])), accepted=2.0, draft_s=0.175)  # 125 + 175 ms
        for _ in range(budget.recent.EVIDENCE):
            budget.observe(drafted, [300], 8)
        assert [budget.drafts(), budget.drafts()] == [False, True] and budget.stretch.left == 0  # one AR step, then drafting
        budget.observe(measured(ar_measured_s, nodes=0), [300], 1)
        budget.observe(drafted, [300], 8)
        return budget.stretch.left > 0

    assert not stops(0.120) and stops(0.090)


def test_an_ar_step_is_measured_before_drafting_goes_on_by_the_probes_price():
    """Drafted steps of 3 tokens in 200 ms pay 1.3x by the probe's AR step (~85 ms), so they
    would draft on; one AR step is measured first, and at 60 ms drafting stops."""
    budget = controller(TRUE_CPU)
    drafted = measured(float(budget.predict(8, [300])), accepted=2.0, draft_s=0.075)  # 125 + 75 ms
    for _ in range(budget.recent.EVIDENCE):
        budget.observe(drafted, [300], 8)
    assert [budget.drafts(), budget.drafts()] == [False, True]  # one AR step, then drafting
    budget.observe(measured(0.060, nodes=0), [300], 1)
    budget.observe(drafted, [300], 8)
    assert budget.stretch.left > 0  # 3 tokens in 200 ms against 60 ms AR steps: 0.9x


def test_a_burst_of_load_does_not_lengthen_the_stretch():
    """Drafted steps that a burst of load slowed tenfold (every other one) judge that drafting
    does not pay, yet the stretch is sized by what a retry costs on the quiet machine: 8 steps,
    not the (median step / AR step - 1) / 5% the slow steps would ask for."""
    budget = controller(TRUE_CPU)
    for _ in range(3):
        budget.observe(measured(0.025, nodes=0), [300], 1)  # AR steps: 25 ms
    for n in range(budget.recent.EVIDENCE + 1):
        budget.observe(measured(0.03 if n % 2 else 0.3, accepted=0.5, a_hat=0.5), [300], 2)
        if budget.stretch.left:
            break
    assert np.median([step_s for *_, step_s in budget.recent.drafted]) / 0.025 > 5 and budget.stretch.left == 8


@pytest.mark.parametrize("budget_kind", ["bastion", "fixed"])
def test_a_draft_through_the_target_is_priced_before_it_is_measured(budget_kind):
    """A drafter whose draft is a forward through the target's own layers (FlexDraft: a group
    of 8 tokens) is priced by the latency model at its first step, before it has measured one:
    where that forward and the verify outweigh the tokens the drafter believes in, the first
    step already starts an AR stretch; a small drafter (no such forward) drafts on."""
    from bastion.budget.fixed import FixedBudget

    def judged(draft_tokens: int) -> bool:
        budget = controller(TRUE_CPU) if budget_kind == "bastion" else FixedBudget(4, pause_drafting=True)
        budget.latency = controller(TRUE_CPU).latency
        budget.draft_tokens = draft_tokens
        budget.reset()
        budget.size([chain(4, 0.7)] * 4, [300] * 4)  # 4 rows: A_hat 1.8 tokens a row beyond the bonus
        return budget.stretch.left > 0

    assert judged(draft_tokens=8) and not judged(draft_tokens=0)


def test_step_costs_are_medians_that_one_cold_step_does_not_move():
    """The first drafted step of a decode also reads the prompt into the drafter (90 ms here
    against 4 ms): it must not price drafting."""
    budget = controller(TRUE_CPU)
    budget.reset()
    budget.observe(measured(0.03, draft_s=0.090), [300], 2)
    for _ in range(4):
        budget.observe(measured(0.03, draft_s=0.004), [300], 2)
    assert budget.recent.draft_s == pytest.approx(0.004)


def test_ar_stretches_double_and_outlast_their_retry():
    stretch = ARStretch()
    stretch.failed(retry_cost=1.2)  # a retry wastes 0.2 AR steps: 2.5% of 8
    assert (stretch.left, stretch.next) == (8, 16)
    stretch.failed(retry_cost=4.5)  # a batch of 16 on a CPU: 3.5 AR steps wasted need >= 70 steps
    assert (stretch.left, stretch.next) == (70, 140)
    stretch.failed(retry_cost=4.5)
    assert (stretch.left, stretch.next) == (140, 256)
    stretch.failed(retry_cost=50.0)  # never longer than 256
    assert (stretch.left, stretch.next) == (256, 256)
    assert [stretch.skip() for _ in range(257)] == [True] * 255 + [False, False]
    stretch.paid()
    assert stretch.next == 8


def test_profiles_and_bad_budgets():
    cfg = {"name": "h100", "peak_tflops": {"bfloat16": 989}, "memory_gbs": 3350}
    assert profile_from_config(cfg, "cpu", []).memory_gbs == 3350
    measured = profile_from_config({"name": "auto"}, "cpu", [cfg])
    assert measured.name == "measured-cpu" and set(measured.peak_tflops) == {"float32", "bfloat16", "float16"}
    # each dtype timed itself: bfloat16 matmuls run several times faster (AMX) or hundreds of times slower
    # (no bf16 kernels) than float32 on a CPU, never at the same pace
    assert measured.flops_per_s(torch.bfloat16) != measured.flops_per_s(torch.float32)
    with pytest.raises(ValueError, match="max_nodes must be at least 1"):
        BastionBudget(max_nodes=0)


BUSY_PROBE = [[0.224, 0.230, 0.221], [0.479, 0.470, 0.481], [0.190, 0.188, 0.195], [0.66, 0.65, 0.67]]  # a probe taken under load
IDLE_PROBE = [[0.0263, 0.0265, 0.0262], [0.0268, 0.0270, 0.0266], [0.0268, 0.0268, 0.0269], [0.0278, 0.0279, 0.0277]]


def test_probe_timings_a_busy_machine_disturbed_are_named():
    sizes = (1, 2, 4, 8)
    assert probe_problem(sizes, IDLE_PROBE) is None
    assert probe_problem(sizes, BUSY_PROBE) == "479.0 ms for 2 tokens but 190.0 ms for 4"
    assert probe_problem(sizes, [[0.03, 0.09, 0.08], *IDLE_PROBE[1:]]) == "repeats of the 1-token forward from 30.0 to 90.0 ms"
    assert probe_problem(sizes, [[0.03, 0.09, 0.03], *IDLE_PROBE[1:]]) is None  # one slow repeat: the median absorbs it
    assert probe_problem(sizes, [[4e-4], [9e-4], [3e-4], [5e-4]]) is None  # sub-millisecond forwards: jitter


def fake_probes(monkeypatch, *results):
    """probe_times returns `results` in turn (then the last again); returns the call count."""
    calls = []

    def times(target, sizes, context, repeats):
        calls.append(1)
        return results[min(len(calls), len(results)) - 1]

    monkeypatch.setattr(bastion.budget.latency, "probe_times", times)
    return calls


def test_a_busy_probe_is_measured_again_then_refused(tiny_qwen3, monkeypatch):
    model = LatencyModel.from_profile(tiny_qwen3.args, tiny_qwen3.dtype, HardwareProfile("cpu", {"float64": 0.05}, 8.0))
    calls = fake_probes(monkeypatch, BUSY_PROBE, IDLE_PROBE)
    with pytest.warns(UserWarning, match="measuring again"):
        probe(tiny_qwen3, model, sizes=(1, 2, 4, 8))
    assert len(calls) == 2 and len(model.probed) == 4
    fake_probes(monkeypatch, BUSY_PROBE)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="the machine looks busy. Rerun when it is idle"):
        probe(tiny_qwen3, model, sizes=(1, 2, 4, 8))


def test_a_cached_fit_serves_only_its_machine_and_profile(tiny_qwen3, monkeypatch, tmp_path):
    calls = fake_probes(monkeypatch, IDLE_PROBE)
    cpu = HardwareProfile("cpu", {"float64": 0.05}, 8.0)
    fresh = calibrated(tiny_qwen3, cpu, tmp_path)
    cached = calibrated(tiny_qwen3, cpu, tmp_path)
    assert len(calls) == 1  # cached, with the measured sizes' corrections
    assert cached.probed == fresh.probed and len(cached.probed) == 4
    np.testing.assert_allclose(cached.correction, fresh.correction)
    (path,) = (tmp_path / "latency").glob("*.json")
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({"theta": saved["theta"], "points": list(saved["probed"].values())}))
    calibrated(tiny_qwen3, cpu, tmp_path)
    assert len(calls) == 2  # a calibration from before the probe kept its own level is measured again
    calls.pop()
    calibrated(tiny_qwen3, HardwareProfile("measured-cpu", {"float64": 0.1}, 20.0), tmp_path)
    assert len(calls) == 2  # another profile: another prior, another fit
    monkeypatch.setattr(bastion.budget.latency, "device_name", lambda device: "Another CPU")
    calibrated(tiny_qwen3, cpu, tmp_path)
    assert len(calls) == 3 and len(list((tmp_path / "latency").glob("*.json"))) == 3


def test_a_cached_fit_names_the_cpu_attention_path_of_a_half_precision_target(monkeypatch, tmp_path):
    """sdpa() runs half-precision queries on a CPU as matmuls or by the flash kernel, by what the
    CPU is and what was measured there: a fit taken on one path must not price the other."""
    calls = fake_probes(monkeypatch, IDLE_PROBE)
    bf16 = load_target(**target_config("tiny_qwen3", dtype="bfloat16"))
    cpu = HardwareProfile("cpu", {"bfloat16": 0.05}, 8.0)
    for matmuls in (True, False, True):
        monkeypatch.setattr(bastion.models.attention, "cpu_matmuls_beat_flash", lambda m=matmuls: m)
        calibrated(bf16, cpu, tmp_path)
    assert len(calls) == 2  # one probe per path, the third calibration from the first's cache
    files = list((tmp_path / "latency").glob("*.json"))
    assert sorted(p.name.split("__")[6] for p in files) == ["sdpa-flash", "sdpa-matmul"]
    assert all(p.name.split("__")[1] == f"torch{torch.__version__}".replace("+", "_") for p in files)  # other kernels, other times
    assert attention_path("sdpa", "cpu", torch.float32) == "sdpa" and attention_path("flex", "cuda", torch.bfloat16) == "flex"


def test_a_cpu_is_known_by_its_family_and_model_too():
    """A cloud CPU may be named "AMD EPYC" whatever its generation: a Zen 3 and a Zen 5 (3x apart
    here) must not share a latency fit or a run dir."""
    def cpuinfo(family, model):
        core = f"processor\t: {{}}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: AMD EPYC\n"
        return "\n".join(core.format(i) for i in range(2))  # processors one after another, a blank line apart

    assert cpu_model(cpuinfo(25, 1)) == "AMD EPYC (family 25, model 1)"
    assert cpu_model(cpuinfo(26, 2)) == "AMD EPYC (family 26, model 2)"
    assert cpu_model("model name\t: Some CPU\n") == "Some CPU" and cpu_model("") == ""


def test_a_gpu_profile_on_the_cpu_warns():
    h100 = {"name": "h100", "peak_tflops": {"bfloat16": 989.0}, "memory_gbs": 3350.0}
    with pytest.warns(UserWarning, match="gpu=h100 describes a GPU but this run is on the CPU"):
        assert profile_from_config(h100, "cpu", []).name == "h100"


def test_the_probe_times_real_forwards_in_passes_over_every_size(tiny_qwen3, monkeypatch):
    """A slow second must slow one time of every size, which the medians drop, not all of one size's."""
    forwarded = []
    forward = tiny_qwen3.forward
    monkeypatch.setattr(tiny_qwen3, "forward", lambda tokens, *rest: forwarded.append(tokens.shape[1]) or forward(tokens, *rest))
    times = bastion.budget.latency.probe_times(tiny_qwen3, (1, 4), context=16, repeats=2)  # [sizes][repeats]
    assert len(times) == 2 and all(len(ts) == 2 and all(t > 0 for t in ts) for ts in times)
    assert forwarded == [1, 4] * 3  # an untimed pass, then two timed


def test_a_probe_size_slower_than_a_larger_one_is_pooled_with_it(tiny_qwen3, monkeypatch, tmp_path):
    """A forward's cost only grows with its tokens: a probe median above a larger size's is noise
    and, kept, would price its size off the controller's choices for good. Sizes out of order
    are pooled (geometric mean); a real step of the kernels (flat, then a jump) is kept."""
    stepped = [[0.040] * 3, [0.040] * 3, [0.052] * 3, [0.046] * 3, [0.060] * 3]  # sizes 1-5: 3 tokens at 52 ms, 4 at 46
    fake_probes(monkeypatch, stepped)
    model = calibrated(tiny_qwen3, HardwareProfile("cpu", {"float64": 0.05}, 8.0), tmp_path)
    seconds = {n: point[2] for n, point in model.probed.items()}
    pooled = math.sqrt(0.052 * 0.046)
    assert seconds == pytest.approx({1: 0.040, 2: 0.040, 3: pooled, 4: pooled, 5: 0.060})
    (path,) = (tmp_path / "latency").glob("*.json")
    saved = json.loads(path.read_text())
    saved["probed"]["3"][2], saved["probed"]["4"][2] = 0.052, 0.046  # a file cached before probes were pooled
    path.write_text(json.dumps(saved))
    cached = calibrated(tiny_qwen3, HardwareProfile("cpu", {"float64": 0.05}, 8.0), tmp_path)
    assert cached.probed[3][2] == pytest.approx(pooled)


def test_sizes_between_measured_ones_take_their_neighbours_corrections():
    """Only the probe's sizes are measured, 16 apart past 16 (24, 32, 48, ...) and all above a
    smooth curve (here 25%): a size between two of them is forecast from its neighbours'
    corrections, not from the bare curve, which would make it look cheaper than both, and the
    controller would jump to it."""
    model = controller(TRUE_CPU).latency
    for n in (*range(1, 17), 24, 32, 48):
        flops, moved = model.cost.flops_bytes(np.array([n]), np.array([300]))
        model.probed[n] = (float(flops), float(moved), 1.25 * float(model.predict(np.array([[n]]), np.array([[300]]), corrected=False)[0]))
    model.correct()
    sizes = np.arange(1, 49)[:, None]
    ratio = model.predict(sizes, np.full_like(sizes, 300)) / model.predict(sizes, np.full_like(sizes, 300), corrected=False)
    np.testing.assert_allclose(ratio, 1.25, rtol=1e-9)  # measured sizes and the sizes between them alike
    assert model.predict(np.array([[64]]), np.array([[300]]))[0] == pytest.approx(1.25 * model.predict(np.array([[64]]), np.array([[300]]), corrected=False)[0])  # past them: the largest's
    model.probed[32] = (*model.probed[32][:2], model.probed[32][2] / 1.25)  # one size on the curve: a straight line to it
    model.correct()
    corrections = model.correction[[24, 28, 32, 40, 48]]
    assert corrections[0] > corrections[1] > corrections[2] < corrections[3] < corrections[4]
    np.testing.assert_allclose(corrections[1], (corrections[0] + corrections[2]) / 2)


def test_a_size_measured_in_a_slow_minute_is_priced_by_the_probe_again_once_its_times_expire():
    """The pace drifts within a run: a size measured only in a slow minute (here 1.5x) and not
    chosen since would keep that minute's pace as its correction for good, while the sizes the
    controller goes on choosing follow the pace back, and it would never be chosen again. Its
    times count for RECENT forwards; then the probe's point prices it again."""
    model = controller(TRUE_CPU).latency

    def curve(n: int) -> float:
        return float(model.predict(np.array([[n]]), np.array([[300]]), corrected=False)[0])

    for n in range(1, 17):
        flops, moved = model.cost.flops_bytes(np.array([n]), np.array([300]))
        model.probed[n] = (float(flops), float(moved), curve(n))
    rng = np.random.default_rng(0)
    for _ in range(8):
        model.observe_forward([6], [300], 1.5 * curve(6) * math.exp(rng.normal(0, 0.01)))
    model.correct()
    assert model.correction[6] > 0.3  # its repeats agree: as far as they tell, a real step of the kernels
    for expired in (False, True):
        for i in range(RECENT - 8 if not expired else 8):
            n = 4 if i % 2 else 11
            model.observe_forward([n], [300], curve(n) * math.exp(rng.normal(0, 0.01)))
        model.correct()
        if expired:  # 64 forwards since its last time
            assert abs(model.correction[6]) < 0.02
        else:  # all its times are within the last 64 forwards
            assert model.correction[6] > 0.3
