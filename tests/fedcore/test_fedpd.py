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
from fedcore.openset.align import (
    align_chain,
    apply_chain,
    layer_plan,
    permutation_source,
    shuffled_chain,
    transport,
)
from fedcore.openset.gdca import fuse
from fedcore.openset.masks import delta_soft, make_mask, masks_from_scores, normalise, split_parts
from fedcore.openset.sba import sba_costs
from fedcore.tensors import to_tensor
from fedcore.train import ClientUpdate, create_trainer


class MLP(nn.Module):
    sequential = True

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 10), nn.ReLU(), nn.Linear(10, 3)
        )

    def forward(self, x):
        return self.net(x)


def lenet(seed=0, classes=7, name="lenet"):
    torch.manual_seed(seed)
    m = create_model(name, in_channels=1, num_classes=classes)
    for mod in m.modules():  # BatchNorm vectors that differ per channel, so a wrong reorder would show
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.normal_()
            mod.running_var.uniform_(0.5, 2.0)
            mod.weight.data.uniform_(0.5, 1.5)
            mod.bias.data.normal_()
    return m.eval()


def resnet20(seed=0, classes=7):
    return lenet(seed, classes, name="resnet20")


def permuted(model, seed=1):
    """(state of model with every hidden layer's units shuffled, the permutation matrices used)."""
    plan = layer_plan(model)
    chain = shuffled_chain(plan, torch.Generator().manual_seed(seed))
    return apply_chain(model.state_dict(), plan, chain), chain.P


def outputs(model_fn, state, x):
    m = model_fn()
    m.load_state_dict(state)
    return m.eval()(x)


# ---------------------------------------------------------------------------------------------- alignment
@pytest.mark.parametrize("make", [lambda: MLP().eval(), lenet, resnet20], ids=["mlp", "conv+bn", "residual"])
def test_a_permuted_network_is_aligned_back_and_the_transport_is_the_permutation(make):
    # Prepare: B is A with its hidden units shuffled (conv channels with their BatchNorm vectors; in the
    # ResNet, every layer writing into one residual sum with the same shuffle)
    torch.manual_seed(0)
    a = make()
    b_state, perms = permuted(a)
    plan = layer_plan(a)
    x = torch.randn(4, 1, 28, 28) if isinstance(a, nn.Module) and not isinstance(a, MLP) else torch.randn(4, 12)
    name = "resnet20" if any(layer.tie is not None for layer in plan) else "lenet"
    fresh = (lambda: type(a)()) if isinstance(a, MLP) else (lambda: create_model(name, in_channels=1, num_classes=7))
    for method, tol in (("hungarian", 0.0), ("sinkhorn", 1e-2)):
        # Execute
        chain = align_chain(a.state_dict(), b_state, plan, method=method, reg=0.01, hard=False)
        aligned = apply_chain(a.state_dict(), plan, chain)
        # Assert: each transport is the shuffle; the aligned weights are B's; the function is A's
        for P, perm in zip(chain.P, perms):
            if perm is not None:
                assert (P - perm.double()).abs().max() <= tol + 1e-9
        for k, v in b_state.items():
            if v.is_floating_point():
                assert torch.allclose(aligned[k].float(), v.float(), atol=max(tol, 1e-6) * 10), k
        assert torch.allclose(outputs(fresh, aligned, x), a(x), atol=1e-4 if method == "hungarian" else 5e-2)


@pytest.mark.parametrize("name", ["lenet", "resnet20", "resnet18"])
def test_alignment_preserves_the_function_of_a_reordered_model(name):
    a = lenet(name=name)
    x = torch.randn(6, 1, 28, 28)
    b_state, _ = permuted(a, seed=7)
    assert torch.allclose(
        outputs(lambda: create_model(name, in_channels=1, num_classes=7), b_state, x), a(x), atol=1e-4
    )
    assert not torch.equal(
        b_state[
            "layer1.0.conv1.weight"
            if name == "resnet18"
            else "layers.0.conv1.weight"
            if name == "resnet20"
            else "features.0.weight"
        ],
        a.state_dict()[
            "layer1.0.conv1.weight"
            if name == "resnet18"
            else "layers.0.conv1.weight"
            if name == "resnet20"
            else "features.0.weight"
        ],
    )


def test_a_residual_sum_ties_its_writers_to_one_transport():
    plan = {
        layer.name: (i, layer)
        for i, layer in enumerate(layer_plan(create_model("resnet20", in_channels=3, num_classes=10)))
    }
    stem, first = plan["conv1"], plan["layers.0.conv1"]
    assert stem[1].tie is None and stem[1].src is None and first[1].src == stem[0]
    # the stem and every conv2 of the first stage write into one sum: the stem decides, the others follow
    assert [plan[f"layers.{b}.conv2"][1].tie for b in range(3)] == [stem[0]] * 3
    # a downsampling block starts a new sum: its conv2 decides together with its shortcut, whose inputs are
    # already aligned; the later blocks of that stage follow
    down, short = plan["layers.3.conv2"], plan["layers.3.shortcut.0"]
    assert down[1].tie is None and down[1].joint == (short[0],) and short[1].tie == down[0]
    assert short[1].src == stem[0] and plan["layers.4.conv2"][1].tie == down[0]
    assert plan["layers.3.shortcut.0"][1].bn[0] == "layers.3.shortcut.1.weight"
    assert plan["fc"][1].last and plan["fc"][1].src == plan["layers.6.conv2"][0]  # classes keep their order


def test_a_downsampling_shortcut_joins_the_cost_of_the_transport_it_shares():
    """Where a block's second conv cannot tell its units apart, its shortcut (joint member) must."""
    a = resnet20()
    state = a.state_dict()
    for key in ("layers.3.conv2.weight", "layers.6.conv2.weight"):  # every unit of conv2 alike ...
        state[key].zero_()
    for key in ("layers.3.bn2", "layers.6.bn2"):  # ... with its BatchNorm affine
        state[f"{key}.weight"].fill_(1.0)
        state[f"{key}.bias"].zero_()
    a.load_state_dict(state)
    b_state, perms = permuted(a, seed=5)
    plan = layer_plan(a)
    chain = align_chain(a.state_dict(), b_state, plan, method="hungarian")
    index = {layer.name: i for i, layer in enumerate(plan)}
    for name in ("layers.3.conv2", "layers.6.conv2"):
        assert torch.equal(chain.P[index[name]].float(), perms[index[name]].float()), name
    x = torch.randn(4, 1, 28, 28)
    aligned = apply_chain(a.state_dict(), plan, chain)
    assert torch.allclose(
        outputs(lambda: create_model("resnet20", in_channels=1, num_classes=7), aligned, x), a(x), atol=1e-4
    )


class _Cat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.fc = nn.Conv2d(1, 4, 3), nn.Conv2d(1, 4, 3), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(torch.cat([self.a(x), self.b(x)], 1), 1), 1))


class _NormAfterSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.bn, self.fc = nn.Conv2d(1, 4, 3), nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.bn(self.a(x) + self.b(x)), 1), 1))


class _Net(nn.Module):
    """A small traced network whose forward is given as a function of the module."""

    def __init__(self, body, bn=4, fc=4):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 1, 1)
        self.bn, self.fc = nn.BatchNorm1d(bn), nn.Linear(fc, 2)
        self.body = body

    def forward(self, x):
        return self.body(self, x)


def test_models_alignment_cannot_follow_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"GroupNorm\) is a layer alignment cannot reorder; use align=none"):
        layer_plan(create_model("resnet20", in_channels=3, num_classes=10, norm="group"))
    with pytest.raises(ValueError, match="operation cat .* cannot follow; use align=none"):
        layer_plan(_Cat())
    with pytest.raises(ValueError, match="BatchNorm that does not follow one conv .*after a sum"):
        layer_plan(_NormAfterSum())
    pool = nn.functional.adaptive_avg_pool2d
    with pytest.raises(ValueError, match="b is called more than once"):  # one weight, two orders
        layer_plan(_Net(lambda m, x: m.fc(torch.flatten(pool(m.b(m.b(m.a(x))), 1), 1))))
    with pytest.raises(ValueError, match="flattens from dim 2 to -1"):  # a linear layer over space, not channels
        layer_plan(_Net(lambda m, x: m.fc(torch.flatten(pool(m.a(x), 2), 2)).sum(-1)))
    with pytest.raises(ValueError, match="linear layer on a .batch, channels"):
        layer_plan(_Net(lambda m, x: m.fc(pool(m.a(x), 4)).sum((1, 2))))
    with pytest.raises(ValueError, match="sums 4 channels with 1 .broadcasting"):
        layer_plan(_Net(lambda m, x: m.fc(torch.flatten(pool((lambda h: m.b(h) + m.c(h))(m.a(x)), 1), 1))))
    with pytest.raises(ValueError, match="channel for channel .*a flatten"):
        layer_plan(_Net(lambda m, x: m.fc(m.bn(torch.flatten(pool(m.a(x), 2), 1))), bn=16, fc=16))
    with pytest.raises(ValueError, match="has no layer to mix at.*lenet, resnet18, resnet20"):
        mix_split(create_model("dual-lenet", in_channels=3, num_classes=10))
    with pytest.raises(ValueError, match="cannot reorder"):
        FedPD(align="sinkhorn").bind_model(create_model("resnet20", in_channels=3, num_classes=10, norm="group"))


def test_sinkhorn_tolerance_reaches_the_solver_and_the_fusion():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randn(12, 5, generator=g, dtype=torch.float64)

    def err(P):
        return float(max((P.sum(0) - 1).abs().max(), (P.sum(1) - 1).abs().max()))

    loose, tight = transport(a, b, reg=0.02, tol=1e-2), transport(a, b, reg=0.02, tol=1e-9, max_iter=5000)
    assert err(tight.P) < 1e-6 < err(loose.P)
    m = lenet()
    states = [
        m.state_dict(),
        {k: v + 0.3 * torch.randn_like(v) if v.is_floating_point() else v for k, v in m.state_dict().items()},
    ]
    cut = split_parts({k: torch.ones_like(v) for k, v in m.named_parameters()}, {}, mode="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the tight one stops at max_iter, short of 1e-9
        fused = [
            fuse(
                states,
                [1.0, 1.0],
                plan=layer_plan(m),
                parts=[cut, cut],
                ref=0,
                method="sinkhorn",
                hard=False,
                reg=0.02,
                tol=t,
            ).state
            for t in (1e-2, 1e-9)
        ]
    assert not all(torch.equal(fused[0][k], fused[1][k]) for k in fused[0])


def test_sinkhorn_that_fails_warns_with_advice_and_never_returns_nan():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randn(8, 5, generator=g, dtype=torch.float64)
    with pytest.warns(
        RuntimeWarning, match="layer x: Sinkhorn did not converge in 1 iterations.*increase max_iter or reg"
    ):
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
        assert torch.allclose(
            parts["close"][k] + parts["open"][k] + parts["share"][k] + parts["rest"][k], torch.ones_like(union)
        )
        assert all((parts[p][k] >= -1e-7).all() for p in parts)
    hard = split_parts(
        masks_from_scores({"w": torch.rand(20, generator=g)}, mode="hard", delta=0.5),
        masks_from_scores({"w": torch.rand(20, generator=g)}, mode="hard", delta=0.5),
    )
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
        states.append(
            {
                k: (v + 0.05 * torch.randn_like(v)) if v.is_floating_point() else v.clone()
                for k, v in base.state_dict().items()
            }
        )
    return base, states, _soft_parts(base, states)


def _soft_parts(base, states):
    """Random soft close/open masks per client, cut into FedPD++'s parts (drawn from the global RNG)."""
    keys = [k for k, _ in base.named_parameters()]
    return [
        split_parts(
            masks_from_scores({k: torch.rand_like(s[k]) for k in keys}, mode="soft", delta=0.6),
            masks_from_scores({k: torch.rand_like(s[k]) for k in keys}, mode="soft", delta=0.6),
        )
        for s in states
    ]


def test_divide_and_conquer_without_alignment_is_exactly_fedavg():
    base, states, parts = _clients()
    w = [10.0, 20.0, 30.0]
    avg = weighted_average(list(zip(states, w)))
    for cut in (parts, [split_parts({k: torch.ones(1) for k in p["close"]}, {}, mode="none") for p in parts]):
        cut = (
            cut
            if "close" in cut[0]
            else [
                split_parts({k: torch.ones_like(s[k]) for k in p["close"]}, {}, mode="none")
                for s, p in zip(states, parts)
            ]
        )
        fused = fuse(states, w, plan=layer_plan(base), parts=cut, ref=0, method="none")
        for k, v in avg.items():
            if v.is_floating_point():
                assert torch.allclose(fused.state[k], v, atol=1e-6), k


def test_clients_from_one_start_fuse_by_default_to_exactly_the_fedavg_average():
    """As in every round that starts from one global model: each client drifted a little from it, with its own
    masks and BatchNorm history. The default alignment finds every unit in place, so FedPD++ is FedAvg (the
    earlier soft per-part alignment spreads mass and is not)."""
    base, _, _ = _clients(n=1, seed=6)
    torch.manual_seed(7)
    states = [
        {
            k: v + 0.01 * v.std() * torch.randn_like(v) if v.is_floating_point() else v.clone()
            for k, v in base.state_dict().items()
        }
        for _ in range(4)
    ]
    parts = _soft_parts(base, states)
    plan, w = layer_plan(base), [10.0, 20.0, 30.0, 40.0]
    avg = weighted_average(list(zip(states, w)))

    fused = fuse(states, w, plan=plan, parts=parts, ref=3, banks=_banks(4, plan, seed=2))
    soft = fuse(states, w, plan=plan, parts=parts, ref=3, method="sinkhorn", hard=False, part_transport="own")

    assert fused.metrics["align_identity"] == 1.0 and soft.metrics["align_identity"] == 0.0
    for k, v in avg.items():
        if v.is_floating_point():
            assert torch.allclose(fused.state[k].double(), v.double(), atol=1e-6), k
    assert not all(torch.allclose(soft.state[k].double(), v.double(), atol=1e-6) for k, v in avg.items())


@pytest.mark.parametrize("name", ["lenet", "resnet20"])
def test_fusing_a_reordered_copy_with_the_original_gives_the_original(name):
    a = lenet(name=name)
    b_state, _ = permuted(a, seed=3)
    plan = layer_plan(a)
    ones = {k: torch.ones_like(v) for k, v in a.named_parameters()}
    cut = split_parts(ones, {}, mode="none")
    fused = fuse([a.state_dict(), b_state], [1.0, 1.0], plan=plan, parts=[cut, cut], ref=0, method="hungarian")
    plain = fuse([a.state_dict(), b_state], [1.0, 1.0], plan=plan, parts=[cut, cut], ref=0, method="none")
    x = torch.randn(5, 1, 28, 28)
    build = lambda: create_model(name, in_channels=1, num_classes=7)  # noqa: E731
    assert torch.allclose(outputs(build, fused.state, x), a(x), atol=1e-4)
    assert not torch.allclose(outputs(build, plain.state, x), a(x), atol=1e-2)  # what alignment prevents


def test_parts_of_one_model_with_different_masks_are_not_scrambled():
    """Two clients hold the same weights but different masks: weighted part costs keep every unit in place,
    while the literal masked weights S*P match units by their mask patterns and scramble the model."""
    a = lenet()
    keys = [k for k, _ in a.named_parameters()]
    g = torch.Generator().manual_seed(0)

    def cut():
        return split_parts(
            masks_from_scores(
                {k: torch.rand(a.state_dict()[k].shape, generator=g) for k in keys}, mode="soft", delta=0.6
            ),
            masks_from_scores(
                {k: torch.rand(a.state_dict()[k].shape, generator=g) for k in keys}, mode="soft", delta=0.6
            ),
        )

    parts = [cut(), cut()]
    plan, x = layer_plan(a), torch.randn(5, 1, 28, 28)
    build = lambda: create_model("lenet", in_channels=1, num_classes=7)  # noqa: E731
    kept = fuse([a.state_dict(), a.state_dict()], [1.0, 1.0], plan=plan, parts=parts, ref=0, method="hungarian")
    assert torch.allclose(outputs(build, kept.state, x), a(x), atol=1e-4)
    scrambled = fuse(
        [a.state_dict(), a.state_dict()],
        [1.0, 1.0],
        plan=plan,
        parts=parts,
        ref=0,
        method="hungarian",
        part_cost="masked",
        part_transport="own",
    )
    assert not torch.allclose(outputs(build, scrambled.state, x), a(x), atol=1e-2)


def test_sba_history_changes_the_match_where_the_weights_cannot_tell():
    """Two BatchNorm channels with identical weights are told apart only by their statistics' history."""
    a = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    bank_a = torch.tensor([[5.0, -5.0, 0.0]] * 3)  # rounds x channels
    bank_b = torch.tensor([[-5.0, 5.0, 0.0]] * 3)  # channels 0 and 1 swapped
    plain = transport(a, a, method="hungarian")
    from fedcore.openset.sba import bank_cost

    sba = transport(a, a, method="hungarian", extra=bank_cost(bank_a, bank_b))
    assert torch.equal(plain.P, torch.eye(3, dtype=torch.float64))
    assert torch.equal(sba.P, torch.tensor([[0.0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.float64))


DEFAULT: dict = {}  # FedPD++'s default alignment: exact permutations, SBA composed, float32 costs


def test_the_strategy_and_the_fusion_share_one_default_alignment():
    from fedcore.aggregate.fedpd import FedPD
    from fedcore.registry import signature_defaults

    strategy, fusion, chain = (signature_defaults(f) for f in (FedPD.__init__, fuse, align_chain))
    shared = sorted(set(strategy) & set(fusion))
    assert {k: strategy[k] for k in shared} == {k: fusion[k] for k in shared}
    assert {k: chain[k] for k in set(chain) & set(fusion)} == {k: fusion[k] for k in set(chain) & set(fusion)}
    assert strategy["align"] == fusion["method"] == chain["method"] == "hungarian"
    assert (fusion["part_transport"], fusion["hard"], fusion["sba_mode"]) == ("whole", True, "compose")


def _banks(n_clients, plan, seed=0, rounds=4):
    """Random BatchNorm histories per client, as SBA's bank keeps them: statistics say nothing about units."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"rounds": torch.arange(rounds)}
        | {layer.name: torch.randn(rounds, layer.out, generator=g) for layer in plan if len(layer.bn) > 2}
        for _ in range(n_clients)
    ]


def test_a_permutation_is_applied_as_a_gather_bit_for_bit_equal_to_the_product():
    a = lenet(name="resnet20")
    plan = layer_plan(a)
    chain = shuffled_chain(plan, torch.Generator().manual_seed(5))
    state = {k: v.double() if v.is_floating_point() else v for k, v in a.state_dict().items()}
    fast = apply_chain(state, plan, chain)
    for layer, P in zip(plan, chain.P):  # the dense product, written out
        w = state[layer.weight]
        if layer.src is not None and chain.P[layer.src] is not None:
            Q = chain.P[layer.src].double()
            w = torch.einsum("oikl,ij->ojkl", w, Q) if w.dim() == 4 else w @ Q
        if P is not None:
            w = (P.double().t() @ w.reshape(layer.out, -1)).reshape(w.shape)
            for key in ((layer.bias,) if layer.bias else ()) + layer.bn:
                assert torch.equal(fast[key], P.double().t() @ state[key]), key
        assert torch.equal(fast[layer.weight], w), layer.name
    assert permutation_source(torch.full((3, 3), 1 / 3)) is None  # a soft plan is multiplied, not gathered


@pytest.mark.parametrize("name", ["lenet", "resnet20"])
def test_a_shuffled_trained_model_is_aligned_back_to_bit_identical_outputs(name):
    # Prepare: a model trained a few steps, and a copy of it with every hidden layer's units shuffled
    torch.manual_seed(0)
    model = lenet(name=name).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 7, (32,))
    for _ in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    shuffled, _ = permuted(model, seed=11)
    plan = layer_plan(model)
    held_out = torch.randn(8, 1, 28, 28)
    build = lambda: create_model(name, in_channels=1, num_classes=7)  # noqa: E731

    # Execute: align the shuffled copy to the original with the default settings
    chain = align_chain(shuffled, model.state_dict(), plan)
    back = apply_chain(shuffled, plan, chain)

    # Assert: the original weights and outputs, bit for bit
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v), k
    assert torch.equal(outputs(build, back, held_out), model(held_out))


@pytest.mark.parametrize(
    "settings",
    [DEFAULT, dict(method="sinkhorn", reg=0.05), dict(sba_mode="added")],
    ids=["default", "sinkhorn-rounded", "sba-added"],
)
def test_hard_alignment_never_blends_units(settings):
    # Prepare: noisy, shuffled clients and histories that disagree with the weights
    base, states, parts = _clients(n=4, seed=2)
    plan = layer_plan(base)
    states = [states[0]] + [
        apply_chain(s, plan, shuffled_chain(plan, torch.Generator().manual_seed(k))) for k, s in enumerate(states[1:])
    ]
    banks = _banks(4, plan)
    soft = {k: v for k, v in settings.items() if k not in ("hard", "sba_mode", "cost_dtype")}

    # Execute
    hard_chains = [
        align_chain(s, states[0], plan, bank_costs=sba_costs(b, banks[0], plan), **settings)
        for s, b in zip(states[1:], banks[1:])
    ]
    soft_chain = align_chain(states[1], states[0], plan, **dict(soft, method="sinkhorn", reg=0.5, hard=False))

    # Assert: every transport of every chain is a permutation (the fused units follow these transports)
    for chain in hard_chains:
        for layer, P in zip(plan, chain.P):
            assert layer.last or permutation_source(P) is not None, layer.name
    assert any(P is not None and permutation_source(P) is None for P in soft_chain.P)  # what hard prevents


def test_identical_clients_give_the_identity_and_the_plain_average():
    # Prepare: three copies of one model with their own masks and their own BatchNorm histories
    base, states, parts = _clients(n=3, seed=4)
    plan = layer_plan(base)
    same = [states[0]] * 3
    w = [10.0, 20.0, 30.0]

    # Execute
    for part_transport in ("whole", "own"):
        fused = fuse(
            same, w, plan=plan, parts=parts, ref=0, banks=_banks(3, plan, seed=1), part_transport=part_transport
        )
        for k, v in states[0].items():
            if v.is_floating_point():
                assert torch.allclose(fused.state[k].float(), v.float(), atol=1e-6), (part_transport, k)
        # both other clients were found in place: no transport applied, and the round says so
        assert fused.metrics["align_identity"] == fused.metrics["align_identity_layers"] == 1.0
    soft = fuse(same, w, plan=plan, parts=parts, ref=0, method="sinkhorn", hard=False)
    assert soft.metrics["align_identity"] == 0.0  # a soft plan spreads mass even between identical models
    moved = fuse([base.state_dict(), permuted(base)[0]], w[:2], plan=plan, parts=parts[:2], ref=0)
    assert moved.metrics["align_identity"] == 0.0 and moved.metrics["align_identity_layers"] < 1.0
    chain = align_chain(states[0], states[0], plan, bank_costs=sba_costs(*_banks(2, plan, seed=3), plan))
    assert all(P is None or torch.equal(P, torch.eye(P.shape[0], dtype=P.dtype)) for P in chain.P)


def test_sba_composed_with_an_exact_match_is_the_match_and_breaks_only_ties():
    # Prepare: units with distinct weights, and histories that point elsewhere
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 5, generator=g, dtype=torch.float64)
    b = a[torch.tensor([3, 0, 5, 1, 2, 4])] + 0.01 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    history = torch.rand(6, 6, generator=g, dtype=torch.float64)
    plain = transport(a, b, method="hungarian")
    from fedcore.openset.align import couple

    first, _ = couple(history, method="hungarian")
    refined = transport(first.t() @ a, b, method="hungarian")
    # Assert: §4.3's composition lands on the weights' own match ...
    assert torch.equal(first @ refined.P, plain.P)
    # ... and where two units' weights tie, the history decides (as the added cost does)
    tie = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    bank_a = torch.tensor([[5.0, -5.0, 0.0]] * 3)
    bank_b = torch.tensor([[-5.0, 5.0, 0.0]] * 3)
    from fedcore.openset.sba import bank_cost

    swap, _ = couple(bank_cost(bank_a, bank_b), method="hungarian")
    composed = swap @ transport(swap.t() @ tie, tie, method="hungarian").P
    assert torch.equal(composed, torch.tensor([[0.0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.float64))


def test_float32_costs_are_the_euclidean_distances():
    from fedcore.openset.align import unit_distance

    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(40, 300, generator=g), torch.randn(30, 300, generator=g)
    exact = torch.cdist(a.double(), b.double())
    fast = unit_distance(a, b)
    assert fast.dtype == torch.float32 and torch.allclose(fast.double(), exact, rtol=1e-5, atol=1e-4)
    # a unit's distance to itself is float32's rounding of |a|^2 + |a|^2 - 2 a.a, far below any other distance
    self_distance = unit_distance(a, a)
    assert float(self_distance.diagonal().max()) < 1e-3 * float(self_distance.mean())
    # rows given as column blocks (a layer's weights, then its bias and BatchNorm columns) are the same rows
    blocks = unit_distance([a[:, :290], a[:, 290:]], [b[:, :290], b[:, 290:]])
    assert torch.allclose(blocks.double(), exact, rtol=1e-5, atol=1e-4)
    assert torch.equal(unit_distance([a.double()], [b.double()]), exact)  # float64: cdist, as a whole matrix


def test_the_identity_shortcut_gives_the_solvers_answer():
    g = torch.Generator().manual_seed(1)
    from fedcore.openset.align import _assignment, couple

    n = 12
    for trial in range(30):
        C = torch.rand(n, n, generator=g, dtype=torch.float64) + 0.5
        rows = torch.arange(n)
        C[rows, rows] = C.min(1).values * (0.5 if trial % 3 == 0 else 1.0)  # the identity is optimal (ties: % 3 != 0)
        if trial % 3 == 2:  # ... or all but one row: the identity is not optimal, the solver must run
            other = (trial // 3) % (n - 1) + 1
            C[0, 0], C[0, other] = 1.0, 0.1
        P, _ = couple(C, method="hungarian")
        best = _assignment(C)
        assert float((P * C).sum()) == pytest.approx(float((best * C).sum()), abs=1e-12)  # an optimal assignment
        if trial % 3 == 0:
            assert torch.equal(P, best)  # a unique optimum: the same one
        if trial % 3 == 2:
            assert not torch.equal(P, torch.eye(n, dtype=P.dtype))
    near = torch.rand(n, n, generator=g, dtype=torch.float64) + 0.5
    near.diagonal().zero_()
    assert torch.equal(couple(near, method="sinkhorn", hard=True)[0], torch.eye(n, dtype=torch.float64))


def test_the_certificate_gives_the_solvers_permutation_or_steps_aside():
    from fedcore.openset.align import _assignment, certify, screen_of

    g = torch.Generator().manual_seed(5)
    outcomes = set()
    for trial in range(60):
        # Prepare: reference units, and a client holding them shuffled, with drift from small to larger
        # than the units' spacing; every few trials two reference units nearly coincide
        n, d = 24, 40
        b = torch.randn(n, d, generator=g)
        if trial % 4 == 3:
            b[1] = b[0] + 1e-3 * torch.randn(d, generator=g)
        shuffle = torch.randperm(n, generator=g) if trial % 2 else torch.arange(n)
        noise = [0.02, 0.2, 0.6, 1.5][(trial // 4) % 4]
        a = b[shuffle] + noise * torch.randn(n, d, generator=g)
        blocks_a, blocks_b = [a[:, :36], a[:, 36:]], [b[:, :36], b[:, 36:]]

        # Execute
        proof = certify(blocks_a, blocks_b, screen_of(blocks_b))

        # Assert: a proven match is the exact assignment, with its distances; otherwise the solver runs
        if proof is not None:
            target, dist = proof
            exact = _assignment(torch.cdist(a.double(), b.double()))
            assert torch.equal(exact.argmax(1), target)
            assert torch.allclose(dist, (a.double() - b.double()[target]).norm(dim=1))
        outcomes.add((proof is not None, trial % 2 == 1))
    assert outcomes == {(True, False), (True, True), (False, False), (False, True)}  # every branch was taken
    # two coinciding reference units, swapped in the client: float64's rounding of their distance is no gap
    b = torch.randn(40, 300, generator=g, dtype=torch.float64)
    b[1] = b[0]
    a = b[torch.tensor([1, 0] + list(range(2, 40)))]
    assert certify([a], [b], screen_of([b])) is None
    # the transport it saves: the same permutation, marked certified, and the cost the full matrix gives
    a, b = torch.randn(16, 30, generator=g), torch.randn(16, 30, generator=g)
    a = b[torch.randperm(16, generator=g)] + 0.01 * a
    fast = transport(a, b, method="hungarian", dtype=torch.float32, screen=screen_of([b]))
    full = transport(a, b, method="hungarian", dtype=torch.float32)
    assert fast.certified and not full.certified and torch.equal(fast.P, full.P)
    # its cost comes from the differences (no cancellation), the solver's from float32's |a|^2 + |b|^2 - 2 a.b
    truth = float((fast.P * torch.cdist(a.double(), b.double())).sum()) / 16
    assert fast.cost == pytest.approx(truth, rel=1e-6) and full.cost == pytest.approx(truth, rel=1e-3)


@pytest.mark.parametrize("model,part_transport", [("lenet", "whole"), ("lenet", "own"), ("resnet20", "whole")])
def test_screened_alignment_fuses_exactly_as_the_solver_does(model, part_transport):
    # Prepare: noisy clients of one model, two of them shuffled, with their own masks and histories
    base = lenet(name=model)
    plan = layer_plan(base)
    g = torch.Generator().manual_seed(9)
    ref = base.state_dict()
    keys = [k for k, _ in base.named_parameters()]
    states = []
    for k in range(4):
        noisy = {
            key: v + 0.05 * v.std() * torch.randn(v.shape, generator=g)
            if v.is_floating_point() and v.numel() > 1
            else v
            for key, v in ref.items()
        }
        states.append(
            apply_chain(noisy, plan, shuffled_chain(plan, torch.Generator().manual_seed(k))) if k > 1 else noisy
        )
    cut = lambda: split_parts(  # noqa: E731
        masks_from_scores({k: torch.rand(ref[k].shape, generator=g) for k in keys}, mode="soft", delta=0.6),
        masks_from_scores({k: torch.rand(ref[k].shape, generator=g) for k in keys}, mode="soft", delta=0.6),
    )
    parts = [cut() for _ in states]
    banks = _banks(4, plan, seed=2)
    settings = dict(part_transport=part_transport, banks=banks)

    # Execute
    screened = fuse(states, [1.0, 2.0, 3.0, 4.0], plan=plan, parts=parts, ref=0, **settings)
    solved = fuse(states, [1.0, 2.0, 3.0, 4.0], plan=plan, parts=parts, ref=0, screen=False, **settings)

    # Assert: the same fused model, bit for bit; most whole-model transports were proven without a cost
    # matrix (a part's own chain, weighted by its masks, is always solved)
    for k, v in solved.state.items():
        assert torch.equal(screened.state[k], v), k
    assert screened.metrics["align_certified"] > 0.5 and "align_certified" not in solved.metrics
    assert screened.metrics["align_identity"] == solved.metrics["align_identity"] == 1 / 3  # the unshuffled client


def test_sba_composed_in_a_chain_gives_the_exact_chain_of_the_weights():
    # Prepare: noisy, shuffled clients of a residual network, BatchNorm histories that say nothing, part masks
    base = lenet(name="resnet20")
    plan = layer_plan(base)
    g = torch.Generator().manual_seed(3)
    keys = [k for k, _ in base.named_parameters()]
    ref = base.state_dict()
    client = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in ref.items()}
    client = apply_chain(client, plan, shuffled_chain(plan, torch.Generator().manual_seed(8)))
    mask = {k: torch.rand(client[k].shape, generator=g) for k in keys}
    ref_mask = {k: torch.rand(ref[k].shape, generator=g) for k in keys}
    banks = _banks(2, plan, seed=5)
    exact = dict(method="hungarian", hard=True, cost_dtype="float64")

    for masks in ({}, dict(mask=mask, ref_mask=ref_mask)):
        # Execute: SBA composed, against the weights' own exact chain
        composed = align_chain(
            client, ref, plan, bank_costs=sba_costs(banks[0], banks[1], plan), sba_mode="compose", **exact, **masks
        )
        plain = align_chain(client, ref, plan, **exact, **masks)
        # Assert: the history's reordering is undone by the match of the reordered weights, layer by layer
        for layer, P, Q in zip(plan, composed.P, plain.P):
            assert (P is None and Q is None) or torch.equal(P, Q), (layer.name, bool(masks))


def test_fedpd_alignment_settings_are_checked_with_the_choices():
    for bad, match in (
        (dict(sba_mode="after"), "sba_mode.*compose.*added"),
        (dict(part_transport="each"), "part_transport.*own.*whole"),
        (dict(cost_dtype="float16"), "cost_dtype.*float64.*float32"),
        (dict(part_cost="masked"), "part_cost='masked'.*would do nothing: set part_transport=own"),
    ):
        with pytest.raises(ValueError, match=match):
            FedPD(**bad)
    FedPD(part_cost="masked", part_transport="own")  # the literal Eq. 19-21 reading, where it acts


# ---------------------------------------------------------------------------------------------- trainer
def _toy(n=64, seed=0, classes=3):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.normal(0, 1, (n, 28, 28, 1)).astype(np.float32)
    for c in range(classes):
        x[y == c, 5 * c : 5 * c + 8, 5:20, :] += 2.0
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


def test_a_closed_set_round_trains_the_known_logits_alone_and_sends_no_masks():
    x, y = _toy()
    init, upd = _train("dpi", x, y, batch_size=len(y), local_epochs=1, weight_decay=0.0, momentum=0.0, closed_rounds=3)
    assert upd.payload == {"closed_phase": True}  # round 2 of a 3-round closed phase
    # one full-batch step of cross-entropy over the known classes' logits, the dummy's left out
    torch.manual_seed(0)
    ref = create_model("lenet", in_channels=1, num_classes=4)
    ref.load_state_dict(init)
    ref.train()
    loss = nn.functional.cross_entropy(ref(to_tensor(x))[:, :-1], torch.as_tensor(y))
    loss.backward()
    with torch.no_grad():
        for name, p_ in ref.named_parameters():
            # float32 sums in another order, which BatchNorm's cancellations amplify: a few % of a step at most,
            # where the dummy's logit in the loss would move every step by a third or more
            step, expected = upd.state[name] - init[name], -0.05 * p_.grad
            assert float((step - expected).norm() / expected.norm()) < 0.05, name
    assert torch.equal(upd.state["fc.weight"][-1], init["fc.weight"][-1])  # the dummy's row has no gradient


def test_proser_after_the_closed_phase_is_single_phase_proser_at_the_scaled_lr():
    x, y = _toy()
    _, two = _train("none", x, y, closed_rounds=2, open_lr_scale=0.01)  # round 2: the first PROSER round
    _, one = _train("none", x, y, lr=0.0005)
    assert all(torch.equal(v, one.state[k]) for k, v in two.state.items())
    _, masked = _train("dpi", x, y, closed_rounds=2, open_lr_scale=0.01)
    assert {"mask_close", "mask_open"} <= set(masked.payload)
    assert masked.payload["delta"] == pytest.approx(0.5)  # δ₀: the first round that trains the masks
    with pytest.raises(ValueError, match="closed_rounds .* must be >= 0"):
        create_trainer("proser", closed_rounds=-1)
    with pytest.raises(ValueError, match=r"open_lr_scale .* must be in \(0, 1\], got 0.0; e.g. 0.01"):
        create_trainer("proser", open_lr_scale=0.0)


def test_fedpd_fuses_a_closed_set_round_whole_and_masks_its_parts_after():
    data = _data()
    cfg = RoundConfig(
        rounds=2,
        trainer="proser",
        trainer_params={"lr": 0.05, "batch_size": 16, "importance": "dpi", "closed_rounds": 1},
        strategy="fedpd",
        strategy_params={"parts": "three"},
        seed=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run_rounds(data, SPEC, cfg)
    assert "mask.whole" in res.records[0] and "mask.close" not in res.records[0]
    assert {"mask.close", "mask.open", "mask.share"} <= set(res.records[1])


def test_clients_of_their_own_models_give_alignment_work_in_those_rounds_only():
    # Prepare: every client starts round 0 from a network of its own, then the global model
    data = _data()
    hard = {"parts": "three", "align": "hungarian", "hard": True, "sba_mode": "compose", "part_transport": "whole"}

    def run(own, align=hard):
        cfg = RoundConfig(
            rounds=2,
            trainer="proser",
            trainer_params={"lr": 0.05, "batch_size": 16, "importance": "dpi", "own_init_rounds": own},
            strategy="fedpd",
            strategy_params=align,
            seed=0,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run_rounds(data, SPEC, cfg)

    # Execute
    own, shared = run(1), run(0)
    plain = run(1, {"parts": "three", "align": "none", "sba": False})
    again = run(1)

    # Assert: round 0 has units to reorder; round 1 (from one global model) and the shared start have none
    assert own.records[0]["align_identity"] == 0.0 and own.records[0]["align_identity_layers"] < 0.5
    assert own.records[1]["align_identity"] == 1.0 and shared.records[0]["align_identity"] == 1.0
    # the same client models, fused with and without alignment: different global models
    assert own.records[0]["train_loss"] == plain.records[0]["train_loss"]
    assert not torch.equal(own.final_state["features.0.weight"], plain.final_state["features.0.weight"])
    assert all(torch.equal(v, again.final_state[k]) for k, v in own.final_state.items())  # seeded per client
    model = create_model("lenet", in_channels=1, num_classes=4)
    with pytest.raises(ValueError, match="broadcast"):
        create_trainer("proser", own_init_rounds=1).train(model, *_toy(), global_state=model.state_dict(), seed=0)
    with pytest.raises(ValueError, match="own_init_rounds"):
        create_trainer("proser", own_init_rounds=-1)


# ---------------------------------------------------------------------------------------------- strategy
def _data():
    clients = [_toy(48, s) for s in range(3)]
    return RoundData(
        client_x=[c[0] for c in clients],
        client_y=[c[1] for c in clients],
        client_group=["a", "b", "c"],
        eval_sets={"t": _toy(40, 9)},
    )


SPEC = ModelSpec(name="lenet", in_channels=1, num_classes=4, norm="batch")


def test_fedpd_resumes_to_the_same_run_and_keeps_a_bounded_bn_bank(tmp_path):
    data = _data()
    cfg = RoundConfig(
        rounds=3,
        trainer="proser",
        trainer_params={"lr": 0.05, "batch_size": 16, "importance": "dpi"},
        strategy="fedpd",
        strategy_params={"sba_window": 2},
        seed=0,
    )
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


def test_fedpd_plus_plus_trains_a_resnet_end_to_end():
    """PROSER mixes inside the ResNet, and the server aligns its parts through the residual sums."""
    data = _data()
    cfg = RoundConfig(
        rounds=2,
        trainer="proser",
        trainer_params={"lr": 0.05, "batch_size": 16, "importance": "dpi"},
        strategy="fedpd",
        strategy_params={"parts": "three", "align": "sinkhorn", "sba": True},
        seed=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = run_rounds(data, ModelSpec(name="resnet20", in_channels=1, num_classes=4, norm="batch"), cfg)
    last = res.records[-1]
    assert np.isfinite([last["align_cost"], last["transport_entropy"], last["bn_drift"]]).all()
    assert last["align_cost"] > 0 and 0.0 <= last["transport_entropy"] <= 1.0
    # all 21 BatchNorm layers of the ResNet are in the bank: the stem's, two per block, the two shortcuts'
    channels = 16 + 2 * 3 * (16 + 32 + 64) + 32 + 64
    assert last["sba_bank_bytes"] == 3 * (2 * channels * 4 + 2 * 8)


def test_fedpd_refuses_updates_without_masks_and_names_the_fix():
    s = FedPD(parts="three")
    s.bind_model(create_model("lenet", in_channels=1, num_classes=4))
    state = create_model("lenet", in_channels=1, num_classes=4).state_dict()
    s.setup(
        state,
        num_clients=1,
        param_keys=[k for k in state if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))],
    )
    with pytest.raises(ValueError, match="client 0 sent no masks.*importance dpi"):
        s.aggregate(state, [(0, ClientUpdate(state=state, num_examples=1))], num_clients=1)
    with pytest.raises(ValueError, match="unknown align 'exact'"):
        FedPD(align="exact")
    with pytest.raises(ValueError, match="0 < tol < 0.05.*0.5"):
        FedPD(tol=0.5)


def test_a_fedpd_run_is_reproducible():
    data = _data()
    cfg = RoundConfig(
        rounds=2,
        trainer="proser",
        trainer_params={"lr": 0.05, "batch_size": 16, "importance": "dpi"},
        strategy="fedpd",
        seed=3,
    )
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
