"""FedPD++ through the platform: config checks, the open-set grid flow (slow) and what it logs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from flows.config import compose as C


def overrides(tmp, *extra):
    return [
        f"paths.domains={tmp}/domains",
        f"paths.results={tmp}/results",
        f"paths.checkpoints={tmp}/ckpt",
        f"flow.tracking_uri=sqlite:///{tmp}/mlruns.db",
        "flow.progress=false",
        "flow.retries=1",
        "flow.retry_delay_seconds=0",
        "fedpd.grid=quick",
        "fedpd.grids.quick.max_per_domain=300",
        "fedpd.grids.quick.rounds=2",
        "fedpd.grids.quick.trainer.closed_rounds=1",
        "fedpd.grids.quick.methods=[fedavg,fedpd++]",
        *extra,
    ]


def test_the_fedpd_experiment_composes_and_every_grid_method_builds():
    cfg = C.compose([])
    C.validate(cfg)
    rc = C.round_config(cfg, "fedpd", method="fedpd++", seed=0, grid_name="digits")
    assert (rc.trainer, rc.strategy) == ("proser", "fedpd")
    assert rc.trainer_params["importance"] == "dpi" and rc.strategy_params["parts"] == "three"
    assert C.method_scores(cfg, "fedpd", "fedavg", "sgd") == ["msp", "openmax"]
    assert C.is_openset("fedpd") and not C.is_openset("fedpad")


def test_a_block_or_grid_setting_reaches_the_methods_that_take_it_and_a_misspelt_one_none():
    cfg = C.compose([])

    def cell(grid, method):
        return C.round_config(cfg, "fedpd", method=method, seed=0, grid_name=grid)

    # the block's two-phase PROSER schedule reaches every PROSER method and passes plain SGD by
    assert cell("digits", "fedpd++").trainer_params["closed_rounds"] == 10
    assert cell("digits", "fedavg-proser").trainer_params["open_lr_scale"] == 0.01
    assert "closed_rounds" not in cell("digits", "fedavg").trainer_params
    assert cell("quick", "fedpd").trainer_params["closed_rounds"] == 2  # the grid's, over the block's
    # a grid's strategy settings reach the fedpd strategy's methods, under each method's own
    pinned = cell("digits-10c", "fedpd++").strategy_params
    assert (pinned["align"], pinned["part_transport"], pinned["parts"]) == ("sinkhorn", "own", "three")
    assert cell("digits-10c", "fedavg-proser").strategy_params == {}
    assert cell("digits-10c", "fedpd++").trainer_params["closed_rounds"] == 0
    assert "align" not in cell("digits", "fedpd++").strategy_params  # the strategy's default
    with pytest.raises(
        ValueError, match=r"grid 'digits-10c': strategy setting 'algin' is taken by none of fedpd's strategies"
    ):
        C.compose(["+fedpd.grids.digits-10c.strategy.algin=none"])
    with pytest.raises(ValueError, match=r"trainer setting 'closed_round' is taken by none .* closed_rounds"):
        C.compose(["+fedpd.grids.digits.trainer={closed_round: 3}"])
    with pytest.raises(ValueError, match=r"fedpd.trainer setting 'open_lr' is taken by none of fedpd's trainers"):
        C.compose(["+fedpd.trainer.open_lr=0.1"])
    C.compose(["fedpd.grids.quick.methods=[fedavg]"])  # the experiment's PROSER schedule is simply not used
    # a single run takes the experiment's and the grid's trainer settings, as the grid's cells do
    single = C.single_round_config(C.compose(["fedpd.grid=quick", "trainer=proser", "strategy=fedpd"]), "fedpd")
    assert (single.trainer_params["closed_rounds"], single.trainer_params["open_lr_scale"]) == (2, 0.01)


def test_bad_fedpd_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=re.escape("unknown fedpd method 'fedpd+';")):
        C.compose(["fedpd.grids.quick.methods=[fedpd+]"])
    with pytest.raises(ValueError, match="do not fit the model"):
        C.compose(["fedpd.methods.fedavg.scores=[proser]"])
    with pytest.raises(ValueError, match="unknown align 'ot'"):
        C.compose(["+fedpd.methods.fedpd.strategy_params.align=ot"])
    with pytest.raises(ValueError, match="grid 'digits': target='nope' is not one of the grid's methods: fedavg,"):
        C.compose(["+fedpd.grids.digits.target=nope"])
    with pytest.raises(ValueError, match=r"closed_rounds \(20\) must be below the grid's rounds \(20\)"):
        C.compose(["fedpd.trainer.closed_rounds=20"])


def test_a_random_known_split_is_drawn_by_the_seed_and_refused_where_classes_are_named():
    from flows.reports.evaluations import known_classes

    g = C.grid(C.compose(["+fedpd.grids.quick.known_split=random"]), "fedpd", "quick")
    splits = {s: known_classes(g, 10, s) for s in range(4)}
    assert all(len(k) == 6 and k == sorted(set(k)) and set(k) <= set(range(10)) for k in splits.values())
    assert known_classes(g, 10, 1) == splits[1] and len({tuple(k) for k in splits.values()}) == 4
    assert known_classes(C.grid(C.compose([]), "fedpd", "quick"), 10, 1) == 6  # first-k: the first 6, any seed
    with pytest.raises(ValueError, match="unknown known_split 'rand'; valid values are: first, random"):
        C.compose(["+fedpd.grids.quick.known_split=rand"])
    with pytest.raises(ValueError, match="known_split: random draws `known` classes by the seed"):
        C.compose(["+fedpd.grids.quick.known_split=random", "fedpd.grids.quick.unknown=[6,7]"])


def test_the_folded_auroc_mirrors_a_score_ranked_backwards_and_the_report_names_each_split(tmp_path):
    from fedcore.engine.spec import ModelSpec
    from fedcore.openset.evaluate import openset_evaluate
    from flows.reports.tables import write_openset_report

    spec = ModelSpec(name="lenet", in_channels=1, num_classes=3)
    rng = np.random.default_rng(0)
    known = {"a": (rng.integers(0, 255, (40, 28, 28, 1), dtype=np.uint8), rng.integers(0, 3, 40))}
    unknown = {"a": rng.integers(0, 255, (30, 28, 28, 1), dtype=np.uint8)}
    out = openset_evaluate(spec.build().state_dict(), spec, known, unknown, scores=["msp"], folded=True)
    a = out["auroc.msp.a"]
    assert out["auroc_max.msp.a"] == max(a, 1 - a) == out["auroc_max"] and a != 0.5
    assert "auroc_max" not in openset_evaluate(spec.build().state_dict(), spec, known, unknown, scores=["msp"])
    summary = {
        "final_avg_acc": 0.8,
        "final_worst_acc": 0.7,
        "final_auroc.msp": 0.4,
        "final_auroc_max.msp": 0.6,
        "final_oscr.msp": 0.3,
        "final_auroc.msp.a": 0.4,
        "agg_seconds_mean": 0.01,
        "bytes_per_round": 1e6,
    }
    rows = [{"method": "m", "seed": s, "summary": summary, "seconds": 1.0} for s in (0, 1)]
    write_openset_report(
        rows, domains=["a"], out=tmp_path, title="t", scores={"m": ["msp"]}, target=None, known={0: [1, 2], 1: [0, 3]}
    )
    text = (tmp_path / "table.md").read_text()
    assert "| method | closed acc | AUROC | max(AUROC, 1 − AUROC) | OSCR |" in text
    assert "| m | 0.800 ± 0.000 | 0.400 ± 0.000 | 0.600 ± 0.000 | 0.300 ± 0.000 |" in text
    assert "seed 0: 1, 2; seed 1: 0, 3" in text
    assert json.loads((tmp_path / "summary.json").read_text())["m"]["auroc_max"] == 0.6


SCENARIOS = (
    "+fedpd.grids.quick.unknown_sets={shared: {mnist: [6, 7, 8, 9], fonts: [6, 7, 8, 9], "
    "sklearn: [6, 7, 8, 9]}, one: {mnist: [6], fonts: [7], sklearn: [8]}}"
)


def test_a_bad_unknown_scenario_is_refused_before_any_service_starts(tmp_path, monkeypatch):
    from flows.runs.rounds import grid
    from flows.runs.steps import partition_domains as _partition_domains
    from flows.services import runtime

    bad = SCENARIOS.replace("sklearn: [8]", "sklearn: [5]")
    cfg = C.compose(overrides(tmp_path, bad))
    _partition_domains(cfg, "fedpd")
    monkeypatch.setattr(runtime, "shutdown_ray", lambda: pytest.fail("a service was started"))
    with pytest.raises(
        ValueError,
        match=r"unknown scenario 'one', domain 'sklearn': class\(es\) \[5\] are not "
        "unknown classes",
    ):
        grid(cfg, "fedpd")


@pytest.mark.slow
def test_open_set_grid_writes_auroc_tables_and_logs_alignment_per_round(tmp_path):
    from flows.runs.rounds import grid, results_dir
    from flows.runs.steps import partition_domains as _partition_domains

    cfg = C.compose(overrides(tmp_path, SCENARIOS))
    _partition_domains(cfg, "fedpd")
    rows = grid(cfg, "fedpd")
    assert [(r["method"], r["seed"]) for r in rows] == [("fedavg", 0), ("fedpd++", 0)]
    out = results_dir(cfg, "fedpd", "quick")
    summary = json.loads((out / "summary.json").read_text())
    # one cell of a plain classifier gives two rows (MSP and OpenMax), a PROSER model one
    assert set(summary) == {"fedavg+msp", "fedavg+openmax", "fedpd++"}
    for row in summary.values():
        assert 0 <= row["closed_acc"] <= 1 and 0 <= row["auroc"] <= 1 and 0 <= row["oscr"] <= row["closed_acc"]
    assert summary["fedavg+msp"]["closed_acc"] == summary["fedavg+openmax"]["closed_acc"]
    # heterogeneous unknowns: the scenario with every unknown class is the headline AUROC, another differs
    for row in summary.values():
        assert row["auroc_shared"] == pytest.approx(row["auroc"]) and row["auroc_one"] != row["auroc"]
    assert "| method | shared (100 %) | one (0 %) | shared − one |" in (out / "table.md").read_text()
    for f in ("table.md", "stats.md", "methods.png", "scores.json", "cells/fedpd++-s0/rounds.png"):
        assert (out / f).is_file(), f
    blocks = json.loads((out / "scores.json").read_text())["auroc_by_seed_domain"]
    assert len(blocks["fedpd++"]) == 3  # 1 seed x 3 domains
    assert np.isclose(np.mean(blocks["fedpd++"]), summary["fedpd++"]["auroc"])
    records = json.loads((out / "cells/fedpd++-s0/rounds.json").read_text())
    assert len(records) == 2
    assert {
        "mask.close",
        "mask.open",
        "mask.share",
        "align_cost",
        "transport_entropy",
        "bn_drift",
        "auroc.proser.mnist",
    } <= set(records[-1])
    client = MlflowClient(C.tracking_uri(cfg))
    exp = client.get_experiment_by_name("fedcore-fedpd")
    runs = client.search_runs([exp.experiment_id], "tags.stage = 'fedpd@quick'")
    by_name = {r.info.run_name: r for r in runs}
    assert {"fedavg-s0", "fedpd++-s0"} <= set(by_name)
    run = by_name["fedpd++-s0"]
    assert run.data.metrics["final_auroc"] == pytest.approx(summary["fedpd++"]["auroc"])
    history = client.get_metric_history(run.info.run_id, "transport_entropy")
    assert len(history) == 2  # one point per round
    # how often alignment found nothing to move: in MLflow per round, not in the stage's outputs
    assert len(client.get_metric_history(run.info.run_id, "align_identity")) == 2
    assert "align_identity" not in records[-1]
    assert "align_identity" not in (out / "cells/fedpd++-s0/rounds.csv").read_text()
    versions = client.search_model_versions("name='fedpd-quick'")
    assert [(v.tags["method"], v.tags["champion_metric"]) for v in versions] == [("fedpd++", "final_auroc")]
    assert versions[0].run_id == run.info.run_id


@pytest.mark.slow
def test_a_grid_on_random_known_splits_trains_each_seed_on_its_own_classes_and_reports_both_aurocs(tmp_path):
    from flows.reports.evaluations import known_classes
    from flows.runs.rounds import grid, results_dir
    from flows.runs.steps import partition_domains as _partition_domains

    extra = (
        "+fedpd.grids.quick.known_split=random",
        "fedpd.grids.quick.rounds=1",
        "fedpd.grids.quick.trainer.closed_rounds=0",
        "fedpd.grids.quick.seeds=[0,1]",
    )
    cfg = C.compose(overrides(tmp_path, *extra, "fedpd.grids.quick.methods=[fedavg-proser]"))
    _partition_domains(cfg, "fedpd")
    grid(cfg, "fedpd")
    out = results_dir(cfg, "fedpd", "quick")
    g = C.grid(cfg, "fedpd", "quick")
    split = {s: known_classes(g, 10, s) for s in (0, 1)}
    assert split[0] != split[1]
    assert (
        f"seed 0: {', '.join(map(str, split[0]))}; seed 1: {', '.join(map(str, split[1]))}"
        in (out / "table.md").read_text()
    )
    for s in (0, 1):
        rec = json.loads((out / f"cells/fedavg-proser-s{s}/rounds.json").read_text())[-1]
        for d in ("mnist", "fonts", "sklearn"):
            assert rec[f"auroc_max.proser.{d}"] == max(rec[f"auroc.proser.{d}"], 1 - rec[f"auroc.proser.{d}"])
    run = MlflowClient(C.tracking_uri(cfg)).search_runs(
        [MlflowClient(C.tracking_uri(cfg)).get_experiment_by_name("fedcore-fedpd").experiment_id]
    )[0]
    assert run.data.metrics["final_auroc_max"] >= max(0.5, run.data.metrics["final_auroc"])


def test_method_names_mlflow_refuses_in_keys_are_logged_under_safe_keys(tmp_path):
    """``fedpd++`` is a config key; MLflow refuses '+' in param keys, so a run that logs the config must not fail."""
    from mlflow.entities import Param

    from flows.services import tracking

    params = tracking.flatten({"fedpd": {"methods": {"fedpd++": {"trainer": "proser"}}}, "seeds": [0, 1]})
    assert params == {"fedpd.methods.fedpd__.trainer": "proser", "seeds": "[0, 1]"}
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns.db")  # no global MLflow state touched
    run = client.create_run(client.create_experiment("keys"))
    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in params.items()])  # refuses invalid keys
    assert client.get_run(run.info.run_id).data.params == params


def test_relabelled_scenarios_are_exact_weighted_means_of_per_class_aurocs():
    from flows.reports.tables import relabelled_aurocs

    counts = {"a": {6: 10, 7: 30}, "b": {6: 20, 7: 20}}
    per_class = {("a", 6): 0.9, ("a", 7): 0.5, ("b", 6): 0.8, ("b", 7): 0.6}
    got = relabelled_aurocs(per_class, counts, {"a": [6, 7], "b": [7]})
    a_both = (10 * 0.9 + 30 * 0.5) / 40  # every unknown row of a, weighted by its class's rows
    assert got[0] == pytest.approx((a_both + 0.6) / 2)  # the identity first: the scenario as configured
    assert got[1] == pytest.approx((a_both + 0.8) / 2)  # 6 <-> 7: b meets class 6 instead
    flat = {k: 0.7 for k in per_class}  # classes alike: no relabelling can move the score
    assert np.allclose(relabelled_aurocs(flat, counts, {"a": [6], "b": [7]}), 0.7)


def test_the_report_adds_scenarios_relabellings_and_per_class_aurocs(tmp_path):
    from flows.reports.tables import write_openset_report

    def summary(base):
        s = {
            "final_avg_acc": 0.8,
            "final_worst_acc": 0.7,
            "final_auroc.msp": base,
            "final_oscr.msp": 0.6,
            "agg_seconds_mean": 0.01,
            "bytes_per_round": 1e6,
        }
        for d in ("a", "b"):
            s[f"final_auroc.msp.{d}"] = base
            s.update({f"final_auroc_class6.msp.{d}": base + 0.1, f"final_auroc_class7.msp.{d}": base - 0.1})
        s.update({"final_auroc_all.msp": base, "final_auroc_one.msp": base + 0.05})
        return s

    rows = [{"method": "m", "seed": s, "summary": summary(0.7 + 0.01 * s), "seconds": 1.0} for s in (0, 1)]
    sets = {"all": {"a": [6, 7], "b": [6, 7]}, "one": {"a": [6], "b": [7]}}
    counts = {"a": {6: 5, 7: 5}, "b": {6: 5, 7: 5}}
    write_openset_report(
        rows,
        domains=["a", "b"],
        out=tmp_path,
        title="t",
        scores={"m": ["msp"]},
        target=None,
        unknown_sets=sets,
        unknown_counts=counts,
    )
    text = (tmp_path / "table.md").read_text()
    assert "| m | 0.705 ± 0.005 | 0.755 ± 0.005 | -0.050 |" in text  # as configured: all, then one, then the gap
    assert "| m | 0.705 [0.705, 0.705] | 0.705 [0.705, 0.705] |" in text  # one domain meets 6, the other 7
    assert "| m | 0.805 | 0.605 |" in text  # per class
    assert json.loads((tmp_path / "summary.json").read_text())["m"]["auroc_one"] == pytest.approx(0.755)
    del rows[1]["summary"]["final_auroc_class7.msp.a"], rows[1]["summary"]["final_auroc_class7.msp.b"]
    with pytest.raises(ValueError, match=r"m seed 1 has no AUROC for unknown scenario\(s\) \['class7'\].*resume=false"):
        write_openset_report(
            rows,
            domains=["a", "b"],
            out=tmp_path,
            title="t",
            scores={"m": ["msp"]},
            target=None,
            unknown_sets=sets,
            unknown_counts=counts,
        )
