"""FedPD++: alignment invariants, masks and parts, divide-and-conquer fusion, the PROSER trainer and the strategy."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from fedcore.aggregate import weighted_average
from fedcore.aggregate.fedpd import FedPD
from fedcore.engine import RoundConfig, RoundData, run_rounds
from fedcore.engine.checkpoint import RunInterrupted
from fedcore.engine.spec import ModelSpec
from fedcore.models import create_model, mix_split
from fedcore.openset.align import Chain, align_chain, apply_chain, layer_plan, transport
from fedcore.openset.gdca import fuse
from fedcore.openset.masks import delta_soft, make_mask, masks_from_scores, normalise, split_parts
from fedcore.train import ClientUpdate, create_trainer


class MLP(nn.Module):
    sequential = True

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 10), nn.ReLU(),
                                 nn.Linear(10, 3))

    def forward(self, x):
        return self.net(x)


def lenet(seed=0, classes=7):
    torch.manual_seed(seed)
    m = create_model("lenet", in_channels=1, num_classes=classes)
    for mod in m.modules():  # BatchNorm vectors that differ per channel, so a wrong reorder would show
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.normal_()
            mod.running_var.uniform_(0.5, 2.0)
            mod.weight.data.uniform_(0.5, 1.5)
            mod.bias.data.normal_()
    return m.eval()


def permuted(model, seed=1):
    """(state of model with every hidden layer's units shuffled, the permutation matrices used)."""
    g = torch.Generator().manual_seed(seed)
    plan = layer_plan(model)
    perms = [torch.eye(layer.out)[torch.randperm(layer.out, generator=g)] for layer in plan[:-1]] + [None]
    return apply_chain(model.state_dict(), plan, Chain(P=perms)), perms


def outputs(model_fn, state, x):
    m = model_fn()
    m.load_state_dict(state)
    return m.eval()(x)


# ---------------------------------------------------------------------------------------------- alignment
@pytest.mark.parametrize("make", [lambda: MLP().eval(), lenet], ids=["mlp", "conv+bn"])
def test_a_permuted_network_is_aligned_back_and_the_transport_is_the_permutation(make):
    # Prepare: B is A with its hidden units shuffled (conv channels with their BatchNorm vectors)
    torch.manual_seed(0)
    a = make()
    b_state, perms = permuted(a)
    plan = layer_plan(a)
    x = torch.randn(4, 1, 28, 28) if isinstance(a, nn.Module) and not isinstance(a, MLP) else torch.randn(4, 12)
    fresh = (lambda: type(a)()) if isinstance(a, MLP) else (lambda: create_model("lenet", in_channels=1, num_classes=7))
    for method, tol in (("hungarian", 0.0), ("sinkhorn", 1e-2)):
        # Execute
        chain = align_chain(a.state_dict(), b_state, plan, method=method, reg=0.01)
        aligned = apply_chain(a.state_dict(), plan, chain)
        # Assert: each transport is the shuffle; the aligned weights are B's; the function is A's
        for P, perm in zip(chain.P, perms):
            if perm is not None:
                assert (P - perm.double()).abs().max() <= tol + 1e-9
        for k, v in b_state.items():
            if v.is_floating_point():
                assert torch.allclose(aligned[k].float(), v.float(), atol=max(tol, 1e-6) * 10), k
        assert torch.allclose(outputs(fresh, aligned, x), a(x), atol=1e-4 if method == "hungarian" else 5e-2)


def test_alignment_preserves_the_function_of_a_reordered_model():
    a = lenet()
    x = torch.randn(6, 1, 28, 28)
    b_state, _ = permuted(a, seed=7)
    assert torch.allclose(outputs(lambda: create_model("lenet", in_channels=1, num_classes=7), b_state, x), a(x),
                          atol=1e-5)


def test_models_alignment_cannot_follow_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="cannot be aligned.*align=none"):
        layer_plan(create_model("resnet20", in_channels=3, num_classes=10))
    with pytest.raises(ValueError, match="has no layer to mix at.*lenet"):
        mix_split(create_model("resnet20", in_channels=3, num_classes=10))
    with pytest.raises(ValueError, match="cannot be aligned"):
        FedPD(align="sinkhorn").bind_model(create_model("resnet20", in_channels=3, num_classes=10))


def test_sinkhorn_that_fails_warns_with_advice_and_never_returns_nan():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randn(8, 5, generator=g, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="layer x: Sinkhorn did not converge in 1 iterations.*increase max_iter or reg"):
        t = transport(a, b, method="sinkhorn", reg=0.05, max_iter=1, where="layer x")
    assert torch.isfinite(t.P).all()
    with pytest.raises(ValueError, match="unknown alignment 'ot'"):
        transport(a, a, method="ot")


# ---------------------------------------------------------------------------------------------- masks
def test_scores_normalise_to_quantiles_and_hard_masks_keep_half():
    s = torch.tensor([[0.0, 3.0], [1.0, 2.0]])
    q = normalise(s)
    assert torch.allclose(q, torch.tensor([[0.0, 1.0], [1 / 3, 2 / 3]]))
    assert make_mask(q, mode="hard", delta=0.5).sum() == 2  # the paper's mask ratio 0.5
    soft = make_mask(q, mode="soft", delta=0.6)
    assert torch.allclose(soft, torch.tensor([[0.0, 1.0], [1 / 3, 1.0]]))
    assert torch.allclose(normalise(torch.zeros(5)), torch.full((5,), 0.5))  # ties share their rank
    assert delta_soft(0, 10) == 0.5 and delta_soft(9, 10) == pytest.approx(0.8)  # first and last round
    assert delta_soft(3, 10) == pytest.approx(0.6) and delta_soft(0, 1) == pytest.approx(0.8)


def test_the_parts_partition_the_parameters_consistently():
    g = torch.Generator().manual_seed(0)
    keys = {"w": (4, 3), "b": (4,)}
    mc = masks_from_scores({k: torch.rand(s, generator=g) for k, s in keys.items()}, mode="soft", delta=0.7)
    mo = masks_from_scores({k: torch.rand(s, generator=g) for k, s in keys.items()}, mode="soft", delta=0.7)
    parts = split_parts(mc, mo, mode="three")
    for k in keys:
        union = mc[k] + mo[k] - mc[k] * mo[k]
        assert torch.allclose(parts["close"][k] + parts["open"][k] + parts["share"][k], union)
        assert torch.allclose(parts["close"][k] + parts["open"][k] + parts["share"][k] + parts["rest"][k],
                              torch.ones_like(union))
        assert all((parts[p][k] >= -1e-7).all() for p in parts)
    hard = split_parts(masks_from_scores({"w": torch.rand(20, generator=g)}, mode="hard", delta=0.5),
                       masks_from_scores({"w": torch.rand(20, generator=g)}, mode="hard", delta=0.5))
    total = sum(hard[p]["w"] for p in hard)
    assert torch.equal(total, torch.ones(20))  # hard parts are disjoint 0/1 sets
    with pytest.raises(ValueError, match="unknown parts 'four'"):
        split_parts(mc, mo, mode="four")


# ---------------------------------------------------------------------------------------------- fusion
def _clients(n=3, seed=0):
    torch.manual_seed(seed)
    base = create_model("lenet", in_channels=1, num_classes=7)
    states = []
    for _ in range(n):
        states.append({k: (v + 0.05 * torch.randn_like(v)) if v.is_floating_point() else v.clone()
                       for k, v in base.state_dict().items()})
    keys = [k for k, _ in base.named_parameters()]
    parts = [split_parts(masks_from_scores({k: torch.rand_like(s[k]) for k in keys}, mode="soft", delta=0.6),
                         masks_from_scores({k: torch.rand_like(s[k]) for k in keys}, mode="soft", delta=0.6))
             for s in states]
    return base, states, parts


def test_divide_and_conquer_without_alignment_is_exactly_fedavg():
    base, states, parts = _clients()
    w = [10.0, 20.0, 30.0]
    avg = weighted_average(list(zip(states, w)))
    for cut in (parts, [split_parts({k: torch.ones(1) for k in p["close"]}, {}, mode="none") for p in parts]):
        cut = cut if "close" in cut[0] else [split_parts({k: torch.ones_like(s[k]) for k in p["close"]}, {},
                                                         mode="none") for s, p in zip(states, parts)]
        fused = fuse(states, w, plan=layer_plan(base), parts=cut, ref=0, method="none")
        for k, v in avg.items():
            if v.is_floating_point():
                assert torch.allclose(fused.state[k], v, atol=1e-6), k


def test_fusing_a_reordered_copy_with_the_original_gives_the_original():
    a = lenet()
    b_state, _ = permuted(a, seed=3)
    plan = layer_plan(a)
    ones = {k: torch.ones_like(v) for k, v in a.named_parameters()}
    cut = split_parts(ones, {}, mode="none")
    fused = fuse([a.state_dict(), b_state], [1.0, 1.0], plan=plan, parts=[cut, cut], ref=0, method="hungarian")
    plain = fuse([a.state_dict(), b_state], [1.0, 1.0], plan=plan, parts=[cut, cut], ref=0, method="none")
    x = torch.randn(5, 1, 28, 28)
    build = lambda: create_model("lenet", in_channels=1, num_classes=7)  # noqa: E731
    assert torch.allclose(outputs(build, fused.state, x), a(x), atol=1e-4)
    assert not torch.allclose(outputs(build, plain.state, x), a(x), atol=1e-2)  # what alignment prevents


def test_parts_of_one_model_with_different_masks_are_not_scrambled():
    """Two clients hold the same weights but different masks: weighted part costs keep every unit in place,
    while the literal masked weights S*P match units by their mask patterns and scramble the model."""
    a = lenet()
    keys = [k for k, _ in a.named_parameters()]
    g = torch.Generator().manual_seed(0)

    def cut():
        return split_parts(masks_from_scores({k: torch.rand(a.state_dict()[k].shape, generator=g) for k in keys},
                                             mode="soft", delta=0.6),
                           masks_from_scores({k: torch.rand(a.state_dict()[k].shape, generator=g) for k in keys},
                                             mode="soft", delta=0.6))

    parts = [cut(), cut()]
    plan, x = layer_plan(a), torch.randn(5, 1, 28, 28)
    build = lambda: create_model("lenet", in_channels=1, num_classes=7)  # noqa: E731
    kept = fuse([a.state_dict(), a.state_dict()], [1.0, 1.0], plan=plan, parts=parts, ref=0, method="hungarian")
    assert torch.allclose(outputs(build, kept.state, x), a(x), atol=1e-4)
    scrambled = fuse([a.state_dict(), a.state_dict()], [1.0, 1.0], plan=plan, parts=parts, ref=0,
                     method="hungarian", part_cost="masked")
    assert not torch.allclose(outputs(build, scrambled.state, x), a(x), atol=1e-2)


def test_sba_history_changes_the_match_where_the_weights_cannot_tell():
    """Two BatchNorm channels with identical weights are told apart only by their statistics' history."""
    a = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    bank_a = torch.tensor([[5.0, -5.0, 0.0]] * 3)  # rounds x channels
    bank_b = torch.tensor([[-5.0, 5.0, 0.0]] * 3)  # channels 0 and 1 swapped
    plain = transport(a, a, method="hungarian")
    from fedcore.openset.align import bank_cost
    sba = transport(a, a, method="hungarian", extra=bank_cost(bank_a, bank_b))
    assert torch.equal(plain.P, torch.eye(3, dtype=torch.float64))
    assert torch.equal(sba.P, torch.tensor([[0.0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------- trainer
def _toy(n=64, seed=0, classes=3):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.normal(0, 1, (n, 28, 28, 1)).astype(np.float32)
    for c in range(classes):
        x[y == c, 5 * c:5 * c + 8, 5:20, :] += 2.0
    return x, y


def _train(importance, x, y, **kw):
    torch.manual_seed(0)
    m = create_model("lenet", in_channels=1, num_classes=4)
    init = {k: v.clone() for k, v in m.state_dict().items()}
    t = create_trainer("proser", **{"lr": 0.05, "batch_size": 16, "importance": importance, **kw})
    torch.manual_seed(1)
    upd = t.train(m, x, y, global_state=init, seed=1, broadcast={"round": 2, "rounds": 4})
    return init, upd


def test_dpi_scores_leave_the_update_unchanged_and_masks_are_quantile_masks():
    x, y = _toy()
    _, plain = _train("none", x, y, batch_size=len(y))  # one step each
    _, dpi = _train("dpi", x, y, batch_size=len(y))
    for k, v in plain.state.items():
        if v.is_floating_point():
            assert torch.allclose(dpi.state[k], v, atol=1e-6), k  # two backward passes, summed: the same step
    assert plain.payload == {}
    p = _train("dpi", x, y)[1].payload
    assert p["delta"] == pytest.approx(0.7)  # round 2 of 0..3: 0.5 + (2/3) * 0.3
    for part in ("mask_close", "mask_open"):
        for m in p[part].values():
            assert m.dtype == torch.float16 and float(m.min()) >= 0 and float(m.max()) <= 1
        share_of_ones = np.mean([float((m == 1).float().mean()) for m in p[part].values() if m.numel() > 10])
        assert share_of_ones == pytest.approx(0.30, abs=0.05)  # above the 0.7 quantile


def test_dpi_of_a_parameter_that_never_moves_is_zero():
    class Dead(nn.Module):
        """A LeNet whose extra branch sees only zeros: its weight gets no gradient and never moves."""

        mix_at = 8

        def __init__(self):
            super().__init__()
            base = create_model("lenet", in_channels=1, num_classes=4)
            self.features, self.fc = base.features, base.fc
            self.dead = nn.Linear(3, 4, bias=False)

        def forward(self, x):
            return self.fc(self.features(x)) + self.dead(torch.zeros(len(x), 3))

    x, y = _toy()
    t = create_trainer("proser", lr=0.05, batch_size=16, importance="dpi", score_norm="max", weight_decay=0.0)
    m = Dead()
    before = m.dead.weight.detach().clone()
    t.train(m, x, y, global_state=m.state_dict(), seed=0, broadcast={})
    assert torch.equal(m.dead.weight, before)
    assert float(t._scores["close"]["dead.weight"].abs().max()) == 0.0
    assert float(t._scores["open"]["dead.weight"].abs().max()) == 0.0
    assert float(t._scores["close"]["fc.weight"].abs().max()) > 0


def test_proser_settings_are_checked():
    with pytest.raises(ValueError, match="unknown importance 'dpl'"):
        create_trainer("proser", importance="dpl")
    with pytest.raises(ValueError, match="quantiles in"):
        create_trainer("proser", delta_end=1.5)
    with pytest.raises(ValueError, match="no setting 'lamda'"):
        create_trainer("proser", lamda=1.0)


# ---------------------------------------------------------------------------------------------- strategy
def _data():
    clients = [_toy(48, s) for s in range(3)]
    return RoundData(client_x=[c[0] for c in clients], client_y=[c[1] for c in clients],
                     client_group=["a", "b", "c"], eval_sets={"t": _toy(40, 9)})


SPEC = ModelSpec(name="lenet", in_channels=1, num_classes=4, norm="batch")


def test_fedpd_resumes_to_the_same_run_and_keeps_a_bounded_bn_bank(tmp_path):
    data = _data()
    cfg = RoundConfig(rounds=3, trainer="proser", trainer_params={"lr": 0.05, "batch_size": 16, "importance": "dpi"},
                      strategy="fedpd", strategy_params={"sba_window": 2}, seed=0)
    full = run_rounds(data, SPEC, cfg)
    with pytest.raises(RunInterrupted):
        run_rounds(data, SPEC, cfg, checkpoint_dir=tmp_path, stop_after=2)
    resumed = run_rounds(data, SPEC, cfg, checkpoint_dir=tmp_path, resume=True)
    for k, v in full.final_state.items():
        assert torch.equal(resumed.final_state[k], v), k
    last = full.records[-1]
    assert {"align_cost", "transport_entropy", "mask.close", "mask.open", "mask.share", "bn_drift"} <= set(last)
    # the bank holds at most sba_window rounds: 3 clients x 2 rounds x (32 + 64) channels x 4 bytes + round ids
    assert last["sba_bank_bytes"] == 3 * (2 * 96 * 4 + 2 * 8)


def test_fedpd_refuses_updates_without_masks_and_names_the_fix():
    s = FedPD(parts="three")
    s.bind_model(create_model("lenet", in_channels=1, num_classes=4))
    state = create_model("lenet", in_channels=1, num_classes=4).state_dict()
    s.setup(state, num_clients=1, param_keys=[k for k in state if not k.endswith(("running_mean", "running_var",
                                                                                   "num_batches_tracked"))])
    with pytest.raises(ValueError, match="client 0 sent no masks.*importance dpi"):
        s.aggregate(state, [(0, ClientUpdate(state=state, num_examples=1))], num_clients=1)
    with pytest.raises(ValueError, match="unknown align 'exact'"):
        FedPD(align="exact")


def test_a_fedpd_run_is_reproducible():
    data = _data()
    cfg = RoundConfig(rounds=2, trainer="proser", trainer_params={"lr": 0.05, "batch_size": 16, "importance": "dpi"},
                      strategy="fedpd", seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = run_rounds(data, SPEC, cfg), run_rounds(data, SPEC, cfg)
    assert [r["avg_acc"] for r in a.records] == [r["avg_acc"] for r in b.records]
    assert all(torch.equal(a.final_state[k], b.final_state[k]) for k in a.final_state)


def test_a_round_whose_model_misses_a_class_scores_openmax_as_nan_and_goes_on():
    from fedcore.openset.evaluate import openset_evaluate

    spec = ModelSpec(name="lenet", in_channels=1, num_classes=3, norm="batch")
    state = spec.build().state_dict()
    state["fc.bias"] = torch.tensor([100.0, 0.0, 0.0])  # predicts class 0 for everything
    x, y = _toy(30, classes=3)
    xu, _ = _toy(10, seed=5)
    with pytest.warns(RuntimeWarning, match="OpenMax cannot be fitted.*class 1"):
        out = openset_evaluate(state, spec, {"d": (x, y)}, {"d": xu}, scores=["msp", "openmax"], fit=(x, y))
    assert np.isnan(out["auroc.openmax"]) and np.isnan(out["oscr.openmax.d"])
    assert 0 <= out["auroc.msp"] <= 1 and out["auroc"] == out["auroc.msp"]
    assert out["acc.d"] == pytest.approx(float(np.mean(y == 0)))


def test_unknown_scenarios_score_only_their_rows_and_the_full_set_equals_the_headline():
    from fedcore.openset.evaluate import logits_of, openset_evaluate
    from fedcore.openset.metrics import auroc, msp_score

    spec = ModelSpec(name="lenet", in_channels=1, num_classes=3, norm="batch")
    torch.manual_seed(0)
    state = spec.build().state_dict()
    x, y = _toy(30, classes=3)
    xu, _ = _toy(12, seed=5)
    half = np.arange(12) < 5
    sets = {"all": {"d": np.ones(12, bool)}, "part": {"d": half}}
    out = openset_evaluate(state, spec, {"d": (x, y)}, {"d": xu}, scores=["msp"], unknown_sets=sets)
    assert out["auroc_all.msp.d"] == out["auroc.msp.d"] and out["auroc_all"] == out["auroc"]
    model = spec.build()
    model.load_state_dict(state)
    expect = auroc(msp_score(logits_of(model, x)), msp_score(logits_of(model, xu[half])))
    assert out["auroc_part.msp.d"] == pytest.approx(expect) and out["auroc_part"] == out["auroc_part.msp"]
    assert out["auroc_part"] != out["auroc"]  # a different set of unknowns, a different score
    plain = openset_evaluate(state, spec, {"d": (x, y)}, {"d": xu}, scores=["msp"])
    assert not any(k.startswith("auroc_") for k in plain)
