"""The worked example of docs/extending.md, end to end: a plug-in's strategy and round-based system run
through the round flow (Prefect, Ray, MLflow) from the command line, with no edit to the platform's files."""

from __future__ import annotations

import json

import mlflow
import pytest

from flows.stages import main


@pytest.mark.slow
def test_a_plugin_strategy_and_system_run_through_the_round_flow_and_are_recorded(plugin_sandbox, tmp_path):
    # Prepare: a user's overrides, the plug-in named on the command line
    overrides = [
        f"plugins=[{plugin_sandbox}]",
        f"paths.domains={tmp_path}/domains",
        f"paths.results={tmp_path}/results",
        f"paths.checkpoints={tmp_path}/checkpoints",
        f"flow.tracking_uri=sqlite:///{tmp_path}/mlruns.db",
        "flow.progress=false",
        "toy.grids.tiny.rounds=2",
    ]

    # Execute: its partition, then its grid
    assert main(["partition_toy", *overrides]) == 0
    assert main(["toy", *overrides]) == 0

    # Assert: the system's own report ...
    out = tmp_path / "results" / "toy" / "tiny"
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary) == ["fedavg", "fedmedian"] and all(0 <= v["avg_acc"] <= 1 for v in summary.values())
    assert "| fedmedian |" in (out / "table.md").read_text()
    assert {p.name for p in (out / "cells" / "fedmedian-s0").iterdir()} == {"rounds.json", "rounds.csv", "rounds.png"}
    # ... and MLflow's record: one run per cell in the system's experiment, the strategy named, and the
    # target method registered under the system's name with its declared headline metric
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlruns.db")
    exp = client.get_experiment_by_name("fedcore-toy")
    runs = client.search_runs([exp.experiment_id])
    by_method = {r.data.tags["method"]: r for r in runs}
    assert sorted(by_method) == ["fedavg", "fedmedian"]
    median = by_method["fedmedian"]
    assert median.data.params["strategy.name"] == "fedmedian" and median.data.tags["system"] == "toy"
    assert len(client.get_metric_history(median.info.run_id, "avg_acc")) == 2  # one point per round
    version = client.get_model_version_by_alias("toy-tiny", "champion")
    assert version.run_id == median.info.run_id
    assert version.tags["champion_metric"] == "final_avg_acc"  # the system's declared headline
    assert float(version.tags["metric.final_avg_acc"]) == pytest.approx(median.data.metrics["final_avg_acc"])
