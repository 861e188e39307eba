"""PP-FCIL through the platform: config checks, the class-incremental grid flow (slow) and what it logs."""

from __future__ import annotations

import json
import re
from pathlib import Path

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
        "ppfcil.grid=quick",
        "ppfcil.grids.quick.max_per_domain=1000",
        "ppfcil.grids.quick.tasks=2",
        "ppfcil.grids.quick.rounds_per_task=2",
        "ppfcil.grids.quick.clients=3",
        "ppfcil.grids.quick.participation=0.67",
        "ppfcil.grids.quick.methods=[finetune,ppfcil,lbdp-eps8]",
        "+ppfcil.grids.quick.norm=group",
        *extra,
    ]


def test_the_ppfcil_experiment_composes_and_every_grid_method_builds():
    cfg = C.compose([])
    C.validate(cfg)
    rc = C.round_config(cfg, "ppfcil", method="ppfcil", seed=0, grid_name="mnist")
    assert (rc.trainer, rc.strategy, rc.rounds) == ("fcil", "ppfcil", 20)  # 5 tasks x 4 rounds
    assert C.is_incremental("ppfcil") and not C.is_incremental("fedpd")
    assert (
        C.round_config(cfg, "ppfcil", method="dp-eps8", seed=0, grid_name="privacy").trainer_params["privacy"] == "dp"
    )


def test_a_grids_trainer_settings_reach_its_cells_and_a_single_run_on_it_under_a_methods_own():
    cfg = C.compose(["trainer=fcil", "strategy=ppfcil", "ppfcil.grid=privacy"])
    cell = C.round_config(cfg, "ppfcil", method="dp-eps1", seed=0, grid_name="privacy").trainer_params
    assert (cell["compress_schedule"], cell["report_on"], cell["lr"]) == ("replace", "train", 0.05)
    single = C.single_round_config(cfg, "ppfcil").trainer_params
    assert (single["compress_schedule"], single["report_on"]) == ("replace", "train")
    mnist = C.round_config(cfg, "ppfcil", method="ppfcil", seed=0, grid_name="mnist").trainer_params
    assert (mnist.get("compress_schedule", "after"), mnist.get("report_on", "holdout")) == ("after", "holdout")
    own = C.compose(
        ["trainer=fcil", "strategy=ppfcil", "ppfcil.grid=privacy", "ppfcil.grids.privacy.trainer.report_on=holdout"]
    )
    assert C.single_round_config(own, "ppfcil").trainer_params["report_on"] == "holdout"  # set on the grid itself


@pytest.mark.parametrize(
    "extra, match",
    [
        (["ppfcil.grids.quick.methods=[lbdp-eps8]"], "is private .* uses BatchNorm"),
        (["+ppfcil.trainer.compress_rounds=4"], r"compress_rounds \(4\) must be at most rounds_per_task \(3\)"),
        (["ppfcil.grids.quick.model=lenet"], "needs a dual model"),
        (["ppfcil.grids.quick.tasks=11"], "1 <= tasks <= 10"),
        (["ppfcil.grids.quick.methods=[ppfcl]"], re.escape("unknown ppfcil method 'ppfcl';")),
        (
            [
                "+ppfcil.methods.ppfcil.trainer_params.epsilon=-1",
                "+ppfcil.methods.ppfcil.trainer_params.privacy=dp",
                "+ppfcil.methods.ppfcil.trainer_params.rho=0",
                "+ppfcil.grids.quick.norm=group",
            ],
            "epsilon must be",
        ),
        # NbAFL: 15 rounds at F = 0.6 are 9 uploads, so ε = 9 is 1 per upload; at F = 0.2 (3 uploads) T > L·sqrt(N)
        (
            [
                "ppfcil.grids.quick.methods=[nbafl-eps8]",
                "+ppfcil.grids.quick.norm=group",
                "ppfcil.methods.nbafl-eps8.trainer_params.epsilon=9",
            ],
            r"ε < 1 per upload.* Lower epsilon below 9",
        ),
        (
            [
                "ppfcil.grids.quick.methods=[nbafl-eps1]",
                "+ppfcil.grids.quick.norm=group",
                "ppfcil.grids.quick.participation=0.2",
            ],
            r"T > L·sqrt\(N\).* Raise participation",
        ),
    ],
)
def test_bad_ppfcil_settings_are_refused_with_the_fix(extra, match):
    with pytest.raises(ValueError, match=match):
        C.compose(extra)


@pytest.mark.slow
def test_incremental_grid_writes_tables_and_logs_tasks_ledgers_and_selection(tmp_path):
    from flows.runs.rounds import grid, results_dir
    from flows.runs.steps import partition_domains as _partition_domains

    cfg = C.compose(overrides(tmp_path))
    _partition_domains(cfg, "ppfcil")
    rows = grid(cfg, "ppfcil")
    assert [(r["method"], r["seed"]) for r in rows] == [("finetune", 0), ("ppfcil", 0), ("lbdp-eps8", 0)]
    out = results_dir(cfg, "ppfcil", "quick")
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"finetune", "ppfcil", "lbdp-eps8"}
    for row in summary.values():
        assert 0 <= row["final_acc"] <= 1 and 0 <= row["avg_inc_acc"] <= 1
    assert 0 < summary["lbdp-eps8"]["max_epsilon"] <= 8.0 and "max_epsilon" not in summary["ppfcil"]
    table = (out / "table.md").read_text()
    assert "avg incremental acc" in table and "max client ε" in table
    for f in ("table.md", "stats.md", "methods.png", "scores.json", "cells/ppfcil-s0/rounds.png"):
        assert (out / f).is_file(), f
    records = json.loads((out / "cells/lbdp-eps8-s0/rounds.json").read_text())
    assert [r["task"] for r in records] == [0, 0, 1, 1]
    last = records[-1]
    assert {"acc.seen", "acc.task0", "acc.task1"} <= set(last)
    assert any("weight_entropy" in r for r in records)  # a round whose picked clients are all spent merges nothing
    assert any(k.startswith("epsilon.c") for k in last) and any(k.startswith("sel_score.c") for k in last)
    client = MlflowClient(C.tracking_uri(cfg))
    exp = client.get_experiment_by_name("fedcore-ppfcil")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id], "tags.stage = 'ppfcil@quick'")}
    assert {"finetune-s0", "ppfcil-s0", "lbdp-eps8-s0"} <= set(runs)
    run = runs["ppfcil-s0"]
    assert run.data.metrics["avg_inc_acc"] == pytest.approx(summary["ppfcil"]["avg_inc_acc"])
    assert len(client.get_metric_history(run.info.run_id, "acc.seen")) == 4  # one point per round
    per_task = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "task_acc.seen")}
    ends = json.loads((out / "cells/ppfcil-s0/rounds.json").read_text())
    assert per_task == pytest.approx({0: ends[1]["acc.seen"], 1: ends[3]["acc.seen"]})  # one per task, at its end
    assert {m.step for m in client.get_metric_history(run.info.run_id, "task_acc.task0")} == {0, 1}
    assert {m.step for m in client.get_metric_history(run.info.run_id, "task_acc.task1")} == {1}
    ledger = [k for k in runs["lbdp-eps8-s0"].data.metrics if k.startswith("epsilon.c")]
    assert ledger  # every client's privacy spending is in MLflow, per round
    # ... as private test-time adaptation writes its ledger: a line per client and round, and the document
    private = runs["lbdp-eps8-s0"].info.run_id
    for key in ledger:
        k = key[len("epsilon.") :]
        spent = {m.step: m.value for m in client.get_metric_history(private, f"eps_round.{k}")}
        total = {m.step: m.value for m in client.get_metric_history(private, f"eps_client_total.{k}")}
        reported = {r["round"]: r[key] for r in records if key in r}
        assert total == pytest.approx(reported) and sum(spent.values()) == pytest.approx(max(total.values()))
        left = client.get_metric_history(private, f"eps_budget_remaining.{k}")
        assert [m.value for m in left] == pytest.approx([8.0 - total[m.step] for m in left])
    assert all(not k.startswith("eps_round") for k in run.data.metrics)  # no ledger without a privacy promise
    arts = {a.path for a in client.list_artifacts(private, "ledgers")}
    assert arts == {"ledgers/privacy_ledger.json", "ledgers/privacy_ledger.png"}
    doc = json.loads(Path(client.download_artifacts(private, "ledgers/privacy_ledger.json", str(tmp_path))).read_text())
    assert doc["privacy"] == "lbdp" and doc["budget"] == 8.0 and doc["delta"] == pytest.approx(1e-5)
    assert {f"c{k}" for k in doc["clients"]} == {key[len("epsilon.") :] for key in ledger}
    assert all(v["accountant"]["accountant"] == "bayesian" for v in doc["clients"].values())
    versions = client.search_model_versions("name='ppfcil-quick'")
    assert [(v.tags["method"], v.tags["champion_metric"]) for v in versions] == [("ppfcil", "avg_inc_acc")]
    from flows.services.tracking import load_registered

    assert load_registered("ppfcil-quick", "champion", tracking_uri=C.tracking_uri(cfg)) is not None


def test_privacy_report_pairs_lbdp_with_classic_dp_at_each_epsilon_and_clip_norm(tmp_path):
    from flows.reports.tables import ppfcil_privacy as _ppfcil_privacy

    # a clip-only row (no noise, no ε) in the grid is left out of the curve and the pairs
    cfg = C.compose(
        [
            f"paths.results={tmp_path}",
            "ppfcil.grids.privacy.methods=[ppfcil-nodp,lbdp-eps1,lbdp-eps8,"
            "dp-eps1,dp-eps8,lbdp-eps8-c10,dp-eps8-c10,clip-c1]",
            "ppfcil.privacy_report_with=[]",
        ]
    )
    out = tmp_path / "ppfcil" / "privacy"
    out.mkdir(parents=True)
    methods = [str(m) for m in cfg.ppfcil.grids.privacy.methods]
    fake = {m: [0.5, 0.6] for m in methods}
    fake["clip-c1"] = [0.9, 0.9]
    fake["lbdp-eps8"], fake["dp-eps8"] = [0.7, 0.72], [0.6, 0.61]
    (out / "scores.json").write_text(json.dumps({"avg_inc_acc_by_seed": fake}))
    _ppfcil_privacy(cfg)
    text = (out / "privacy.md").read_text()
    assert "| 8 | 1 | 0.710 ± 0.010 | 0.605 ± 0.005 | +0.105 | 2/2 |" in text
    assert "| 8 | 10 | 0.550 ± 0.050 | 0.550 ± 0.050 | +0.000 | 0/2 |" in text
    assert "No noise (same objective): 0.550 ± 0.050." in text and "0.900" not in text
    assert text.split("Every private method:")[0].count("\n| ") == 4  # head + 3 (ε, C) pairs
    assert (out / "privacy.png").is_file()


def test_privacy_report_names_the_stage_that_builds_its_input(tmp_path):
    from flows.reports.tables import ppfcil_privacy as _ppfcil_privacy

    with pytest.raises(FileNotFoundError, match=re.escape("dvc repro ppfcil@privacy`")):
        _ppfcil_privacy(C.compose([f"paths.results={tmp_path}"]))
    (tmp_path / "ppfcil" / "privacy").mkdir(parents=True)
    (tmp_path / "ppfcil" / "privacy" / "scores.json").write_text(
        json.dumps({"avg_inc_acc_by_seed": {"ppfcil-nodp": [0.5, 0.5]}})
    )
    with pytest.raises(FileNotFoundError, match=re.escape("dvc repro ppfcil@privacy-eps`")):  # the next grid joined
        _ppfcil_privacy(C.compose([f"paths.results={tmp_path}", "ppfcil.grids.privacy.methods=[ppfcil-nodp]"]))


def test_privacy_report_joins_grids_on_the_same_data_and_refuses_others(tmp_path):
    from flows.reports.tables import ppfcil_privacy as _ppfcil_privacy

    joined = "ppfcil.privacy_report_with=[privacy-eps,privacy-nbafl,privacy-lbdp]"
    cfg = C.compose(
        [f"paths.results={tmp_path}", "ppfcil.grids.privacy.methods=[ppfcil-nodp,lbdp-eps8,dp-eps8]", joined]
    )
    fake = {
        "privacy": {"ppfcil-nodp": [0.5, 0.5], "lbdp-eps8": [0.4, 0.42], "dp-eps8": [0.3, 0.3]},
        "privacy-eps": {
            "lbdp-eps2": [0.35, 0.39],
            "dp-eps2": [0.33, 0.33],
            "lbdp-eps4": [0.4, 0.4],
            "dp-eps4": [0.4, 0.4],
        },
        "privacy-nbafl": {
            "nbafl-eps1": [0.2, 0.2],
            "nbafl-eps8": [0.45, 0.47],
            "nbafl-eps8-c10": [0.3, 0.3],
            "nbafl-eps8-worst": [0.1, 0.1],
        },
        "privacy-lbdp": {
            "lbdp-eps8-mean": [0.38, 0.38],
            "lbdp-eps8-c10-mean": [0.3, 0.3],
            "lbdp-eps8-chernoff": [0.36, 0.36],
            "lbdp-eps8-probe": [0.41, 0.41],
        },
    }
    for g, scores in fake.items():
        (tmp_path / "ppfcil" / g).mkdir(parents=True)
        (tmp_path / "ppfcil" / g / "scores.json").write_text(json.dumps({"avg_inc_acc_by_seed": scores}))
    # what the DP-SGD cells logged of their per-sample gradient norms: two rounds, two clients
    for seed, fraction in ((0, 0.2), (1, 0.4)):
        cell = tmp_path / "ppfcil" / "privacy" / "cells" / f"lbdp-eps8-s{seed}"
        cell.mkdir(parents=True)
        rounds = [
            {"round": r, "clipped_fraction.c0": fraction, "clipped_fraction.c1": fraction, "grad_norm_median.c0": 2.0}
            for r in range(2)
        ]
        (cell / "rounds.json").write_text(json.dumps(rounds))
    _ppfcil_privacy(cfg)
    text = (tmp_path / "ppfcil" / "privacy" / "privacy.md").read_text()
    assert "| 8 | 1 | 0.410 ± 0.010 | 0.300 ± 0.000 | +0.110 | 2/2 |" in text  # the pair table: LBDP and DP only
    assert "| 2 | 1 | 0.370 ± 0.020 | 0.330 ± 0.000 | +0.040 | 2/2 |" in text  # ... from every grid joined
    assert "| NbAFL, C = 1 | 8 | nbafl-eps8 (privacy-nbafl) | 0.460 ± 0.010 | 2 |  |  |" in text
    assert "| NbAFL (worst-case ΔS), C = 1 | 8 | nbafl-eps8-worst (privacy-nbafl) | 0.100 ± 0.000 | 2 |" in text
    assert "| LBDP (mean), C = 10 | 8 | lbdp-eps8-c10-mean (privacy-lbdp) | 0.300 ± 0.000 | 2 |" in text
    assert "| LBDP (chernoff ε), C = 1 | 8 | lbdp-eps8-chernoff (privacy-lbdp) | 0.360 ± 0.000 | 2 |" in text
    assert "| LBDP (σ from a probe), C = 1 | 8 | lbdp-eps8-probe (privacy-lbdp) | 0.410 ± 0.000 | 2 |" in text
    # the share clipped, averaged over rounds, clients and seeds, and the median norm before clipping
    assert "| LBDP, C = 1 | 8 | lbdp-eps8 (privacy) | 0.410 ± 0.010 | 2 | 0.30 | 2.00 |" in text
    with pytest.raises(ValueError, match=r"grid 'privacy-lbdp' is not on grid 'privacy'.*\(clients differ\)"):
        _ppfcil_privacy(C.compose([f"paths.results={tmp_path}", joined, "ppfcil.grids.privacy-lbdp.clients=4"]))


def test_the_flow_submit_ships_each_clients_data_of_the_current_task_once(monkeypatch):
    """The one-run flow (rounds_ppfcil) must train on the task's slice, as the plain driver does."""
    import numpy as np

    from fedcore.engine.rounds import RoundData
    from flows.runs import rounds as R

    put, submitted = [], []

    class FakeTask:
        def with_options(self, **kw):
            return self

        def __call__(self, *, calls, **kw):
            submitted.extend(calls)

    monkeypatch.setattr(R, "train_round_task", FakeTask())
    monkeypatch.setattr(R.runtime, "put", lambda obj: put.append(obj) or ("ref", len(put) - 1))
    x = np.arange(8).reshape(8, 1, 1, 1)
    y = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    data = RoundData(
        client_x=[x],
        client_y=[y],
        client_group=["all"],
        eval_sets={},
        client_task=[np.array([0, 0, 0, 0, 1, 1, 1, 1])],
        task_classes=[[0, 1], [2, 3]],
        rounds_per_task=2,
    )
    submit_round = R.round_submit(data)
    for r in range(4):
        xs, ys = data.client_data(0, r)
        submit_round(
            None,
            [dict(client_id=0, round_index=r, x=xs, y=ys, global_state={"w": r}, broadcast={"task": data.task_of(r)})],
            lambda j, u: None,
        )
    arrays = [p for p in put if isinstance(p, np.ndarray)]
    assert [a.tolist() for a in arrays if a.ndim == 1] == [[0, 0, 1, 1], [2, 2, 3, 3]]  # labels: once per task
    assert submitted[0]["y"] == submitted[1]["y"] != submitted[2]["y"] == submitted[3]["y"]
