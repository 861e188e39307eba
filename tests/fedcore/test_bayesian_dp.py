"""Bayesian DP and classic (RDP) accountants of PP-FCIL's local DP-SGD."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp
from scipy.special import logsumexp
from scipy.stats import norm

from fedcore.privacy.bayesian import (
    ACCOUNTANTS,
    DEFAULT_ORDERS,
    BayesianAccountant,
    ClassicAccountant,
    balle_epsilon,
    bdp_step_cost,
    calibrate_sigma_bdp,
    calibrate_sigma_classic,
    chernoff_epsilon,
    cost_epsilon,
    create_accountant,
)

LAM = np.asarray(DEFAULT_ORDERS)
DELTA = 1e-5
SETTINGS = [(0.01, 1.0), (0.05, 0.8), (0.2, 1.5), (0.5, 3.0), (0.004, 1.2)]  # (q, sigma)


def opacus_rdp(q: float, sigma: float, orders=LAM) -> np.ndarray:
    return np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=[float(a) for a in orders + 1]))


def spread_norms(n: int = 128, lo: float = 0.05, hi: float = 0.6, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(lo, hi, n)


def bdp_eps(sq_norms, q, sigma, steps, delta=DELTA, conversion="balle", **kw) -> float:
    cost = bdp_step_cost(sq_norms=sq_norms, q=q, sigma=sigma, orders=LAM, **kw)
    return cost_epsilon(total_cost=steps * cost, orders=LAM, delta=delta, conversion=conversion)[0]


# ------------------------------------------------------------------------------------ goldens
@pytest.mark.parametrize("estimator", ["mean", "ucb"])
@pytest.mark.parametrize("q,sigma", SETTINGS)
def test_all_clipped_cost_equals_opacus_rdp(q, sigma, estimator):
    # Prepare
    ones = np.ones(16)
    # Execute
    cost = bdp_step_cost(sq_norms=ones, q=q, sigma=sigma, orders=LAM, estimator=estimator)
    # Assert: c(λ)/λ is the RDP of order λ + 1
    np.testing.assert_allclose(cost / LAM, opacus_rdp(q, sigma), rtol=1e-9, atol=0)


def test_all_clipped_epsilon_under_chernoff_is_the_moments_accountant_bound():
    # Prepare
    q, sigma, steps = 0.02, 1.1, 700
    alpha = LAM + 1.0
    expected = np.min(steps * opacus_rdp(q, sigma) + math.log(1 / DELTA) / (alpha - 1))
    # Execute
    eps = bdp_eps(np.ones(8), q, sigma, steps, conversion="chernoff")
    # Assert
    assert eps == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("estimator", ["mean", "ucb"])
@pytest.mark.parametrize("d,sigma", [(1.0, 1.0), (0.5, 0.7), (0.3, 2.0), (0.0, 1.0)])
def test_full_batch_constant_norm_golden(d, sigma, estimator):
    # Prepare: q = 1, every record at the same d, so the binomial is a point mass at λ + 1
    sq = np.full(10, d * d)
    expected = LAM * (LAM + 1) * d * d / (2 * sigma**2)
    # Execute
    cost = bdp_step_cost(sq_norms=sq, q=1.0, sigma=sigma, orders=LAM, estimator=estimator)
    # Assert
    np.testing.assert_allclose(cost, expected, rtol=1e-12, atol=1e-12)


def test_mean_estimator_matches_the_definition_evaluated_directly():
    # Prepare: small orders, where plain floating point is exact enough
    from scipy.stats import binom

    q, sigma, orders = 0.1, 1.3, np.arange(1, 9)
    sq = spread_norms(7, 0.0, 1.0, seed=3)
    expected = []
    for lam in orders:
        k = np.arange(lam + 2)
        per_record = [np.sum(binom.pmf(k, lam + 1, q) * np.exp((k * k - k) * s / (2 * sigma**2))) for s in sq]
        expected.append(math.log(np.mean(per_record)))
    # Execute
    cost = bdp_step_cost(sq_norms=sq, q=q, sigma=sigma, orders=orders)
    # Assert
    np.testing.assert_allclose(cost, expected, rtol=1e-10)


@pytest.mark.parametrize("q,sigma,d", [(0.05, 1.0, 1.0), (0.3, 0.8, 0.6), (0.9, 2.0, 1.0)])
def test_cost_is_the_renyi_divergence_of_the_mixture_and_bounds_the_reverse_direction(q, sigma, d):
    # Prepare: μ0 = N(0, σ²) (without x'), μ = (1 − q) μ0 + q N(d, σ²) (with x'), by quadrature
    orders = np.arange(1, 9)
    z = np.linspace(-30 * sigma, 30 * sigma + 12 * d, 200_001)
    log_dz = math.log(z[1] - z[0])
    l0 = norm.logpdf(z, 0, sigma)
    l1 = np.logaddexp(math.log1p(-q) + l0, math.log(q) + norm.logpdf(z, d, sigma))
    forward = np.array([logsumexp((lam + 1) * l1 - lam * l0) + log_dz for lam in orders])  # λ·D_{λ+1}(μ‖μ0)
    reverse = np.array([logsumexp((lam + 1) * l0 - lam * l1) + log_dz for lam in orders])  # λ·D_{λ+1}(μ0‖μ)
    # Execute
    cost = bdp_step_cost(sq_norms=[d * d], q=q, sigma=sigma, orders=orders)
    # Assert: c(λ) is the forward divergence, which dominates the reverse one (so M_L alone suffices)
    np.testing.assert_allclose(cost, forward, rtol=1e-8, atol=1e-12)
    assert np.all(reverse <= cost + 1e-10)


# ------------------------------------------------------------------------------------ classic
@pytest.mark.parametrize("q,sigma", SETTINGS)
def test_classic_step_cost_is_lambda_times_rdp_and_the_d1_bayesian_cost(q, sigma):
    # Prepare
    acc = ClassicAccountant()
    # Execute
    cost = acc.step_cost(sq_norms=spread_norms(), q=q, sigma=sigma)
    # Assert: sq_norms is ignored, d = 1 is used
    np.testing.assert_allclose(cost, LAM * opacus_rdp(q, sigma), rtol=1e-12)
    np.testing.assert_allclose(cost, bdp_step_cost(sq_norms=[1.0], q=q, sigma=sigma, orders=LAM), rtol=1e-9)


def test_classic_epsilon_equals_opacus_rdp_accountant_on_the_same_history():
    # Prepare: a history that changes σ and q
    history = [(1.0, 0.01, 300), (1.4, 0.01, 200), (0.9, 0.05, 50)]
    ours, theirs = ClassicAccountant(), RDPAccountant()
    for sigma, q, steps in history:
        cost = ours.step_cost(sq_norms=None, q=q, sigma=sigma)
        for _ in range(steps):
            ours.spend(cost)
            theirs.step(noise_multiplier=sigma, sample_rate=q)
    # Execute
    eps = ours.epsilon(DELTA)
    expected = theirs.get_epsilon(delta=DELTA, alphas=[float(a) for a in LAM + 1])
    # Assert
    assert ours.steps == 550
    assert eps == pytest.approx(expected, rel=1e-9)


# ------------------------------------------------------------------------------------ monotonicity
def test_epsilon_decreases_as_sigma_grows():
    # Prepare
    sq, sigmas = spread_norms(), [0.6, 0.8, 1.0, 1.5, 2.5, 5.0]
    # Execute
    eps = [bdp_eps(sq, 0.02, s, 500) for s in sigmas]
    # Assert
    assert all(a > b for a, b in zip(eps, eps[1:]))


def test_epsilon_increases_with_steps():
    # Prepare
    sq, steps = spread_norms(), [1, 10, 100, 1000, 10_000]
    # Execute
    eps = [bdp_eps(sq, 0.02, 1.0, t) for t in steps]
    # Assert
    assert all(a < b for a, b in zip(eps, eps[1:]))


def test_smaller_norms_give_smaller_epsilon():
    # Prepare
    base = spread_norms(64, 0.0, 1.0)
    # Execute
    eps = [bdp_eps(base * s, 0.02, 1.0, 500) for s in (1.0, 0.7, 0.4, 0.1)]
    # Assert
    assert all(a > b for a, b in zip(eps, eps[1:]))


@pytest.mark.parametrize("estimator", ["mean", "ucb"])
def test_bayesian_never_costs_more_than_classic_when_norms_are_at_most_one(estimator):
    # Prepare: some records clipped (d = 1), most not
    sq = np.concatenate([spread_norms(60, 0.0, 1.0), np.ones(4)])
    bdp, classic = BayesianAccountant(estimator=estimator), ClassicAccountant()
    # Execute
    c_bdp = bdp.step_cost(sq_norms=sq, q=0.02, sigma=1.0)
    c_classic = classic.step_cost(sq_norms=sq, q=0.02, sigma=1.0)
    # Assert: per order, and as ε under either conversion
    assert np.all(c_bdp <= c_classic + 1e-12)
    for conversion in ("balle", "chernoff"):
        assert (
            cost_epsilon(total_cost=800 * c_bdp, orders=LAM, delta=DELTA, conversion=conversion)[0]
            <= cost_epsilon(total_cost=800 * c_classic, orders=LAM, delta=DELTA, conversion=conversion)[0]
        )


@pytest.mark.parametrize("conversion", ["balle", "chernoff"])
@pytest.mark.parametrize("estimator", ["mean", "ucb"])
def test_bayesian_and_classic_epsilon_are_equal_at_d1_and_bayesian_is_below_for_unclipped_gradients(
    conversion, estimator
):
    # Prepare: one history of σ and q, both accountants under one conversion
    history = [(1.0, 0.02, 500), (1.4, 0.02, 300)]
    bdp, classic = (
        BayesianAccountant(estimator=estimator, conversion=conversion),
        ClassicAccountant(conversion=conversion),
    )
    spread = BayesianAccountant(estimator=estimator, conversion=conversion)
    # Execute
    for sigma, q, steps in history:
        for _ in range(steps):
            bdp.spend(bdp.step_cost(sq_norms=np.ones(8), q=q, sigma=sigma))
            classic.spend(classic.step_cost(sq_norms=None, q=q, sigma=sigma))
            spread.spend(spread.step_cost(sq_norms=spread_norms(), q=q, sigma=sigma))
    # Assert: every gradient clipped, the same ε to rounding; most unclipped, far less
    assert bdp.epsilon(DELTA) == pytest.approx(classic.epsilon(DELTA), rel=1e-9)
    assert spread.epsilon(DELTA) < 0.6 * classic.epsilon(DELTA)


def test_balle_conversion_is_opacus_and_never_above_chernoff():
    # Prepare
    cost = 800 * bdp_step_cost(sq_norms=np.ones(4), q=0.02, sigma=1.0, orders=LAM)
    theirs = RDPAccountant()
    theirs.history = [(1.0, 0.02, 800)]
    # Execute
    balle = balle_epsilon(total_cost=cost, orders=LAM, delta=DELTA)[0]
    chernoff = chernoff_epsilon(total_cost=cost, orders=LAM, delta=DELTA)[0]
    # Assert
    assert balle == pytest.approx(theirs.get_epsilon(DELTA, alphas=[float(a) for a in LAM + 1]), rel=1e-9)
    assert balle < chernoff
    with pytest.raises(ValueError, match="conversion"):
        cost_epsilon(total_cost=cost, orders=LAM, delta=DELTA, conversion="rdp")


# ------------------------------------------------------------------------------------ UCB
def test_ucb_bounds_the_mean_and_tightens_with_more_samples():
    # Prepare
    sq = spread_norms(32, 0.0, 1.0)
    more = np.tile(sq, 16)  # same empirical distribution, 16 times the samples
    # Execute
    mean = bdp_step_cost(sq_norms=sq, q=0.05, sigma=1.0, orders=LAM)
    ucb = bdp_step_cost(sq_norms=sq, q=0.05, sigma=1.0, orders=LAM, estimator="ucb", confidence=0.05)
    ucb_more = bdp_step_cost(sq_norms=more, q=0.05, sigma=1.0, orders=LAM, estimator="ucb", confidence=0.05)
    ucb_loose = bdp_step_cost(sq_norms=sq, q=0.05, sigma=1.0, orders=LAM, estimator="ucb", confidence=0.001)
    # Assert
    assert np.all(ucb > mean)
    assert np.all(ucb_more < ucb) and np.all(ucb_more > mean)
    assert np.all(ucb_loose > ucb)


def test_ucb_is_capped_at_the_all_clipped_cost():
    # Prepare: two very different records, so the t-margin would exceed the d = 1 value
    sq = [0.0, 1.0]
    # Execute
    ucb = bdp_step_cost(sq_norms=sq, q=0.3, sigma=0.7, orders=LAM, estimator="ucb")
    worst = bdp_step_cost(sq_norms=[1.0], q=0.3, sigma=0.7, orders=LAM)
    # Assert
    np.testing.assert_allclose(ucb, worst, rtol=1e-12)


def test_large_orders_do_not_overflow():
    # Prepare: exp((k² − k)/(2σ²)) at k = 257, σ = 0.3 is far beyond float range
    sq = spread_norms(16, 0.5, 1.0)
    # Execute
    costs = [bdp_step_cost(sq_norms=sq, q=0.1, sigma=0.3, orders=LAM, estimator=e) for e in ("mean", "ucb")]
    # Assert
    for cost in costs:
        assert np.all(np.isfinite(cost)) and cost[-1] > 1e4


def test_accepts_a_torch_tensor_of_norms():
    # Prepare
    sq = spread_norms(20)
    # Execute
    from_tensor = bdp_step_cost(sq_norms=torch.tensor(sq, dtype=torch.float64), q=0.1, sigma=1.0, orders=LAM)
    # Assert
    np.testing.assert_array_equal(from_tensor, bdp_step_cost(sq_norms=sq, q=0.1, sigma=1.0, orders=LAM))


# ------------------------------------------------------------------------------------ calibration
@pytest.mark.parametrize("target", [1.0, 4.0])
def test_calibrated_bdp_sigma_hits_the_target(target):
    # Prepare
    sq, q, steps = spread_norms(), 0.02, 600
    # Execute
    sigma = calibrate_sigma_bdp(sq_norms=sq, q=q, steps=steps, epsilon=target, delta=DELTA)
    eps = bdp_eps(sq, q, sigma, steps)
    # Assert
    assert 0.99 * target <= eps <= target


def test_calibration_on_several_batches_plans_each_step_at_their_mean_cost():
    # Prepare: two batches of the size a step is charged on, one of small norms and one of large
    small, large = spread_norms(40, 0.0, 0.2, seed=1), spread_norms(40, 0.6, 1.0, seed=2)
    q, steps, target = 0.05, 400, 3.0
    # Execute
    sigma = calibrate_sigma_bdp(sq_norms=[small, large], q=q, steps=steps, epsilon=target, delta=DELTA, estimator="ucb")
    # Assert: the planned ε at that σ is the target, the plan lies between the two batches' own plans
    costs = [bdp_step_cost(sq_norms=b, q=q, sigma=sigma, orders=LAM, estimator="ucb") for b in (small, large)]
    eps = cost_epsilon(total_cost=steps * np.mean(costs, axis=0), orders=LAM, delta=DELTA)[0]
    assert 0.99 * target <= eps <= target
    alone = [
        calibrate_sigma_bdp(sq_norms=b, q=q, steps=steps, epsilon=target, delta=DELTA, estimator="ucb")
        for b in (small, large)
    ]
    assert alone[0] < sigma < alone[1]


def test_calibration_accounts_for_what_is_already_spent():
    # Prepare: half the budget gone
    sq, q, target = spread_norms(), 0.02, 3.0
    acc = BayesianAccountant(estimator="mean")  # the calibration's default estimator
    acc.spend(300 * acc.step_cost(sq_norms=sq, q=q, sigma=1.2))
    assert acc.epsilon(DELTA) < target
    # Execute
    sigma = calibrate_sigma_bdp(sq_norms=sq, q=q, steps=300, epsilon=target, delta=DELTA, spent=acc.total_cost)
    fresh = calibrate_sigma_bdp(sq_norms=sq, q=q, steps=300, epsilon=target, delta=DELTA)
    # Assert
    eps = acc.epsilon_after(300 * acc.step_cost(sq_norms=sq, q=q, sigma=sigma), DELTA)
    assert 0.99 * target <= eps <= target
    assert sigma > fresh


def test_calibrated_classic_sigma_hits_the_target_and_exceeds_the_bayesian_one():
    # Prepare
    sq, q, steps, target = spread_norms(), 0.02, 600, 2.0
    acc = ClassicAccountant()
    # Execute
    sigma_classic = calibrate_sigma_classic(q=q, steps=steps, epsilon=target, delta=DELTA)
    sigma_bdp = calibrate_sigma_bdp(sq_norms=sq, q=q, steps=steps, epsilon=target, delta=DELTA)
    eps = acc.epsilon_after(steps * acc.step_cost(sq_norms=None, q=q, sigma=sigma_classic), DELTA)
    # Assert
    assert 0.99 * target <= eps <= target
    assert sigma_bdp < sigma_classic


def test_calibration_refuses_a_budget_already_spent():
    # Prepare
    acc = BayesianAccountant()
    acc.spend(1000 * acc.step_cost(sq_norms=np.ones(4), q=0.1, sigma=0.8))
    # Execute / Assert
    with pytest.raises(ValueError, match="already spent"):
        calibrate_sigma_bdp(sq_norms=np.ones(4), q=0.1, steps=10, epsilon=1.0, delta=DELTA, spent=acc.total_cost)
    with pytest.raises(ValueError, match="below what these orders can certify"):
        calibrate_sigma_bdp(sq_norms=np.zeros(4), q=0.1, steps=10, epsilon=0.01, delta=DELTA)


# ------------------------------------------------------------------------------------ accountants
@pytest.mark.parametrize("name", ["bayesian", "classic"])
def test_accountant_spends_and_predicts(name):
    # Prepare
    acc = create_accountant(name)
    cost = acc.step_cost(sq_norms=spread_norms(), q=0.02, sigma=1.0)
    # Execute
    before = acc.epsilon(DELTA)
    predicted = acc.epsilon_after(cost, DELTA)
    steps_after_predicting = acc.steps
    acc.spend(cost)
    # Assert
    assert before == 0.0 and steps_after_predicting == 0
    assert acc.steps == 1 and acc.epsilon(DELTA) == pytest.approx(predicted, rel=1e-12)
    acc.spend(cost)
    assert acc.epsilon(DELTA) > predicted


@pytest.mark.parametrize(
    "name,settings",
    [("bayesian", {"estimator": "ucb", "confidence": 0.01}), ("classic", {"orders": [1, 2, 4, 8, 16, 32]})],
)
def test_state_dict_round_trip(name, settings):
    # Prepare
    acc = create_accountant(name, **settings)
    for sigma in (0.9, 1.1, 1.3):
        acc.spend(acc.step_cost(sq_norms=spread_norms(), q=0.03, sigma=sigma))
    # Execute: through JSON, so the state is plain data
    restored = create_accountant(name, **settings)
    restored.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    # Assert
    assert restored.steps == acc.steps == 3
    np.testing.assert_array_equal(restored.total_cost, acc.total_cost)
    assert restored.epsilon(DELTA) == acc.epsilon(DELTA)


def test_load_state_dict_rejects_another_accountant_or_other_orders():
    # Prepare
    state = ClassicAccountant().state_dict()
    # Execute / Assert
    with pytest.raises(ValueError, match="create_accountant\\('classic'"):
        BayesianAccountant().load_state_dict(state)
    with pytest.raises(ValueError, match="different orders"):
        ClassicAccountant(orders=[1, 2, 3]).load_state_dict(state)


def test_registry_builds_by_name_and_lists_valid_names():
    # Prepare / Execute
    bdp = create_accountant("bayesian", estimator="ucb")
    # Assert
    assert ACCOUNTANTS.names() == ["bayesian", "classic"]
    assert isinstance(bdp, BayesianAccountant) and bdp.estimator == "ucb"
    with pytest.raises(ValueError, match="valid names are: bayesian, classic"):
        create_accountant("gdp")
    with pytest.raises(ValueError, match="has no setting 'estimator'"):
        create_accountant("classic", estimator="mean")


# ------------------------------------------------------------------------------------ bad input
GOOD = dict(sq_norms=[0.5, 0.25], q=0.1, sigma=1.0, orders=LAM)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"q": 0.0}, "q must lie in \\(0, 1\\]"),
        ({"q": 1.5}, "q must lie in \\(0, 1\\]"),
        ({"sigma": 0.0}, "sigma must be a finite number > 0"),
        ({"sigma": -1.0}, "sigma must be a finite number > 0"),
        ({"sigma": float("inf")}, "sigma must be a finite number > 0"),
        ({"sq_norms": [0.5, 1.01]}, "pass ‖clip\\(g\\)‖²/C²"),
        ({"sq_norms": [-0.1]}, "pass ‖clip\\(g\\)‖²/C²"),
        ({"sq_norms": [float("nan")]}, "pass ‖clip\\(g\\)‖²/C²"),
        ({"sq_norms": []}, "sq_norms is empty"),
        ({"estimator": "median"}, "unknown estimator 'median'; use one of mean, ucb"),
        ({"estimator": "ucb", "sq_norms": [0.5]}, "needs at least 2 values"),
        ({"estimator": "ucb", "confidence": 0.7}, "confidence γ .* must lie in \\(0, 0.5\\)"),
        ({"orders": [0, 1]}, "orders must be a non-empty list of integers >= 1"),
        ({"orders": [1.5]}, "orders must be a non-empty list of integers >= 1"),
    ],
)
def test_step_cost_rejects_bad_input(change, match):
    # Prepare
    kwargs = {**GOOD, **change}
    # Execute / Assert
    with pytest.raises(ValueError, match=match):
        bdp_step_cost(**kwargs)


def test_norms_within_rounding_of_one_are_accepted():
    # Prepare / Execute
    cost = bdp_step_cost(sq_norms=[1.0 + 5e-7], q=0.1, sigma=1.0, orders=LAM)
    # Assert
    np.testing.assert_array_equal(cost, bdp_step_cost(sq_norms=[1.0], q=0.1, sigma=1.0, orders=LAM))


@pytest.mark.parametrize("epsilon", [0.0, -1.0, float("inf"), float("nan")])
def test_calibration_rejects_a_bad_epsilon(epsilon):
    # Execute / Assert
    with pytest.raises(ValueError, match="ε_total must be > 0"):
        calibrate_sigma_bdp(sq_norms=[0.5], q=0.1, steps=10, epsilon=epsilon, delta=DELTA)
    with pytest.raises(ValueError, match="ε_total must be > 0"):
        calibrate_sigma_classic(q=0.1, steps=10, epsilon=epsilon, delta=DELTA)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0])
def test_bad_delta_is_rejected_everywhere(delta):
    # Prepare
    acc = BayesianAccountant()
    # Execute / Assert
    for call in (
        lambda: cost_epsilon(total_cost=np.zeros(LAM.size), orders=LAM, delta=delta),
        lambda: acc.epsilon(delta),
        lambda: acc.epsilon_after(np.zeros(LAM.size), delta),
        lambda: calibrate_sigma_classic(q=0.1, steps=10, epsilon=1.0, delta=delta),
    ):
        with pytest.raises(ValueError, match="delta must lie strictly between 0 and 1"):
            call()


def test_spend_rejects_a_cost_of_the_wrong_shape_or_sign():
    # Prepare
    acc = ClassicAccountant()
    # Execute / Assert
    with pytest.raises(ValueError, match="one non-negative number per order"):
        acc.spend(np.zeros(3))
    with pytest.raises(ValueError, match="one non-negative number per order"):
        acc.spend(-np.ones(LAM.size))
    assert acc.steps == 0


def test_calibration_rejects_bad_steps():
    # Execute / Assert
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        calibrate_sigma_bdp(sq_norms=[0.5], q=0.1, steps=0, epsilon=1.0, delta=DELTA)
