"""The diagnostics whose figures the docs quote: they must measure what they say they do."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from fedcore.engine import ArrivalConfig, run_arrivals
from fedcore.privacy import calibrate_sigma
from flows.config import compose as C


def load(name, folder="diagnostics"):
    path = Path(__file__).resolve().parents[2] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gate_cost():
    return load("gate_cost")


def test_gate_cost_modes_differ_in_the_gradient_noise_and_nothing_else(gate_cost):
    cfg = gate_cost.cell_config(C.compose([]), gate_cost.CELL, "dptta")
    private, exact = (
        gate_cost.arrival_config(cfg, method="tent", seed=1, epsilon=1.0, setting="none-b1", mode=m)
        for m in gate_cost.MODES
    )
    assert private.aggregator_params["normalizer"] == "none" and private.aggregator_params["beta"] == 1.0
    assert private.method_params["lr"] == 0.01 and private.passes == 3 and private.seed == 1
    assert private.privacy_config().noise_source == "seeded"
    # private: sigma leaves the gate's mu = 1/z of the budget; exact: sigma takes all of it
    uses = private.uses_per_arrival
    assert private.privacy_config().sigma(uses) == pytest.approx(calibrate_sigma(1.0, 1e-6, uses=uses, reserved_mu=0.1))
    assert exact.privacy_config().sigma(uses) == pytest.approx(calibrate_sigma(1.0, 1e-6, uses=uses))
    assert exact.privacy_config().sigma(uses) < private.privacy_config().sigma(uses)
    assert dataclasses.replace(exact, privacy=private.privacy) == private
    assert private.privacy["noise_multiplier"] is None  # calibrated from epsilon, with the gate's share reserved
    assert {k for k in exact.privacy if exact.privacy[k] != private.privacy[k]} == {"noise_multiplier"}


def test_gate_cost_private_mode_is_the_shipped_cell(gate_cost):
    """Under the shipped reading the private runs are the stress cell's DP runs, config for config."""
    cfg = gate_cost.cell_config(C.compose([]), gate_cost.CELL, "dptta")
    for method in ("tent", "sar", "bpa"):
        shipped = C.arrival_config(cfg, method=method, aggregator="ugsa", seed=2, form="dp-eps1")
        assert (
            gate_cost.arrival_config(cfg, method=method, seed=2, epsilon=1.0, setting="history-b0.2", mode="private")
            == shipped
        )


def test_gate_cost_table_pairs_by_seed_and_pools_per_setting(gate_cost):
    runs = [
        {
            "setting": "none-b1",
            "method": m,
            "seed": s,
            "mode": mode,
            "final_avg_holdout_acc": 0.5 + 0.1 * s - (0.01 * (s + 1) if mode == "private" else 0),
            "avg_online_acc": 0.7 + (0.001 if mode == "private" and s == 0 else 0),
        }
        for m in ("tent", "bpa")
        for s in (2, 0, 1)
        for mode in ("exact", "private")
    ]
    text = gate_cost.table(runs, ["none-b1"], ["tent", "bpa"])
    # hold-out: private is 0.01, 0.02, 0.03 below exact in seeds 0, 1, 2 (listed out of order): paired
    # t = -0.02 / (0.01 / sqrt 3), p = 0.074 on 2 df; six pairs all below: Wilcoxon's exact p = 2 / 2**6
    assert "| none-b1 | tent | 0.580 ± 0.073 | 0.600 ± 0.082 | -0.0200 | 0/3 | 0.0742 |" in text
    assert "- none-b1: -0.0200 ± 0.0082 over 6 pairs, 6 below / 0 above / 0 level, p = 0.0312" in text
    # online: one seed above, two level
    assert "| none-b1 | bpa | 0.700 ± 0.000 | 0.700 ± 0.000 | +0.0003 | 1/3 | 0.423 |" in text
    assert "- none-b1: +0.0003 ± 0.0005 over 6 pairs, 0 below / 2 above / 4 level, p = 0.5" in text


@pytest.mark.parametrize("bad", ["history", "median-b1", "none-bx"])
def test_gate_cost_refuses_a_setting_it_cannot_read(gate_cost, bad):
    with pytest.raises((SystemExit, ValueError)):
        gate_cost.parse_setting(bad)


def test_gate_cost_exact_mode_releases_the_gate_statistic_unnoised(gate_cost, tiny_gn):
    """With σ ≈ 0, exact mode merges as the noiseless private form (dp0) does; private mode noises σ_k."""
    inputs = (tiny_gn["partition"], tiny_gn["spec"], tiny_gn["source"])
    dp = {"mode": "dp", "noise_multiplier": 1e-9, "delta": 1e-6, "gate_noise_multiplier": 1.0, "noise_source": "seeded"}
    acfg = ArrivalConfig(
        method="tent",
        method_params={"lr": 0.05},
        aggregator="ugsa",
        aggregator_params={"normalizer": "none", "beta": 1.0},
        passes=1,
        batch_size=32,
        privacy=dp,
    )
    dp0 = [r["sigma"] for r in run_arrivals(*inputs, dataclasses.replace(acfg, privacy={"mode": "dp0"})).records]
    exact = [r["sigma"] for r in gate_cost.run_one(inputs, acfg, "exact").records]
    private = [r["sigma"] for r in gate_cost.run_one(inputs, acfg, "private").records]
    assert exact == pytest.approx(dp0, abs=1e-5)
    assert min(abs(p - d) for p, d in zip(private, dp0)) > 1e-4
    with pytest.raises(ValueError, match="unknown mode"):
        gate_cost.run_one(inputs, acfg, "noiseless")


def test_lr_times_c_runs_match_their_recorded_partners_product_and_differ_in_nothing_else():
    lr_times_c = load("lr_times_c")
    cfgs = {lr: lr_times_c.cell_config(C.compose([]), cell, "dptta") for lr, cell in lr_times_c.CELLS.items()}
    for lr, form, partner_lr, partner_form in lr_times_c.PAIRS + lr_times_c.NORMALISED_PAIRS:
        mine, theirs = (
            C.arrival_config(cfgs[r], method="come", aggregator="sequential", seed=2, form=f)
            for r, f in ((lr, form), (partner_lr, partner_form))
        )
        assert mine.method_params["lr"] == lr and theirs.method_params["lr"] == partner_lr != lr
        assert mine.privacy["mode"] == theirs.privacy["mode"] == "clip"
        assert lr * mine.privacy["clip_norm"] == pytest.approx(partner_lr * theirs.privacy["clip_norm"], rel=1e-5)
        assert mine.privacy["clip_norm"] != theirs.privacy["clip_norm"]
        assert dataclasses.replace(mine, method_params=theirs.method_params, privacy=theirs.privacy) == theirs


def test_lr_times_c_normalised_puts_every_live_sample_at_norm_c_and_leaves_dropped_ones_at_zero():
    import torch

    from fedcore.privacy import dp

    lr_times_c = load("lr_times_c")
    per_sample = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]]), "b": torch.zeros(3, 1)}
    as_is, _ = dp.privatize(per_sample, clip_norm=1.0, noise_multiplier=0.0, batch_size=1.0)
    scaled, _ = lr_times_c.normalised(dp.privatize)(per_sample, clip_norm=1.0, noise_multiplier=0.0, batch_size=1.0)
    assert torch.allclose(as_is["w"], torch.tensor([0.9, 1.2]))  # the small sample is not clipped as is
    assert torch.allclose(scaled["w"], torch.tensor([1.2, 1.6]))  # both live samples at norm 1, the dropped one 0
    assert torch.equal(scaled["b"], torch.zeros(1))
    # and the patch the diagnostic applies reaches the clip-only form's gradient
    from unittest import mock

    clipped = dp.ClippedGradient(clip_norm=1.0)
    assert torch.allclose(clipped._clip_sum(per_sample, 1.0)["w"], torch.tensor([0.9, 1.2]))
    with mock.patch.object(dp, "privatize", lr_times_c.normalised(dp.privatize)):
        assert torch.allclose(clipped._clip_sum(per_sample, 1.0)["w"], torch.tensor([1.2, 1.6]))


def test_paired_summary_tells_a_gap_from_noise():
    median_summary = load("paired", "benchmarks").median_summary  # opacus owns the name `benchmarks`

    above = median_summary([1.30, 1.25, 1.28, 1.35, 1.22, 1.31, 1.27, 1.29], 1.15)
    straddling = median_summary([1.05, 1.25, 1.10, 1.20, 1.12, 1.18, 1.16, 1.14], 1.15)
    assert above.startswith("median 1.285") and "above 1.15 in 8 of 8" in above
    assert float(above.rsplit("p = ", 1)[1]) < 0.01
    assert float(straddling.rsplit("p = ", 1)[1]) > 0.2
    met = median_summary([0.94, 1.09, 1.13, 1.05, 1.00, 1.20, 0.94, 1.09], 1.3)
    assert "above 1.3 in 0 of 8, below it at" in met and float(met.rsplit("p = ", 1)[1]) < 0.01
    assert "above it at" in above
    lo, hi = (float(x) for x in straddling.split("interval ")[1].split(")")[0].split("-"))
    assert lo <= 1.15 <= hi
    assert "p =" not in median_summary([1.2, 1.3, 1.25], 1.15)  # too few pairs to test
