"""The round engine through Prefect + Ray + MLflow on a tiny FedPAD grid (slow), and its stage errors."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch
from mlflow.tracking import MlflowClient

from fedcore.engine.checkpoint import CheckpointError
from flows.config import compose as C
from tests.helpers import prefect_artifacts, prefect_flow_run, prefect_logs, prefect_task_runs, write_checkpoint


def rounds_overrides(tmp, *extra):
    return [
        f"paths.domains={tmp}/domains",
        f"paths.results={tmp}/results",
        f"paths.checkpoints={tmp}/ckpt",
        f"flow.tracking_uri=sqlite:///{tmp}/mlruns.db",
        "flow.progress=false",
        "flow.retries=2",
        "flow.retry_delay_seconds=0",
        "fedpad.grid=quick",
        "fedpad.grids.quick.max_per_domain=120",
        "fedpad.grids.quick.rounds=2",
        "fedpad.grids.quick.methods=[fedavg,fedpad]",
        "trainer=proto",
        "strategy=fedpad",
        *extra,
    ]


def strip(records):
    return [
        {k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items() if k != "agg_seconds"}
        for r in records
    ]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    from flows.runs.steps import partition_domains as _partition_domains

    tmp = tmp_path_factory.mktemp("rounds")
    cfg = C.compose(rounds_overrides(tmp))
    _partition_domains(cfg)
    return {"tmp": tmp, "cfg": cfg}


def plain_run(quick):
    """The quick grid's single run on the plain driver, once per module (the flows must equal it)."""
    if "plain" not in quick:
        from fedcore.engine import run_rounds
        from flows.reports.evaluations import round_data
        from flows.runs.tasks import load_domain_partition

        cfg = quick["cfg"]
        part = load_domain_partition(cfg, "fedpad")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # each client task runs on one Ray CPU; bit-identity needs the same thread count
        try:
            quick["plain"] = run_rounds(
                round_data(part),
                C.grid_model_spec(cfg, "fedpad", num_classes=part.num_classes),
                C.single_round_config(cfg, "fedpad"),
            )
        finally:
            torch.set_num_threads(threads)
    return quick["plain"]


def test_missing_partition_names_the_stage_that_builds_it(tmp_path, capsys):
    from flows.stages import main

    assert main(["fedpad", f"paths.domains={tmp_path}/none", "fedpad.grid=digits"]) == 2
    err = capsys.readouterr().err
    assert "dvc repro partition_domains@digits" in err


def test_a_stage_checks_the_settings_of_the_system_it_runs_and_no_other(tmp_path, capsys):
    from flows.stages import main

    # Execute: the same impossible FedPD++ setting, given to a FedPD++ stage and to a FedPAD stage
    bad = ["fedpd.grids.quick.participation=0", f"paths.domains={tmp_path}/none"]
    fedpd, fedpd_err = main(["fedpd", *bad]), capsys.readouterr().err
    fedpad, fedpad_err = main(["fedpad", *bad]), capsys.readouterr().err

    # Assert: refused where it would run; the FedPAD stage goes on to its own inputs (missing here)
    assert fedpd == 2 and "participation must be in (0, 1], got 0.0" in fedpd_err
    assert fedpad == 2 and "participation" not in fedpad_err and "dvc repro partition_domains@quick" in fedpad_err


def test_unknown_grid_and_method_are_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="unknown fedpad grid 'digit'; valid names are:.*digits"):
        C.grid(C.compose([]), "fedpad", "digit")
    with pytest.raises(ValueError, match="unknown fedpad method 'fedpadd'; valid names are:.*fedpad"):
        C.compose(["fedpad.grids.quick.methods=[fedpadd]"])
    with pytest.raises(ValueError, match="no setting 'gama'"):
        C.compose(["+fedpad.methods.fedpad.strategy_params.gama=1"])


@pytest.mark.parametrize("flow", ["single", "grid"])
def test_a_corrupt_round_checkpoint_fails_before_ray_or_prefect_start(quick, tmp_path, monkeypatch, flow):
    # Prepare: the run's (a grid's first cell's) checkpoint corrupted; Ray or Prefect starting fails the test
    from flows.runs import rounds
    from flows.runs.tasks import round_cell_dir
    from flows.services import runtime

    cfg = C.compose(rounds_overrides(quick["tmp"], f"paths.checkpoints={tmp_path}"))
    folder = (
        tmp_path / "fedpad" / "quick" / "single-proto+fedpad-s0"
        if flow == "single"
        else round_cell_dir(cfg, "fedpad", "quick", "fedavg", 0)
    )
    write_checkpoint(folder, corrupt=True)
    monkeypatch.setattr(runtime, "start_ray", lambda **kw: pytest.fail("Ray started"))
    monkeypatch.setattr(runtime, "_prefect_api", lambda: pytest.fail("Prefect started"))

    # Execute / Assert: refused by the pre-flight check, naming the folder to delete
    with pytest.raises(CheckpointError, match=re.escape(f"Found before starting Ray and Prefect. Delete {folder} ")):
        getattr(rounds, flow)(cfg, "fedpad")


@pytest.mark.slow
def test_round_flow_equals_the_plain_driver_and_logs_every_round(quick):
    """The same run_rounds loop, driven by a Prefect task per client per round on Ray: identical metrics."""
    from flows.runs.rounds import single

    cfg = quick["cfg"]
    plain = plain_run(quick)
    flowed = single(cfg, "fedpad")
    assert strip(flowed.records) == strip(plain.records)
    for k in plain.final_state:
        assert torch.equal(flowed.final_state[k], plain.final_state[k]), k
    client = MlflowClient(C.tracking_uri(cfg))
    exp = client.get_experiment_by_name("fedcore-fedpad")
    run = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == "proto+fedpad-s0"][0]
    assert run.data.tags["partition_manifest_sha256"] and run.data.tags["strategy"] == "fedpad"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "worst_acc")] == [0, 1]
    assert len(client.get_metric_history(run.info.run_id, "alpha.c0")) == 2
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["round-000", "round-001"]
    flow_run = prefect_flow_run(run)  # the same run in the Prefect UI
    p = flow_run.parameters  # what ran: the flow's own parameters, the resolved config among them
    assert (flow_run.name, p["system"], p["grid"]) == ("fedpad-quick-proto+fedpad-s0", "fedpad", "quick")
    assert (p["config"]["trainer"]["name"], p["config"]["strategy"]["name"], p["config"]["seed"]) == (
        "proto",
        "fedpad",
        0,
    )
    n = len(plain.records[0]["clients"])
    assert sorted(prefect_task_runs(flow_run.id)) == [f"round-000-{n}-clients", f"round-001-{n}-clients"]
    assert run.info.run_id in prefect_artifacts(flow_run.id)[0].data


@pytest.mark.slow
def test_failed_and_killed_client_tasks_are_rerun_with_unchanged_results(quick):
    """Round 1's client-0 task raises once (Prefect retries it); round 0's worker is killed by PID (Ray reruns it)."""
    from flows.runs.rounds import single

    cfg = C.compose(
        rounds_overrides(
            quick["tmp"], "flow.inject_fault=1", "flow.inject_crash=0", f"paths.checkpoints={quick['tmp']}/ckpt2"
        )
    )
    res = single(cfg, "fedpad")
    assert list((quick["tmp"] / "ckpt2").rglob("fault-round1.marker")), "the injected fault never fired"
    assert list((quick["tmp"] / "ckpt2").rglob("crash-round0.marker")), "the worker was never killed"
    assert strip(res.records) == strip(plain_run(quick).records)
    # Prefect saw round 0's task complete once: the warning on it says Ray reran client 0's step
    client = MlflowClient(C.tracking_uri(cfg))
    exp = client.get_experiment_by_name("fedcore-fedpad")
    [run] = client.search_runs(
        [exp.experiment_id],
        "attributes.run_name = 'proto+fedpad-s0'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    warned = [
        (task[: len("round-000")], msg.split(" (")[0], msg.split(": ", 1)[1])
        for task, level, msg in prefect_logs(prefect_flow_run(run).id)
        if level == logging.WARNING and "re-run by Ray" in msg
    ]
    assert warned == [("round-000", "round 0 client 0", "client step re-run by Ray after its worker died: attempt 2")]


@pytest.mark.slow
def test_a_round_flow_stopped_after_a_round_resumes_from_its_checkpoint_with_unchanged_results(quick):
    """flow.stop_after=1 ends the run once round 0 is checkpointed; resume=true runs round 1 alone, the
    records are the uninterrupted run's, and the resume continues the same MLflow run from round 0."""
    from fedcore.engine import RunInterrupted
    from flows.runs.rounds import single

    extra = (f"paths.checkpoints={quick['tmp']}/ckpt3",)
    expected = plain_run(quick)
    client = MlflowClient(C.tracking_uri(quick["cfg"]))

    def runs():
        exp = client.get_experiment_by_name("fedcore-fedpad")
        return client.search_runs([exp.experiment_id], "attributes.run_name = 'proto+fedpad-s0'") if exp else []

    before = {r.info.run_id for r in runs()}
    with pytest.raises(RunInterrupted):
        single(C.compose(rounds_overrides(quick["tmp"], "flow.stop_after=1", *extra)), "fedpad")
    cfg = C.compose(rounds_overrides(quick["tmp"], "flow.resume=true", *extra))
    res = single(cfg, "fedpad")
    assert strip(res.records) == strip(expected.records)
    new = [r for r in runs() if r.info.run_id not in before]
    assert len(new) == 1 and new[0].data.tags["resumed"] == "true"  # one record: the interrupted run, continued
    [run] = new
    assert run.info.status == "FINISHED"
    n = len(expected.records[0]["clients"])
    assert list(prefect_task_runs(prefect_flow_run(run).id)) == [f"round-001-{n}-clients"]  # the resume's flow run
    history = client.get_metric_history(run.info.run_id, "worst_acc")
    assert [m.step for m in history] == [0, 1]
    assert [m.value for m in history] == [r["worst_acc"] for r in expected.records]


@pytest.mark.slow
def test_grid_flow_writes_the_table_statistics_plots_and_one_run_per_cell(quick):
    from flows.runs.rounds import grid, results_dir

    cfg = quick["cfg"]
    rows = grid(cfg, "fedpad")
    assert [(r["method"], r["seed"]) for r in rows] == [("fedavg", 0), ("fedpad", 0)]
    out = results_dir(cfg, "fedpad", "quick")
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"fedavg", "fedpad"}
    assert 0 <= summary["fedpad"]["worst_acc"] <= summary["fedpad"]["avg_acc"] <= 1
    for f in ("table.md", "stats.md", "methods.png", "cells/fedpad-s0/rounds.png", "cells/fedavg-s0/rounds.json"):
        assert (out / f).is_file(), f
    assert "| fedpad |" in (out / "table.md").read_text()
    client = MlflowClient(C.tracking_uri(cfg))
    exp = client.get_experiment_by_name("fedcore-fedpad")
    cells = [
        r
        for r in client.search_runs(
            [exp.experiment_id], "tags.stage = 'fedpad@quick'", order_by=["attributes.start_time DESC"]
        )
        if r.info.run_name in ("fedavg-s0", "fedpad-s0")
    ][:2]
    assert sorted(r.info.run_name for r in cells) == ["fedavg-s0", "fedpad-s0"]
    # timings: in MLflow and timings.md, never in the stage's outputs (a rebuild must write the same bytes)
    assert "agg_seconds" not in json.loads((out / "cells/fedavg-s0/rounds.json").read_text())[0]
    assert "run s" not in (out / "table.md").read_text() and "run_seconds" not in summary["fedpad"]
    assert "| fedpad |" in (out / "timings.md").read_text()
    assert all(r.data.metrics["run_seconds"] > 0 and "agg_seconds" in r.data.metrics for r in cells)
    # each domain's share of the model per round, and the table's weights column and share table
    for r in cells:
        shares = [r.data.metrics[f"share.{d}"] for d in ("mnist", "fonts", "sklearn")]
        assert sum(shares) == pytest.approx(1.0), (r.info.run_name, shares)
    assert "| fedpad | α(θ) |" in (out / "table.md").read_text() and (out / "weights.png").is_file()
    flow_run = prefect_flow_run(cells[0])  # the grid in the Prefect UI: one task run and one MLflow link per cell
    grid = flow_run.parameters["config"]["fedpad"]["grids"]["quick"]
    assert grid["methods"] == ["fedavg", "fedpad"] and grid["seeds"] == [0]
    assert set(prefect_task_runs(flow_run.id)) == {"quick-fedavg-s0", "quick-fedpad-s0"}
    links = " ".join(a.data for a in prefect_artifacts(flow_run.id))
    assert all(r.info.run_id in links for r in cells)
    # the grid's target method (fedpad, seed 0) is this grid's one registered model version, as fedpad-quick
    versions = [
        v for v in client.search_model_versions("name='fedpad-quick'") if v.run_id in {r.info.run_id for r in cells}
    ]
    assert [(v.tags["method"], v.tags["seed"]) for v in versions] == [("fedpad", "0")]
    assert versions[0].tags["champion_metric"] == "final_worst_acc"
    assert client.get_model_version_by_alias("fedpad-quick", "champion")  # the first version always takes it
    from flows.services.tracking import load_registered

    assert load_registered("fedpad-quick", "champion", tracking_uri=C.tracking_uri(cfg)) is not None


@pytest.mark.slow
def test_a_resumed_grid_logs_no_cell_twice(quick):
    """Every cell of the grid has finished: a rerun resumes each from its checkpoint and logs nothing again,
    and its report is the same."""
    from flows.runs.rounds import grid, results_dir

    cfg = C.compose(rounds_overrides(quick["tmp"], "flow.resume=true"))
    client = MlflowClient(C.tracking_uri(cfg))
    grid(cfg, "fedpad")
    exp = client.get_experiment_by_name("fedcore-fedpad")

    def cells():
        return sorted(r.info.run_id for r in client.search_runs([exp.experiment_id], "tags.stage = 'fedpad@quick'"))

    before, table = cells(), (results_dir(cfg, "fedpad", "quick") / "table.md").read_text()
    rows = grid(cfg, "fedpad")
    assert cells() == before and len(before) >= 2
    assert [(r["method"], r["seed"]) for r in rows] == [("fedavg", 0), ("fedpad", 0)]
    assert (results_dir(cfg, "fedpad", "quick") / "table.md").read_text() == table
    # a cell whose logging a stop cut short (its run FAILED) is logged again on resume, linked to that run
    cut = client.search_runs([exp.experiment_id], "tags.stage = 'fedpad@quick' and attributes.run_name = 'fedpad-s0'")[
        0
    ]
    client.set_terminated(cut.info.run_id, "FAILED")
    grid(cfg, "fedpad")
    [again] = [
        r for r in client.search_runs([exp.experiment_id], "tags.stage = 'fedpad@quick'") if r.info.run_id not in before
    ]
    assert again.info.run_name == "fedpad-s0" and again.data.tags["resumed_from"] == cut.info.run_id
    assert client.get_run(cut.info.run_id).data.tags["superseded_by"] == again.info.run_id
