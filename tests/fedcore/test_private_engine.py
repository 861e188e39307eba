"""The private forms inside the federation loop: ledgers, budgets, refusals, resume."""

import math

import pytest
import torch

from fedcore.engine import ArrivalConfig, RunInterrupted, run_arrivals
from fedcore.privacy import GDPAccountant, calibrate_sigma, gdp_epsilon, mu_from_sigma


def timeless(records):
    return [{k: v for k, v in r.items() if k != "adapt_seconds"} for r in records]


def cfg(privacy, **kw):
    base = dict(
        method="tent", method_params={"lr": 0.05}, aggregator="ugsa", passes=2, batch_size=32, seed=0, privacy=privacy
    )
    base.update(kw)
    return ArrivalConfig(**base)


DP = {"mode": "dp", "epsilon": 5.0, "delta": 1e-6, "clip_norm": 1.0, "noise_source": "seeded"}  # tests compare numbers


def test_ledger_composes_over_passes_and_is_logged_per_arrival(tiny_gn):
    res = run_arrivals(tiny_gn["partition"], tiny_gn["spec"], tiny_gn["source"], cfg(DP))
    K = len(tiny_gn["partition"].targets)
    g = 1 / 10.0  # the gate release's mu at the default gate_noise_multiplier
    sigma = calibrate_sigma(5.0, 1e-6, reserved_mu=g)
    per_arrival = mu_from_sigma(sigma) ** 2 + g**2  # the update and the gate statistic, composed
    for r in res.records:
        assert r["privacy_sigma"] == pytest.approx(sigma)
        assert r["eps_arrival"] == pytest.approx(gdp_epsilon(math.sqrt(per_arrival), 1e-6))
        assert r["eps_arrival"] <= 5.0 * (1 + 1e-9)
        visits = 1 + r["pass"]  # the stream is reused once per pass
        assert r["eps_client_total"] == pytest.approx(gdp_epsilon(math.sqrt(visits * per_arrival), 1e-6))
    assert sorted(res.ledgers) == list(range(K))
    for state in res.ledgers.values():
        acc = GDPAccountant()
        acc.load_state_dict(state)
        assert len(acc) == 2 and all(h[2] == 10.0 for h in acc.history)
    assert res.summary["eps_max_client"] == pytest.approx(gdp_epsilon(math.sqrt(2 * per_arrival), 1e-6))


def test_adapt_client_reports_the_gate_statistic_noised_in_dp_mode(tiny_gn):
    """σ_k, the adapted model's mean entropy on the stream, leaves the client noised in dp mode only."""
    from fedcore.engine import adapt_client
    from fedcore.privacy import gate_noise_std

    client = tiny_gn["partition"].targets[0]
    kw = dict(global_state=tiny_gn["source"], spec=tiny_gn["spec"], client=client, seed=0)
    exact = adapt_client(cfg=cfg({"mode": "dp0", "clip_norm": 1.0}), **kw).sigma  # the private form, no noise
    # sigma = 1e-9 leaves the model where dp0 leaves it, so what differs is the gate's noise
    almost = cfg({**DP, "epsilon": None, "noise_multiplier": 1e-9, "gate_noise_multiplier": 1.0})
    released, again = (adapt_client(cfg=almost, **kw).sigma for _ in range(2))
    std = gate_noise_std(num_classes=10, n=len(client.stream_x), noise_multiplier=1.0)
    assert released == again  # seeded: the same draw
    assert 0 < abs(released - exact) < 6 * std


def test_budget_refuses_the_second_pass_and_the_run_continues(tiny_gn):
    budget = 6.0  # one arrival at eps 5 fits, two (about 7.4) do not
    res = run_arrivals(tiny_gn["partition"], tiny_gn["spec"], tiny_gn["source"], cfg({**DP, "budget": budget}))
    K = len(tiny_gn["partition"].targets)
    first, second = res.records[:K], res.records[K:]
    assert all(r["privacy_refused"] == 0 for r in first)
    assert all(r["privacy_refused"] == 1 and r["weight"] == 0.0 and r["drift_step"] == 0.0 for r in second)
    assert all("sigma" in r for r in first) and not any("sigma" in r for r in second), (
        "a refused client releases no gate statistic (it would be charged to nobody)"
    )
    assert all(r["eps_client_total"] <= budget for r in res.records)
    assert all(r["eps_budget_remaining"] == pytest.approx(budget - r["eps_client_total"]) for r in res.records)
    assert res.summary["privacy_refusals"] == K
    # the refused clients still predicted (online accuracy is scored), with the unchanged global model
    assert all(0 < r["online_acc"] <= 1 for r in second)


def test_resumed_ledger_equals_uninterrupted(tiny_gn, tmp_path):
    c = cfg({**DP, "budget": 6.0})
    full = run_arrivals(tiny_gn["partition"], tiny_gn["spec"], tiny_gn["source"], c)
    with pytest.raises(RunInterrupted):
        run_arrivals(tiny_gn["partition"], tiny_gn["spec"], tiny_gn["source"], c, checkpoint_dir=tmp_path, stop_after=3)
    resumed = run_arrivals(
        tiny_gn["partition"], tiny_gn["spec"], tiny_gn["source"], c, checkpoint_dir=tmp_path, resume=True
    )
    assert resumed.ledgers == full.ledgers
    assert timeless(resumed.records) == timeless(full.records)
    for k in full.final_state:
        assert torch.equal(full.final_state[k], resumed.final_state[k])


def test_clip_only_has_no_ledger_and_noise_changes_the_result(tiny_gn):
    clip = run_arrivals(
        tiny_gn["partition"], tiny_gn["spec"], tiny_gn["source"], cfg({"mode": "clip", "clip_norm": 1.0}, passes=1)
    )
    assert clip.ledgers == {} and "eps_client_total" not in clip.records[0]
    dp = run_arrivals(tiny_gn["partition"], tiny_gn["spec"], tiny_gn["source"], cfg(DP, passes=1))
    assert dp.records[-1]["drift_total"] != clip.records[-1]["drift_total"]


def test_clip_only_runs_on_batchnorm_in_the_loop_and_dp0_does_not(tiny):
    """The paper's clip-only form is each method's plain form with clipped per-sample gradients, so it
    runs on the BatchNorm model the private form refuses; its form names tell the two apart."""
    clip = cfg(
        {"mode": "clip", "clip_norm": 1.0}, method="eata", method_params={"lr": 0.05, "fisher_size": 64}, passes=1
    )
    assert clip.form == "clip" and cfg({"mode": "dp0", "clip_norm": 1.0}).form == "dp0"
    res = run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], clip)
    assert res.ledgers == {} and all("clip_fraction" in r for r in res.records)
    assert res.records[-1]["drift_total"] > 0
    with pytest.raises(ValueError, match="model.norm=group"):
        run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg({"mode": "dp0", "clip_norm": 1.0}, passes=1))


@pytest.mark.parametrize("source", ["secure", "seeded"])
def test_the_same_config_twice_gives_the_same_updates_only_when_seeded(tiny_gn, source):
    c = cfg({**DP, "noise_source": source}, passes=1)
    a, b = (run_arrivals(tiny_gn["partition"], tiny_gn["spec"], tiny_gn["source"], c) for _ in range(2))
    same = all(torch.equal(a.final_state[k], b.final_state[k]) for k in a.final_state)
    assert same == (source == "seeded")


def test_private_form_needs_a_gradient_method_and_groupnorm(tiny):
    with pytest.raises(ValueError, match="method 'bn' takes none"):
        cfg(DP, method="bn", method_params={})
    with pytest.raises(ValueError, match="model.norm=group"):
        run_arrivals(tiny["partition"], tiny["spec"], tiny["source"], cfg(DP, passes=1))


def test_steps_per_batch_are_charged_as_reuse(tiny_gn):
    res = run_arrivals(
        tiny_gn["partition"],
        tiny_gn["spec"],
        tiny_gn["source"],
        cfg(DP, passes=1, method_params={"lr": 0.05, "steps": 3}),
    )
    # sigma is calibrated for three uses (and the gate's release), so one arrival still costs the target epsilon
    assert res.records[0]["privacy_sigma"] == pytest.approx(calibrate_sigma(5.0, 1e-6, uses=3, reserved_mu=0.1))
    assert res.records[0]["eps_arrival"] <= 5.0 * (1 + 1e-9)
    assert res.records[0]["eps_arrival"] == pytest.approx(
        gdp_epsilon(math.sqrt(mu_from_sigma(res.records[0]["privacy_sigma"], 3) ** 2 + 0.1**2), 1e-6)
    )


@pytest.mark.parametrize("method", ["eata", "sar", "deyo", "come", "bpa"])
def test_each_method_runs_privately_in_the_loop(tiny_gn, method):
    params = {"lr": 0.05}
    if method == "eata":
        params.update(fisher_size=64)
    res = run_arrivals(
        tiny_gn["partition"], tiny_gn["spec"], tiny_gn["source"], cfg(DP, method=method, method_params=params, passes=1)
    )
    assert all(0 <= r["online_acc"] <= 1 for r in res.records)
    assert math.isfinite(res.summary["final_avg_holdout_acc"]) and res.records[-1]["drift_total"] > 0
