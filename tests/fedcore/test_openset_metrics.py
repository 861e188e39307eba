"""Open-set metrics (AUROC, OSCR, MSP and PROSER scores) and the OpenMax scorer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import weibull_min
from sklearn.metrics import roc_auc_score

from fedcore.openset import OpenMax, auroc, msp_score, open_set_metrics, oscr, proser_predict, proser_score
from fedcore.openset.openmax import pairwise_distance


def oscr_by_pairs(sk, correct, su) -> float:
    """The OSCR definition written pair by pair: a correct known below an unknown scores 1, a tie 1/2."""
    sk, su = np.asarray(sk, float), np.asarray(su, float)
    wins = (su[None, :] > sk[:, None]) + 0.5 * (su[None, :] == sk[:, None])
    return float((np.asarray(correct)[:, None] * wins).sum() / (len(sk) * len(su)))


# ---------------------------------------------------------------------------------------------
# AUROC
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_auroc_equals_sklearn_with_ties(seed):
    # Prepare: integer scores in 0..5 give many ties within and across the two sides.
    rng = np.random.default_rng(seed)
    sk = rng.integers(0, 6, size=int(rng.integers(1, 40))).astype(float)
    su = rng.integers(1, 7, size=int(rng.integers(1, 40))).astype(float)
    # Execute
    got = auroc(sk, su)
    # Assert
    want = roc_auc_score(np.r_[np.zeros(len(sk)), np.ones(len(su))], np.r_[sk, su])
    assert got == pytest.approx(want, abs=1e-12)


def test_auroc_extremes_and_torch_input():
    assert auroc([0.1, 0.2], [0.3, 0.9]) == 1.0
    assert auroc([0.3, 0.9], [0.1, 0.2]) == 0.0
    assert auroc([0.5, 0.5], [0.5]) == 0.5
    assert auroc(torch.tensor([0.1, 0.4]), torch.tensor([0.2, 0.9])) == 0.75


@pytest.mark.parametrize(
    "sk, su, match",
    [
        ([], [0.1], "score_known is empty"),
        ([0.1], [], "score_unknown is empty"),
        ([0.1, np.nan], [0.2], r"score_known has 1 non-finite value"),
        ([0.1], [np.inf, 0.3], r"score_unknown has 1 non-finite value"),
        ([[0.1, 0.2]], [0.3], "must be 1-D"),
    ],
)
def test_auroc_rejects_empty_and_non_finite(sk, su, match):
    with pytest.raises(ValueError, match=match):
        auroc(sk, su)


# ---------------------------------------------------------------------------------------------
# OSCR
# ---------------------------------------------------------------------------------------------


def test_oscr_hand_computed_case():
    # 3 known with scores 0.1 (correct), 0.3 (wrong), 0.5 (correct); 2 unknown with 0.2 and 0.6.
    # Accept as known when score <= θ. Sweeping θ over the sorted scores:
    #   θ < 0.1: (FPR, CCR) = (0, 0)
    #   θ = 0.1: (0, 1/3)     θ = 0.2: (1/2, 1/3)     θ = 0.3: (1/2, 1/3)  (the wrong one adds nothing)
    #   θ = 0.5: (1/2, 2/3)   θ = 0.6: (1, 2/3)
    # Area: 1/2 * 1/3 (FPR 0 -> 1/2) + 1/2 * 2/3 (FPR 1/2 -> 1) = 1/6 + 1/3 = 1/2.
    assert oscr([0.1, 0.3, 0.5], [True, False, True], [0.2, 0.6]) == pytest.approx(0.5, abs=1e-12)


def test_oscr_hand_computed_case_with_a_tie():
    # Known 0.2 (correct), 0.5 (correct), 0.5 (wrong); unknown 0.5 and 0.9.
    #   θ = 0.2: (0, 1/3);  θ = 0.5: a known-correct, a known-wrong and an unknown are accepted
    #   together, (1/2, 2/3): a diagonal step, trapezoid 1/2 * (1/3 + 2/3) / 2 = 1/4;
    #   θ = 0.9: (1, 2/3): 1/2 * 2/3 = 1/3.  Total 1/4 + 1/3 = 7/12.
    assert oscr([0.2, 0.5, 0.5], [1, 1, 0], [0.5, 0.9]) == pytest.approx(7 / 12, abs=1e-12)
    assert oscr([0.4], [True], [0.4]) == pytest.approx(0.5, abs=1e-12)  # a lone tie counts half


def test_oscr_extremes():
    assert oscr([0.0, 0.1, 0.2], [True] * 3, [0.5, 0.7]) == 1.0
    assert oscr([0.0, 0.1, 0.2], [False] * 3, [0.5, 0.7]) == 0.0
    # perfect separation: OSCR is the closed-set accuracy
    assert oscr([0.0, 0.1, 0.2, 0.3], [True, False, True, True], [0.5, 0.7]) == pytest.approx(0.75)


@pytest.mark.parametrize("seed", range(5))
def test_oscr_equals_its_pairwise_definition_and_auroc_when_all_correct(seed):
    # Prepare: tied scores, random correctness
    rng = np.random.default_rng(100 + seed)
    sk = rng.integers(0, 8, size=30).astype(float)
    su = rng.integers(2, 10, size=17).astype(float)
    correct = rng.random(30) < 0.7
    # Execute
    got = oscr(sk, correct, su)
    # Assert: the curve's area is the pair count, and with every known correct it is the AUROC
    assert got == pytest.approx(oscr_by_pairs(sk, correct, su), abs=1e-12)
    assert oscr(sk, np.ones(30, bool), su) == pytest.approx(auroc(sk, su), abs=1e-12)
    perm_k, perm_u = rng.permutation(30), rng.permutation(17)
    assert oscr(sk[perm_k], correct[perm_k], su[perm_u]) == pytest.approx(got, abs=1e-12)


@pytest.mark.parametrize(
    "correct, match",
    [
        ([True, False], "one entry per known sample"),
        ([0, 2, 1], r"boolean \(or 0/1\): pass pred == y"),
        (["a", "b", "c"], r"boolean \(or 0/1\)"),
    ],
)
def test_oscr_rejects_bad_correct(correct, match):
    with pytest.raises(ValueError, match=match):
        oscr([0.1, 0.2, 0.3], correct, [0.5])


def test_oscr_rejects_empty_and_non_finite():
    with pytest.raises(ValueError, match="score_unknown is empty"):
        oscr([0.1], [True], [])
    with pytest.raises(ValueError, match="score_known has 1 non-finite"):
        oscr([np.nan], [True], [0.2])


# ---------------------------------------------------------------------------------------------
# MSP and PROSER scores
# ---------------------------------------------------------------------------------------------


def test_msp_score_is_minus_max_softmax_for_numpy_and_torch():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0], [1000.0, 0.0, 999.0]])
    want = -torch.softmax(logits.double(), dim=1).max(1).values.numpy()
    got_t, got_n = msp_score(logits), msp_score(logits.numpy())
    assert isinstance(got_t, np.ndarray)
    np.testing.assert_allclose(got_t, want, rtol=1e-12)
    np.testing.assert_array_equal(got_t, got_n)
    assert got_t[1] == pytest.approx(-1 / 3)  # uniform: the most unknown a 3-class MSP can be
    assert np.isfinite(got_t).all()  # no overflow at logit 1000


def test_msp_score_rejects_bad_logits():
    with pytest.raises(ValueError, match=r"2-D \(N, C\)"):
        msp_score(np.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        msp_score(np.array([[0.0, np.nan]]))


def test_proser_score_and_prediction_use_the_last_logit_as_dummy():
    logits = np.array(
        [
            [3.0, 1.0, 0.5],  # known 0 wins, dummy 0.5: score 0.5 - 3 = -2.5
            [0.0, 2.0, 4.0],
        ]
    )  # dummy is largest: score 4 - 2 = 2, label still 1
    np.testing.assert_array_equal(proser_score(logits), [-2.5, 2.0])
    np.testing.assert_array_equal(proser_predict(torch.from_numpy(logits)), [0, 1])
    with pytest.raises(ValueError, match="C >= 2"):
        proser_score(np.zeros((2, 1)))


def test_proser_score_is_the_large_temperature_limit_of_the_official_calibration():
    # Prepare: p_dummy - max p_known at T = 1024, scaled by T * (K + 1), tends to z_d - max z_k.
    rng = np.random.default_rng(3)
    z = rng.normal(0, 2, size=(200, 6))
    t = 1024.0
    p = torch.softmax(torch.from_numpy(z / t), dim=1).numpy()
    official = p[:, -1] - p[:, :-1].max(1)
    # Execute
    ours = proser_score(z)
    # Assert: same sign everywhere, equal up to O(|z| / T) relative terms
    np.testing.assert_array_equal(np.sign(official), np.sign(ours))
    np.testing.assert_allclose(official * t * z.shape[1], ours, rtol=2e-2, atol=1e-9)


def test_open_set_metrics_on_the_hand_case():
    # Same scores as test_oscr_hand_computed_case; sample 1 is misclassified.
    # AUROC: unknown 0.2 beats known 0.1; unknown 0.6 beats all three: 4 / 6 pairs.
    got = open_set_metrics(pred=[0, 2, 1], y=[0, 1, 1], score_known=[0.1, 0.3, 0.5], score_unknown=[0.2, 0.6])
    assert got.keys() == {"closed_acc", "auroc", "oscr"}
    assert got["closed_acc"] == pytest.approx(2 / 3)
    assert got["auroc"] == pytest.approx(2 / 3)
    assert got["oscr"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same known samples"):
        open_set_metrics([0, 1], [0, 1, 1], [0.1, 0.3, 0.5], [0.2])


# ---------------------------------------------------------------------------------------------
# OpenMax
# ---------------------------------------------------------------------------------------------

C = 4


def clusters(n_per_class: int, seed: int):
    """Well-separated Gaussian 'logits': class k at 8 * e_k with unit noise."""
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(C), n_per_class)
    return 8.0 * np.eye(C)[y] + rng.normal(size=(len(y), C)), y


@pytest.fixture(scope="module")
def train():
    return clusters(60, seed=0)


@pytest.mark.parametrize("distance", ["eucos", "euclidean"])
def test_openmax_far_samples_are_more_unknown_than_samples_at_a_mav(train, distance):
    # Prepare
    z, y = train
    om = OpenMax(tail_size=20, distance=distance).fit(z, y)
    at_mav = om.mav_
    far = np.array([[8.0, 8.0, 8.0, 8.0], [-6.0, 9.0, 9.0, -6.0], [4.0, 12.0, 12.0, 4.0], [15.0, 15.0, -9.0, 3.0]])
    test_z, _ = clusters(30, seed=1)
    # Execute
    s_mav, s_far = om.score(at_mav), om.score(far)
    # Assert
    assert s_far.min() > s_mav.max()
    assert s_mav.max() < 0.01 and s_far.min() > 0.4
    assert auroc(om.score(test_z), s_far) == 1.0
    np.testing.assert_array_equal(om.predict(at_mav), np.arange(C))


def test_openmax_probabilities_sum_to_one_and_follow_the_revision_formula(train):
    z, y = train
    om = OpenMax(tail_size=10, alpha=2).fit(z, y)
    q = np.array([[5.0, 4.0, 1.0, 0.0]])
    proba = om.predict_proba(q)
    # by hand: the top two classes (0, 1) get alpha weights 1 and 1/2, the others 0
    w = om.weibull_cdf(pairwise_distance(q, om.mav_, distance="eucos"))[0]
    removed = np.array([5.0 * w[0] * 1.0, 4.0 * w[1] * 0.5, 0.0, 0.0])
    logits = np.r_[q[0] - removed, removed.sum()]
    want = np.exp(logits) / np.exp(logits).sum()
    np.testing.assert_allclose(proba[0], want, rtol=1e-12)
    assert proba.shape == (1, C + 1) and proba.sum() == pytest.approx(1.0)


def test_openmax_weibull_is_fitted_to_the_largest_distances(train):
    # Prepare: the documented fit, recomputed for class 2 by hand
    z, y = train
    om = OpenMax(tail_size=15).fit(z, y)
    rows = (y == 2) & (z.argmax(1) == 2)
    mav = z[rows].mean(0)
    d = (
        np.linalg.norm(z[rows] - mav, axis=1) / 200
        + 1
        - z[rows] @ mav / (np.linalg.norm(z[rows], axis=1) * np.linalg.norm(mav))
    )
    shape, loc, scale = weibull_min.fit(np.sort(d)[-15:], floc=0)
    # Assert
    np.testing.assert_allclose(om.mav_[2], mav, rtol=1e-12)
    assert (om.shape_[2], om.scale_[2]) == pytest.approx((shape, scale), rel=1e-9)


def test_openmax_weibull_weights_are_in_0_1_and_monotone_in_distance(train):
    z, y = train
    om = OpenMax().fit(z, y)
    grid = np.linspace(0.0, 5.0 * om.scale_.max(), 400)
    w = om.weibull_cdf(np.repeat(grid[:, None], C, axis=1))
    assert ((w >= 0) & (w <= 1)).all()
    assert (np.diff(w, axis=0) >= 0).all()
    np.testing.assert_array_equal(w[0], 0.0)
    assert (w[-1] > 0.999).all()


def test_openmax_is_deterministic(train):
    z, y = train
    test_z, _ = clusters(20, seed=2)
    a = OpenMax().fit(z, y).score(test_z)
    om = OpenMax().fit(torch.from_numpy(z), torch.from_numpy(y))
    np.testing.assert_array_equal(a, om.score(test_z))
    np.testing.assert_array_equal(a, om.score(torch.from_numpy(test_z)))
    np.testing.assert_array_equal(om.predict(test_z), om.predict(test_z))


def test_openmax_class_without_a_correct_sample_names_the_class_and_fix(train):
    z, y = train
    z = z.copy()
    z[y == 2, 0] += 20.0  # every class-2 sample is now predicted as class 0
    with pytest.raises(ValueError, match=r"class 2 has no correctly classified.*train the model longer.*MSP"):
        OpenMax().fit(z, y)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tail_size": 1}, "tail_size must be an int >= 2"),
        ({"alpha": 0}, "alpha must be an int >= 1 or None"),
        ({"distance": "cosine"}, "valid names are: eucos, euclidean"),
    ],
)
def test_openmax_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OpenMax(**kwargs)


def test_openmax_inconsistent_use(train):
    z, y = train
    with pytest.raises(TypeError):
        OpenMax(20)  # settings are keyword-only
    with pytest.raises(RuntimeError, match=r"call fit\(train_logits, train_y\) first"):
        OpenMax().score(z)
    with pytest.raises(ValueError, match="alpha=5 exceeds the 4 classes"):
        OpenMax(alpha=5).fit(z, y)
    with pytest.raises(ValueError, match="fitted on 4 classes"):
        OpenMax().fit(z, y).score(z[:, :3])
    with pytest.raises(ValueError, match="fewer than 2 distinct nonzero distances"):
        OpenMax().fit(np.eye(2)[[0, 1, 1]] * 5, np.array([0, 1, 1]))
