import math

import pytest
import torch

from fedcore.aggregate import (
    FedAvgMerge,
    MergeHistory,
    SequentialMerge,
    UGSAMerge,
    advance,
    create_aggregator,
    l2_distance,
    ugsa_merge,
    ugsa_weight,
    weighted_average,
)


def state(v, n=0):
    return {
        "w": torch.full((3,), float(v)),
        "bn.running_mean": torch.full((2,), float(v) * 2),
        "bn.num_batches_tracked": torch.tensor(n),
    }


def test_weighted_average_matches_reference():
    out = weighted_average([(state(1.0, 5), 1), (state(4.0, 9), 3)])
    assert torch.allclose(out["w"], torch.full((3,), (1 * 1 + 4 * 3) / 4))
    assert int(out["bn.num_batches_tracked"]) == 9, "integer counters come from the newest model"


def test_ugsa_is_the_published_rule():
    g, c = state(1.0), state(3.0)
    out = ugsa_merge(g, c, gamma=0.5, weight=0.4)
    assert torch.allclose(out["w"], g["w"] + 0.5 * 0.4 * (c["w"] - g["w"]))
    assert torch.allclose(
        out["bn.running_mean"], g["bn.running_mean"] + 0.2 * (c["bn.running_mean"] - g["bn.running_mean"])
    )
    assert torch.equal(g["w"], torch.full((3,), 1.0)), "pure: inputs untouched"


def test_ugsa_weight_normalisers():
    sig = [0.5, 1.0, 2.0]
    e = [math.exp(-0.2 * s) for s in sig]
    assert ugsa_weight(sig, beta=0.2, normalizer="history") == pytest.approx(e[-1] / sum(e))
    assert ugsa_weight(sig, beta=0.2, normalizer="mean") == pytest.approx(e[-1] / (sum(e) / 3))
    assert ugsa_weight(sig, beta=0.2, normalizer="none") == pytest.approx(e[-1])
    assert ugsa_weight([0.7], beta=0.2, normalizer="history") == pytest.approx(1.0), (
        "the first client gets the whole gate"
    )


def test_more_uncertain_client_gets_less_weight():
    assert ugsa_weight([0.1, 2.0], beta=1.0, normalizer="history") < ugsa_weight(
        [2.0, 0.1], beta=1.0, normalizer="history"
    )


def test_fedavg_running_average_equals_mean_of_all_models():
    models = [state(v) for v in (0.0, 2.0, 5.0, 9.0)]
    g, hist = models[0], MergeHistory()
    for m in models[1:]:
        g, w = FedAvgMerge().merge(g, m, sigma=0.0, history=hist)
        hist = advance(hist, sigma=0.0, weight=w)
    ref = weighted_average([(m, 1.0) for m in models])
    assert torch.allclose(g["w"], ref["w"]) and torch.allclose(g["bn.running_mean"], ref["bn.running_mean"])


def test_gamma_zero_and_none_keep_the_global_model():
    g, c = state(1.0), state(7.0)
    out, _ = UGSAMerge(gamma=0.0).merge(g, c, sigma=0.3, history=MergeHistory())
    assert torch.equal(out["w"], g["w"])
    out, w = create_aggregator("none").merge(g, c, sigma=0.3, history=MergeHistory())
    assert out is g and w == 0.0


def test_bad_aggregator_settings():
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        create_aggregator("ugsa", gamma=-0.1)
    with pytest.raises(ValueError, match="beta must be >= 0"):
        create_aggregator("ugsa", beta=-1)
    with pytest.raises(ValueError, match="valid names are: fedavg, none, sequential, ugsa"):
        create_aggregator("fedprox")
    with pytest.raises(ValueError, match="valid names are: history, mean, none"):
        create_aggregator("ugsa", normalizer="sum")


def test_l2_distance():
    assert l2_distance(state(1.0), state(3.0), ["w"]) == pytest.approx(math.sqrt(3 * 4))


def test_sequential_hands_the_client_model_on():
    g, c = state(1.0, 3), state(7.0, 8)
    out, w = SequentialMerge().merge(g, c, sigma=2.0, history=advance(MergeHistory(), sigma=0.1, weight=1.0))
    assert w == 1.0
    assert all(torch.equal(out[k], c[k]) for k in c), "θ_G ← θ'_k, buffers and counters included"
    assert create_aggregator("sequential").__class__ is SequentialMerge
