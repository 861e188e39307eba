"""Server rules: FedPAD's closed forms and the paper's stability lemmas, prototype aggregation,
FedAdam/SCAFFOLD/FedDyn against hand-written references, and the statistics used in the report."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcore.aggregate import prototypes as P
from fedcore.aggregate.functions import fedadam_step, softmax
from fedcore.aggregate.strategies import create_strategy
from fedcore.train.base import ClientUpdate


def protos(table, counts=None):
    classes = sorted(table)
    return {
        "classes": torch.tensor(classes),
        "protos": torch.stack([torch.tensor(table[k], dtype=torch.float32) for k in classes]),
        "counts": torch.tensor([(counts or {}).get(k, 1) for k in classes]),
    }


def test_theta_is_the_maximiser_of_the_entropy_regularised_objective():
    """θ = softmax(γd) maximises ⟨θ, d⟩ − (1/γ) Σ θ log θ over the simplex (checked against random points)."""
    rng = np.random.default_rng(0)
    d, gamma = rng.uniform(0, 5, size=6), 0.7
    theta = np.array(P.prototype_weights(list(d), gamma=gamma))

    def objective(t):
        return float(t @ d - (1 / gamma) * np.sum(t * np.log(t)))

    best = objective(theta)
    for _ in range(2000):
        assert objective(rng.dirichlet(np.ones(6))) <= best + 1e-12


def test_larger_deviation_gets_larger_prototype_weight_and_smaller_model_weight():
    d = [1.0, 2.0, 5.0]
    theta = P.prototype_weights(d, gamma=1.0)
    alpha = P.model_weights(theta, tau=0.1)
    assert theta[0] < theta[1] < theta[2] and alpha[0] > alpha[1] > alpha[2]
    assert math.isclose(sum(theta), 1) and math.isclose(sum(alpha), 1)


@pytest.mark.parametrize("gamma,tau", [(0.5, 0.1), (2.0, 0.5), (0.05, 0.05)])
def test_the_papers_weight_drift_bound_holds(gamma, tau):
    """Lemmas 1–2: ‖α(d) − α(d')‖₁ ≤ γ/(4τ) · ‖d − d'‖_∞."""
    rng = np.random.default_rng(1)
    for _ in range(500):
        d, d2 = rng.uniform(0, 10, 8), rng.uniform(0, 10, 8)
        a = np.array(P.model_weights(P.prototype_weights(list(d), gamma=gamma), tau=tau))
        a2 = np.array(P.model_weights(P.prototype_weights(list(d2), gamma=gamma), tau=tau))
        assert np.abs(a - a2).sum() <= gamma / (4 * tau) * np.abs(d - d2).max() + 1e-12


def test_ablation_modes():
    d = [1.0, 3.0]
    theta = P.prototype_weights(d, gamma=1.0)
    assert P.model_weights(theta, tau=0.1, mode="uniform") == [0.5, 0.5]
    assert P.model_weights(theta, tau=0.1, mode="direct", deviations=d) == pytest.approx(softmax(d, scale=-10))
    assert P.model_weights(theta, tau=0.1, mode="normalized", deviations=d) == pytest.approx(
        softmax([0.25, 0.75], scale=-10)
    )
    with pytest.raises(ValueError, match="valid names are: fedpad, uniform, direct, normalized, sized"):
        P.model_weights(theta, tau=0.1, mode="inverse", deviations=d)


def test_sized_alpha_tilts_example_weights_by_fedpads_and_reduces_to_each():
    theta = P.prototype_weights([1.0, 3.0, 2.0], gamma=1.0)
    alpha = P.model_weights(theta, tau=0.1)
    sizes = [100, 300, 50]
    sized = P.model_weights(theta, tau=0.1, mode="sized", sizes=sizes)
    by_hand = np.array(sizes) * np.array(alpha)
    assert sized == pytest.approx(list(by_hand / by_hand.sum()))
    assert P.model_weights(theta, tau=0.1, mode="sized", sizes=[7, 7, 7]) == pytest.approx(alpha)  # equal sizes: α
    flat = P.prototype_weights([2.0, 2.0, 2.0], gamma=1.0)  # equal deviations: FedAvg's n/Σn
    assert P.model_weights(flat, tau=0.1, mode="sized", sizes=sizes) == pytest.approx([100 / 450, 300 / 450, 50 / 450])
    with pytest.raises(ValueError, match="needs each client's example count"):
        P.model_weights(theta, tau=0.1, mode="sized")


def test_fedavg_weighting_by_clients_is_the_plain_mean_and_a_bad_name_is_refused():
    glob, ups = _random_round(4, seed=3)
    s = create_strategy("fedavg", weighting="clients")
    s.setup(glob, num_clients=20, param_keys=["w", "b"])
    fold = s.fold(glob, sizes=[u.num_examples for _, u in ups], num_clients=20)
    for i, u in ups:
        fold.add(i, u)
    out, ref = fold.finish().state, _mean_by_hand([(u.state, 1.0) for _, u in ups])
    assert all(torch.equal(out[k], ref[k]) for k in ("w", "b", "bn.running_mean"))
    assert s.client_weighting == "clients" and create_strategy("fedavg").client_weighting == "examples"
    with pytest.raises(ValueError, match="unknown weighting 'uniform'; use one of examples, clients"):
        create_strategy("fedavg", weighting="uniform")


def test_deviation_counts_only_classes_both_sides_have():
    g = protos({0: [0, 0], 1: [1, 1]})
    c = protos({1: [4, 5], 2: [9, 9]})  # class 2 is new to the server, class 0 absent at the client
    assert P.deviation(c, g) == pytest.approx(5.0)
    assert P.deviation(c, P.empty_protos()) == 0.0
    assert P.mean_distance(protos({2: [0, 0]}), g) != P.mean_distance(protos({2: [0, 0]}), g)  # nan: no shared class


def test_prototype_aggregation_renormalises_per_class_and_keeps_absent_classes():
    a, b = protos({0: [0.0], 1: [2.0]}), protos({1: [4.0]})
    prev = protos({0: [9.0], 5: [7.0]}, counts={5: 3})
    out = P.aggregate_prototypes([a, b], [0.25, 0.75], prev)
    table = P.as_table(out)
    assert table[0].item() == 0.0, "only client a has class 0: its weight renormalises to 1"
    assert table[1].item() == pytest.approx(0.25 * 2 + 0.75 * 4)
    assert table[5].item() == 7.0 and int(out["counts"][out["classes"].tolist().index(5)]) == 3
    counted = P.aggregate_prototypes([protos({1: [2.0]}, {1: 1}), protos({1: [4.0]}, {1: 3})], [1, 1], by_counts=True)
    assert P.as_table(counted)[1].item() == pytest.approx(3.5)


def _update(state, n=10, **payload):
    return ClientUpdate(state=state, num_examples=n, payload=payload)


def test_fedpad_strategy_weights_models_by_alpha_and_remembers_prototypes():
    s = create_strategy("fedpad", gamma=1.0, tau=0.1)
    g = {"w": torch.zeros(2)}
    s.setup(g, num_clients=2, param_keys=["w"])
    first = s.aggregate(
        g,
        [
            (0, _update({"w": torch.tensor([1.0, 1.0])}, prototypes=protos({0: [0.0]}))),
            (1, _update({"w": torch.tensor([3.0, 3.0])}, prototypes=protos({0: [2.0]}))),
        ],
        num_clients=2,
    )
    assert torch.allclose(first.state["w"], torch.tensor([2.0, 2.0])), "no global prototypes yet: α uniform"
    assert P.as_table(s.protos)[0].item() == pytest.approx(1.0)
    second = s.aggregate(
        g,
        [
            (0, _update({"w": torch.tensor([1.0, 1.0])}, prototypes=protos({0: [1.0]}))),
            (1, _update({"w": torch.tensor([3.0, 3.0])}, prototypes=protos({0: [5.0]}))),
        ],
        num_clients=2,
    )
    d = [0.0, 4.0]
    theta = softmax(d, scale=1.0)
    alpha = softmax(theta, scale=-10.0)
    assert second.per_client[1]["deviation"] == pytest.approx(4.0)
    assert second.state["w"][0].item() == pytest.approx(alpha[0] * 1 + alpha[1] * 3, rel=1e-6)
    assert second.metrics["weight_drift"] == pytest.approx(abs(alpha[0] - 0.5) + abs(alpha[1] - 0.5))
    assert second.metrics["deviation_change"] == pytest.approx(4.0)
    restored = create_strategy("fedpad", gamma=1.0, tau=0.1)
    restored.setup(g, num_clients=2, param_keys=["w"])
    restored.load_state_dict(s.state_dict())
    assert torch.equal(restored.protos["protos"], s.protos["protos"]) and restored.last_alpha == s.last_alpha


def test_fedadam_step_matches_the_fedopt_update_by_hand():
    g, avg = {"w": torch.tensor([1.0, -1.0])}, {"w": torch.tensor([1.5, -2.0])}
    m, v = {"w": torch.zeros(2)}, {"w": torch.zeros(2)}
    out, m2, v2 = fedadam_step(g, avg, m=m, v=v, keys=["w"], lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    delta = torch.tensor([0.5, -1.0])
    mm, vv = 0.1 * delta, 0.01 * delta**2
    assert torch.allclose(m2["w"], mm) and torch.allclose(v2["w"], vv)
    assert torch.allclose(out["w"], g["w"] + 0.1 * mm / (vv.sqrt() + 1e-3))


def test_scaffold_server_moves_to_the_mean_and_updates_the_control_variate():
    s = create_strategy("scaffold")
    g = {"w": torch.zeros(1)}
    s.setup(g, num_clients=4, param_keys=["w"])
    ups = [
        (0, _update({"w": torch.tensor([2.0])}, delta_c={"w": torch.tensor([1.0])})),
        (1, _update({"w": torch.tensor([4.0])}, delta_c={"w": torch.tensor([3.0])})),
    ]
    out = s.aggregate(g, ups, num_clients=4)
    assert out.state["w"].item() == 3.0
    assert s.c["w"].item() == pytest.approx(2 / 4 * 2.0), "c += |S|/N · mean(Δc_i)"


def test_feddyn_server_subtracts_the_running_drift():
    s = create_strategy("feddyn", alpha=0.5)
    g = {"w": torch.zeros(1)}
    s.setup(g, num_clients=2, param_keys=["w"])
    out = s.aggregate(
        g, [(0, _update({"w": torch.tensor([2.0])})), (1, _update({"w": torch.tensor([4.0])}))], num_clients=2
    )
    h = -0.5 / 2 * (2.0 + 4.0)
    assert s.h["w"].item() == pytest.approx(h)
    assert out.state["w"].item() == pytest.approx(3.0 - h / 0.5)


def test_wilcoxon_and_friedman_on_a_known_case():
    from fedcore.evaluate.stats import friedman_ranks, wilcoxon_against

    scores = {
        "a": [0.9, 0.8, 0.85, 0.7, 0.75, 0.95],
        "b": [0.5, 0.4, 0.6, 0.3, 0.2, 0.1],
        "c": [0.6, 0.5, 0.7, 0.4, 0.3, 0.2],
    }
    tests = {t.other: t for t in wilcoxon_against(scores, "a")}
    assert tests["b"].wins == 6 and tests["b"].p_value == pytest.approx(2 / 2**6)
    assert friedman_ranks(scores) == {"a": 1.0, "b": 3.0, "c": 2.0}


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_scaffold_option_two_recovers_a_constant_gradient_under_momentum(momentum):
    """(x − y)/(K_eff·η) equals the gradient when it is constant, whatever torch SGD's momentum."""
    from fedcore.train.scaffold import effective_steps

    g, lr, steps = torch.tensor([0.3, -1.2]), 0.05, 17
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum)
    for _ in range(steps):
        p.grad = g.clone()
        opt.step()
    estimate = (torch.zeros(2) - p.detach()) / (effective_steps(steps, momentum) * lr)
    assert torch.allclose(estimate, g, atol=1e-5)


def _random_round(n: int, seed: int = 0):
    """A round of ``n`` updates of a two-layer state with an integer buffer, and SCAFFOLD's Δc."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (7, 5), "b": (5,), "bn.running_mean": (5,)}
    glob = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
    glob["bn.num_batches_tracked"] = torch.tensor(3)
    ups = []
    for i in range(n):
        st = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
        st["bn.num_batches_tracked"] = torch.tensor(10 + i)
        dc = {k: torch.randn(*shapes[k], generator=g) for k in ("w", "b")}
        ups.append((3 * i, ClientUpdate(st, num_examples=5 + 3 * i, payload={"delta_c": dc})))
    return glob, ups


def _mean_by_hand(pairs):
    """The weighted mean over a whole list: each key's float64 sum of s·(w/total), added in list order."""
    total = float(sum(w for _, w in pairs))
    out = {}
    for key, ref in pairs[0][0].items():
        if ref.is_floating_point():
            acc = torch.zeros_like(ref, dtype=torch.float64)
            for state, w in pairs:
                acc += state[key].to(torch.float64) * (w / total)
            out[key] = acc.to(ref.dtype)
        else:
            out[key] = pairs[-1][0][key].clone()
    return out


def _whole_round_reference(name, glob, ups, num_clients, server):
    """Each server's rule written over the whole round's list."""
    weighted_average = _mean_by_hand
    keys = ["w", "b"]
    if name in ("fedavg", "fedadam"):
        avg = weighted_average([(u.state, u.num_examples) for _, u in ups])
        if name == "fedavg":
            return avg
        out, _, _ = fedadam_step(
            glob, avg, m=server["m"], v=server["v"], keys=keys, lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3
        )
        return out
    mean = weighted_average([(u.state, 1.0) for _, u in ups])
    out = dict(mean)
    for k in keys:
        if name == "scaffold":
            out[k] = glob[k] + 1.0 * (mean[k] - glob[k])
        else:
            drift = sum(u.state[k] - glob[k] for _, u in ups)
            h = server["h"][k] - 0.01 / num_clients * drift
            out[k] = mean[k] - h / 0.01
    return out


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "feddyn", "fedadam"])
def test_a_folded_round_equals_the_whole_round_rule_bit_for_bit(name):
    """The weighted-sum servers take each update as it arrives and hold no list, yet give exactly the
    weights (and server state) that the rule over the whole round gives; integer buffers come from the newest."""
    glob, ups = _random_round(6)
    s = create_strategy(name)
    s.setup(glob, num_clients=20, param_keys=["w", "b"])
    for _ in range(2):  # a second round also starts from non-zero server state
        before = {k: dict(v) for k, v in s.state_dict().items()}
        ref = _whole_round_reference(name, glob, ups, 20, before)
        fold = s.fold(glob, sizes=[u.num_examples for _, u in ups], num_clients=20)
        assert not hasattr(fold, "updates") or not fold.updates
        for i, u in ups:
            fold.add(i, u)
        assert not getattr(fold, "updates", []), "a weighted-sum server must not keep the updates"
        out = fold.finish().state
        assert list(out) == list(ref)
        for k in ref:
            assert torch.equal(out[k], ref[k]), k
        assert int(out["bn.num_batches_tracked"]) == 15
        glob = out


def test_a_folded_round_with_an_update_missing_rescales_to_the_same_average():
    """A round whose server dropped an update it expected (NaN weights) still gets the average of the rest."""
    from fedcore.aggregate.functions import weighted_average

    glob, ups = _random_round(5, seed=1)
    s = create_strategy("fedavg")
    s.setup(glob, num_clients=20, param_keys=["w", "b"])
    fold = s.fold(glob, sizes=[u.num_examples for _, u in ups], num_clients=20)
    for i, u in ups[:-1]:
        fold.add(i, u)
    out = fold.finish().state
    ref = weighted_average([(u.state, u.num_examples) for _, u in ups[:-1]])
    for k in ("w", "b", "bn.running_mean"):
        assert torch.allclose(out[k], ref[k], rtol=1e-6, atol=1e-7)


def test_a_server_that_needs_the_whole_round_is_given_it_by_the_default_fold():
    glob, ups = _random_round(4, seed=2)
    s = create_strategy("fedproto")
    fold = s.fold(glob, sizes=[u.num_examples for _, u in ups], num_clients=20)
    for i, u in ups:
        fold.add(i, u)
    assert [i for i, _ in fold.updates] == [i for i, _ in ups]


def test_a_subclass_of_fedavg_that_replaces_aggregate_is_given_the_whole_round():
    """Folding FedAvg's sum would silently train plain FedAvg in place of the subclass's own rule."""
    from fedcore.aggregate.strategies import Aggregated, FedAvg

    class Newest(FedAvg):
        def aggregate(self, global_state, updates, *, num_clients):
            return Aggregated(dict(updates[-1][1].state))

    glob, ups = _random_round(3, seed=3)
    s = Newest()
    s.setup(glob, num_clients=20, param_keys=["w", "b"])
    fold = s.fold(glob, sizes=[u.num_examples for _, u in ups], num_clients=20)
    for i, u in ups:
        fold.add(i, u)
    assert torch.equal(fold.finish().state["w"], ups[-1][1].state["w"])


@pytest.mark.parametrize(
    "name, params, label",
    [
        ("fedavg", {}, "n"),
        ("fedavg", {"weighting": "clients"}, "1/m"),
        ("scaffold", {}, "1/m"),
        ("feddyn", {}, "1/m"),
        ("fedadam", {}, "n"),
        ("fedproto", {}, "n"),
        ("fedpad", {}, "α(θ)"),
        ("fedpad", {"alpha_mode": "uniform"}, "1/m"),
        ("fedpad", {"alpha_mode": "direct"}, "α(d)"),
        ("fedpad", {"alpha_mode": "normalized"}, "α(d/Σd)"),
        ("fedpad", {"alpha_mode": "sized"}, "n·α(θ)"),
        ("fedpd", {}, "–"),  # alignment: no one weight per client
    ],
)
def test_each_server_says_how_it_weighs_clients(name, params, label):
    assert create_strategy(name, **params).weighting_label == label
