"""PP-FCIL's multi-factor aggregation weights and Mahalanobis client selection."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.spatial.distance import mahalanobis
from sklearn.metrics import cohen_kappa_score

from fedcore.aggregate.multifactor import (
    cohen_kappa,
    data_balance,
    freshness,
    mahalanobis_scores,
    multifactor_weights,
    participation_factor,
    relative_accuracy,
    select_clients,
)


def random_factors(rng, k: int) -> dict:
    """Valid factor arrays for k selected clients, each in its function's range."""
    return {
        "gamma": np.tanh(rng.uniform(0, 1, k)),
        "data_share": rng.dirichlet(np.ones(k)),
        "fresh": (2 / math.e) ** rng.integers(1, 6, k),
        "accuracy": rng.dirichlet(np.ones(k)),
        "participation": rng.uniform(0.5, 1.0, k),
    }


def weights_from_raw(*, new, total, round_index, last_round, accuracy, counts, selected):
    """The whole pipeline from the clients' raw numbers to their weights."""
    new = np.asarray(new, float)
    return multifactor_weights(
        gamma=data_balance(new_examples=new, total_examples=total),
        data_share=new / new.sum(),
        fresh=freshness(round_index=round_index, last_round=last_round),
        accuracy=relative_accuracy(accuracy=accuracy),
        participation=participation_factor(counts=counts, selected=selected),
    )


RAW = {
    "new": [40, 40, 40, 40],
    "total": [100, 100, 100, 100],
    "round_index": 6,
    "last_round": [3, 3, 3, 3],
    "accuracy": [0.5, 0.5, 0.5, 0.5],
    "counts": [2, 2, 2, 2, 5],
    "selected": [0, 1, 2, 3],
}


# ---------------------------------------------------------------------------------------------
# the factors
# ---------------------------------------------------------------------------------------------


def test_factor_goldens():
    # Prepare / Execute
    gamma = data_balance(new_examples=[50, 30, 0], total_examples=[100, 30, 80], alpha=0.1)
    fresh = freshness(round_index=5, last_round=[4, 2, None, -1])
    acc = relative_accuracy(accuracy=[0.8, 0.6, 0.6])
    part = participation_factor(counts=[3, 1, 2, 4, 0])
    # Assert: θ = [0.5, 1, 0] shifted by α = 0.1; T = (e/2)^-(t - t_k) with lags [1, 3, 1, 1];
    # A = β / 2.0; R = (r_k / 10 + 1) / 2.
    np.testing.assert_allclose(gamma, [math.tanh(0.6), math.tanh(1.1), math.tanh(0.1)], rtol=1e-12)
    np.testing.assert_allclose(fresh, [2 / math.e, 8 / math.e**3, 2 / math.e, 2 / math.e], rtol=1e-12)
    np.testing.assert_allclose(acc, [0.4, 0.3, 0.3], rtol=1e-12)
    np.testing.assert_allclose(part, [0.65, 0.55, 0.6, 0.7, 0.5], rtol=1e-12)
    np.testing.assert_allclose(participation_factor(counts=[3, 1, 2, 4, 0], selected=[3, 0]), [0.7, 0.65])


def test_data_balance_decays_as_data_accumulates():
    # Prepare: one client gets 100 new examples per task for 5 tasks.
    new, total = [100] * 5, [100, 200, 300, 400, 500]
    # Execute
    gamma = data_balance(new_examples=new, total_examples=total)
    # Assert: γ = tanh(1/t) falls task by task.
    np.testing.assert_allclose(gamma, np.tanh(1 / np.arange(1, 6)), rtol=1e-12)
    assert np.all(np.diff(gamma) < 0)


def test_relative_accuracy_is_uniform_when_all_zero():
    np.testing.assert_allclose(relative_accuracy(accuracy=[0, 0, 0, 0]), [0.25] * 4)


# ---------------------------------------------------------------------------------------------
# the combined weights
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_weights_are_a_distribution(seed):
    # Prepare
    rng = np.random.default_rng(seed)
    factors = random_factors(rng, int(rng.integers(1, 12)))
    # Execute
    w = multifactor_weights(**factors)
    # Assert
    assert w.shape == factors["gamma"].shape
    assert np.all(w >= 0)
    assert w.sum() == pytest.approx(1.0, abs=1e-12)


def test_golden_three_clients():
    # Prepare: a=0.3, b=0.5, c=0.1, d=0.1.
    #   client 0: 0.3*0.5 + 0.5*0.5*1.00 + 0.1*0.4 + 0.1*0.65 = 0.15 + 0.25  + 0.04 + 0.065 = 0.505
    #   client 1: 0.3*0.2 + 0.5*0.3*0.50 + 0.1*0.3 + 0.1*0.55 = 0.06 + 0.075 + 0.03 + 0.055 = 0.220
    #   client 2: 0.3*0.1 + 0.5*0.2*0.25 + 0.1*0.3 + 0.1*0.60 = 0.03 + 0.025 + 0.03 + 0.060 = 0.145
    #   total 0.87 -> [0.505, 0.22, 0.145] / 0.87, the last exactly 1/6.
    factors = {
        "gamma": [0.5, 0.2, 0.1],
        "data_share": [0.5, 0.3, 0.2],
        "fresh": [1.0, 0.5, 0.25],
        "accuracy": [0.4, 0.3, 0.3],
        "participation": [0.65, 0.55, 0.6],
    }
    # Execute
    w = multifactor_weights(**factors)
    # Assert
    np.testing.assert_allclose(w, [0.505 / 0.87, 0.22 / 0.87, 1 / 6], rtol=1e-12)


@pytest.mark.parametrize("factor", ["gamma", "data_share", "fresh", "accuracy", "participation"])
def test_raising_one_factor_raises_that_clients_weight(factor):
    # Prepare
    rng = np.random.default_rng(1)
    base = random_factors(rng, 5)
    bumped = {k: v.copy() for k, v in base.items()}
    bumped[factor][2] *= 1.5
    # Execute
    before, after = multifactor_weights(**base), multifactor_weights(**bumped)
    # Assert: client 2 gains, every other client loses (the weights are renormalised).
    assert after[2] > before[2]
    assert np.all(np.delete(after, 2) < np.delete(before, 2))


@pytest.mark.parametrize(
    "bump",
    [
        pytest.param(lambda r: r["total"].__setitem__(1, 60), id="gamma: less old data"),
        pytest.param(lambda r: r["last_round"].__setitem__(1, 5), id="freshness: took part more recently"),
        pytest.param(lambda r: r["accuracy"].__setitem__(1, 0.9), id="accuracy"),
        pytest.param(lambda r: r["counts"].__setitem__(1, 6), id="participation count"),
    ],
)
def test_raw_inputs_move_the_weight_the_right_way(bump):
    # Prepare: four identical clients, then one raw number of client 1 improved.
    raw = {k: list(v) if isinstance(v, list) else v for k, v in RAW.items()}
    before = weights_from_raw(**raw)
    bump(raw)
    # Execute
    after = weights_from_raw(**raw)
    # Assert
    np.testing.assert_allclose(before, [0.25] * 4, rtol=1e-12)
    assert after[1] > before[1]
    assert after[1] == after.max() and np.count_nonzero(after == after.max()) == 1


def test_more_new_data_raises_the_weight():
    # Prepare: client 1 gets 20 more new examples (its cumulative total grows by the same 20).
    raw = {k: list(v) if isinstance(v, list) else v for k, v in RAW.items()}
    before = weights_from_raw(**raw)
    raw["new"][1], raw["total"][1] = 60, 120
    # Execute
    after = weights_from_raw(**raw)
    # Assert
    assert after[1] > before[1]


@pytest.mark.parametrize(
    "coeffs, factor", [((1, 0, 0, 0), "gamma"), ((0, 0, 1, 0), "accuracy"), ((0, 0, 0, 1), "participation")]
)
def test_single_coefficient_reduces_to_its_factor(coeffs, factor):
    # Prepare
    factors = random_factors(np.random.default_rng(2), 6)
    # Execute
    w = multifactor_weights(**factors, coeffs=coeffs)
    # Assert
    np.testing.assert_allclose(w, factors[factor] / factors[factor].sum(), rtol=1e-12)
    if factor == "accuracy":  # A already sums to 1: the weights are A itself
        np.testing.assert_allclose(w, factors["accuracy"], rtol=1e-12)


def test_data_coefficient_reduces_to_share_times_freshness():
    factors = random_factors(np.random.default_rng(3), 6)
    w = multifactor_weights(**factors, coeffs=(0, 1, 0, 0))
    prod = factors["data_share"] * factors["fresh"]
    np.testing.assert_allclose(w, prod / prod.sum(), rtol=1e-12)


def test_only_the_coefficient_ratios_matter():
    factors = random_factors(np.random.default_rng(4), 5)
    np.testing.assert_allclose(
        multifactor_weights(**factors, coeffs=(0.6, 1.0, 0.2, 0.2)), multifactor_weights(**factors), rtol=1e-12
    )


def test_all_zero_scores_give_uniform_weights():
    w = multifactor_weights(
        gamma=[0, 0, 0],
        data_share=[0.2, 0.3, 0.5],
        fresh=[1, 1, 1],
        accuracy=[0.3, 0.3, 0.4],
        participation=[0.6, 0.6, 0.6],
        coeffs=(1, 0, 0, 0),
    )
    np.testing.assert_allclose(w, [1 / 3] * 3)


GOOD = {
    "gamma": [0.5, 0.2],
    "data_share": [0.5, 0.5],
    "fresh": [1, 1],
    "accuracy": [0.5, 0.5],
    "participation": [0.6, 0.6],
}


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: multifactor_weights(**GOOD, coeffs=(0.3, -0.1, 0.1, 0.1)), "coeffs must be finite and >= 0"),
        (lambda: multifactor_weights(**GOOD, coeffs=(0, 0, 0, 0)), "coeffs are all 0"),
        (lambda: multifactor_weights(**GOOD, coeffs=(0.3, 0.5, 0.2)), "four numbers"),
        (lambda: multifactor_weights(**{**GOOD, "fresh": [1, 1, 1]}), "lengths gamma=2, data_share=2, fresh=3"),
        (lambda: multifactor_weights(**{**GOOD, "gamma": [0.5, -0.2]}), "gamma must be >= 0"),
        (lambda: multifactor_weights(**{**GOOD, "accuracy": [0.5, np.nan]}), "accuracy has 1 non-finite"),
        (lambda: data_balance(new_examples=[5, -1], total_examples=[5, 5]), "new_examples must be >= 0"),
        (lambda: data_balance(new_examples=[5, 6], total_examples=[5, 5]), "must include the new examples"),
        (lambda: data_balance(new_examples=[0], total_examples=[0]), "total_examples must be > 0"),
        (lambda: data_balance(new_examples=[1], total_examples=[2], alpha=-0.5), "alpha must be"),
        (lambda: data_balance(new_examples=[1, 2], total_examples=[2]), "one entry per client"),
        (lambda: freshness(round_index=3, last_round=[1, 3]), r"last_round\[1\] is 3 but the current round is 3"),
        (lambda: freshness(round_index=3, last_round=[1, 7]), "before this one"),
        (lambda: freshness(round_index=3, last_round=[-2]), "use -1 or None"),
        (lambda: freshness(round_index=3, last_round=[1.5]), "integer round"),
        (lambda: freshness(round_index=-1, last_round=[None]), "round_index must be >= 0"),
        (lambda: relative_accuracy(accuracy=[0.5, -0.1]), "accuracy must be >= 0"),
        (lambda: participation_factor(counts=[0, 0]), "must include the current round"),
        (lambda: participation_factor(counts=[1, 2], selected=[2]), r"selected ids must be in \[0, 2\)"),
    ],
)
def test_bad_input_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# Cohen's kappa
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_cohen_kappa_equals_sklearn(seed):
    # Prepare: predictions right 60% of the time; some classes may be missing from either side.
    rng = np.random.default_rng(seed)
    c = int(rng.integers(2, 7))
    y = rng.integers(0, c, size=int(rng.integers(5, 80)))
    pred = np.where(rng.random(y.size) < 0.6, y, rng.integers(0, c, size=y.size))
    # Execute
    got = cohen_kappa(y_true=y, y_pred=pred, num_classes=c + 2)  # unused classes change nothing
    # Assert
    assert got == pytest.approx(cohen_kappa_score(y, pred), abs=1e-12)


def test_cohen_kappa_extremes():
    assert cohen_kappa(y_true=[0, 1, 2, 1], y_pred=[0, 1, 2, 1], num_classes=3) == pytest.approx(1.0)
    assert cohen_kappa(y_true=[0, 1, 0, 1], y_pred=[1, 0, 1, 0], num_classes=2) == pytest.approx(-1.0)
    assert cohen_kappa(y_true=[2, 2, 2], y_pred=[2, 2, 2], num_classes=3) == 0.0  # p_e = 1: defined as 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"y_true": [0, 1], "y_pred": [0], "num_classes": 2}, "same length"),
        ({"y_true": [], "y_pred": [], "num_classes": 2}, "empty"),
        ({"y_true": [0, 3], "y_pred": [0, 1], "num_classes": 3}, r"outside \[0, 3\)"),
        ({"y_true": [0, 1], "y_pred": [0, 1], "num_classes": 0}, "num_classes must be >= 1"),
        ({"y_true": [0.5, 1], "y_pred": [0, 1], "num_classes": 2}, "integer class labels"),
    ],
)
def test_cohen_kappa_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cohen_kappa(**kwargs)


# ---------------------------------------------------------------------------------------------
# Mahalanobis scores
# ---------------------------------------------------------------------------------------------


def client_vectors(rng, k: int) -> np.ndarray:
    """[accuracy, loss, kappa] per client, correlated the way real metrics are."""
    acc = rng.uniform(0.4, 0.95, k)
    loss = 2.5 * (1 - acc) + rng.normal(0, 0.15, k)
    kappa = acc - 0.1 + rng.normal(0, 0.05, k)
    return np.column_stack([acc, loss, kappa])


def test_scores_equal_brute_force_mahalanobis():
    # Prepare
    v = client_vectors(np.random.default_rng(0), 7)
    vi = np.linalg.inv(np.cov(v, rowvar=False))
    # Execute
    got = mahalanobis_scores(vectors=v)
    # Assert
    want = [sum(mahalanobis(v[i], v[j], vi) for j in range(len(v)) if j != i) for i in range(len(v))]
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_scores_and_picks_are_invariant_to_scaling_a_metric():
    # Prepare: K = 8 non-degenerate vectors, and the same with the loss in thousandths.
    v = client_vectors(np.random.default_rng(1), 8)
    scaled = v.copy()
    scaled[:, 1] *= 1000.0
    # Execute
    s, s_scaled = mahalanobis_scores(vectors=v), mahalanobis_scores(vectors=scaled)
    picks = select_clients(scores=s, m=3, waited=[0] * 8, max_wait=None)
    picks_scaled = select_clients(scores=s_scaled, m=3, waited=[0] * 8, max_wait=None)
    # Assert
    np.testing.assert_allclose(s_scaled, s, rtol=1e-6)
    assert picks == picks_scaled
    assert len(set(np.round(s, 6))) == 8  # distinct scores: the picks are not decided by ties


def test_constant_metric_is_ignored_by_the_pseudo_inverse():
    # Prepare: every client has the same kappa; the covariance is singular.
    v = client_vectors(np.random.default_rng(2), 6)
    v[:, 2] = 0.5
    # Execute
    got = mahalanobis_scores(vectors=v)
    # Assert: the scores are those of the two metrics that do vary.
    np.testing.assert_allclose(got, mahalanobis_scores(vectors=v[:, :2]), rtol=1e-9)
    assert np.all(np.isfinite(got)) and np.all(got > 0)


def test_too_few_clients_all_score_the_same():
    # Prepare: 3 clients in 3-D: the covariance has rank 2.
    v = client_vectors(np.random.default_rng(3), 3)
    # Execute
    got = mahalanobis_scores(vectors=v)
    # Assert: with n <= D + 1 points in general position, S⁺ turns the centred points into a
    # regular simplex: MD(i, j)² = (n − 1)(e_i − e_j)ᵀ(I − 11ᵀ/n)(e_i − e_j) = 2(n − 1), so every
    # MD is 2 for n = 3 and every score 2·2 = 4.
    np.testing.assert_allclose(got, [4.0, 4.0, 4.0], rtol=1e-9)


def test_unseen_clients_score_inf_and_are_left_out_of_the_covariance():
    # Prepare
    v = client_vectors(np.random.default_rng(4), 7)
    with_unseen = v.copy()
    with_unseen[[1, 5]] = np.nan
    # Execute
    got = mahalanobis_scores(vectors=with_unseen)
    # Assert
    assert np.isinf(got[[1, 5]]).all()
    np.testing.assert_allclose(
        np.delete(got, [1, 5]), mahalanobis_scores(vectors=np.delete(v, [1, 5], axis=0)), rtol=1e-12
    )


def test_single_seen_client_scores_zero():
    got = mahalanobis_scores(vectors=[[0.5, 1.0, 0.4], [np.nan] * 3])
    assert got[0] == 0.0 and got[1] == np.inf


@pytest.mark.parametrize(
    "vectors, match",
    [
        ([[0.5, np.nan, 0.4], [0.6, 1.0, 0.3]], "partly NaN"),
        ([[0.5, np.inf, 0.4], [0.6, 1.0, 0.3]], "infinite"),
        ([0.5, 1.0, 0.4], "non-empty"),
        (np.zeros((0, 3)), "non-empty"),
    ],
)
def test_mahalanobis_errors(vectors, match):
    with pytest.raises(ValueError, match=match):
        mahalanobis_scores(vectors=vectors)


# ---------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------


def test_unseen_clients_are_picked_first():
    # Prepare: clients 2 and 4 have no metrics yet.
    v = client_vectors(np.random.default_rng(5), 6)
    v[[2, 4]] = np.nan
    scores = mahalanobis_scores(vectors=v)
    # Execute
    picked, why = select_clients(scores=scores, m=3, waited=[0] * 6, max_wait=None)
    # Assert
    seen = [k for k in range(6) if k not in (2, 4)]
    best_seen = max(seen, key=lambda k: scores[k])
    assert picked == sorted([2, 4, best_seen])
    assert why == {2: "unseen", 4: "unseen", best_seen: "score"}


def test_highest_scores_win_ties_by_lower_id():
    picked, why = select_clients(scores=[1.0, 3.0, 2.0, 3.0, 2.0], m=3, waited=[0] * 5, max_wait=3)
    assert picked == [1, 2, 3]
    assert set(why.values()) == {"score"}


def test_forced_clients_come_first_longest_waiting_first():
    # Prepare: clients 0, 3 and 4 are due (waited >= 2); 3 and 4 waited longest, 0 least.
    scores, waited = [0.0, 9.0, 8.0, 1.0, 0.5], [2, 0, 0, 5, 5]
    # Execute
    two = select_clients(scores=scores, m=2, waited=waited, max_wait=2)
    four = select_clients(scores=scores, m=4, waited=waited, max_wait=2)
    # Assert: with m=2 only the two longest-waiting fit; with m=4 all three due plus the best score.
    assert two == ([3, 4], {3: "forced", 4: "forced"})
    assert four == ([0, 1, 3, 4], {0: "forced", 1: "score", 3: "forced", 4: "forced"})


def test_forced_ties_go_to_the_lower_id():
    picked, why = select_clients(scores=[0.0] * 4, m=1, waited=[3, 3, 3, 3], max_wait=1)
    assert picked == [0] and why == {0: "forced"}


def simulate(*, scores, m, max_wait, rounds):
    """Run the selection for ``rounds`` rounds with fixed scores; the (rounds, K) 0/1 pick record."""
    k = len(scores)
    waited = np.zeros(k, dtype=int)
    record = np.zeros((rounds, k), dtype=int)
    for r in range(rounds):
        picked, _ = select_clients(scores=scores, m=m, waited=waited, max_wait=max_wait)
        record[r, picked] = 1
        waited += 1
        waited[picked] = 0
    return record


@pytest.mark.parametrize("k, m, max_wait", [(7, 2, 4), (10, 3, 2), (5, 1, 3), (9, 4, 1), (6, 6, 2)])
def test_fairness_floor_bounds_every_clients_wait(k, m, max_wait):
    # The bound. A client picked in round s sits out with waited = 0, 1, ... and is due (waited >=
    # max_wait) from round s + 1 + max_wait on. Once due nobody overtakes it: a client behind it in
    # the (waited desc, id) order stays behind while both wait, and one that is picked drops to 0.
    # While it is not picked all m slots go to due clients ahead of it, who then drop behind, so
    # the (at most K - 1) clients ahead shrink by m a round and it is picked within ceil(K / m)
    # rounds of becoming due: by round s + max_wait + ceil(K / m). The same holds from the start
    # (waited = 0 in round 0). Hence every window of G = max_wait + ceil(K / m) consecutive rounds
    # holds at least one pick of every client.
    # Prepare: fixed scores, client K-1 always lowest (selection by score alone never picks it).
    scores = np.linspace(1.0, 0.1, k)
    gap = max_wait + math.ceil(k / m)
    # Execute
    record = simulate(scores=scores, m=m, max_wait=max_wait, rounds=200)
    # Assert
    windows = np.lib.stride_tricks.sliding_window_view(record, gap, axis=0).sum(axis=-1)  # (rounds-G+1, K)
    assert windows.min() >= 1
    assert np.all(record.sum(axis=1) == m)


def test_without_the_floor_the_lowest_scorer_is_never_picked():
    record = simulate(scores=np.linspace(1.0, 0.1, 7), m=2, max_wait=None, rounds=50)
    assert record[:, -1].sum() == 0
    assert record[:, :2].all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scores": [1.0, 2.0], "m": 0, "waited": [0, 0], "max_wait": 2}, "cannot select m=0 clients out of K=2"),
        ({"scores": [1.0, 2.0], "m": 3, "waited": [0, 0], "max_wait": 2}, "cannot select m=3 clients out of K=2"),
        ({"scores": [1.0, 2.0], "m": 1, "waited": [0, 0], "max_wait": 0}, "max_wait must be >= 1"),
        ({"scores": [1.0, 2.0], "m": 1, "waited": [0, 0, 0], "max_wait": 2}, "lengths scores=2, waited=3"),
        ({"scores": [1.0, np.nan], "m": 1, "waited": [0, 0], "max_wait": 2}, "use \\+inf"),
        ({"scores": [1.0, 2.0], "m": 1, "waited": [0, -1], "max_wait": 2}, "waited must be >= 0"),
        ({"scores": [1.0, 2.0], "m": 1, "waited": [0, 0.5], "max_wait": 2}, "whole numbers"),
    ],
)
def test_selection_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        select_clients(**kwargs)
