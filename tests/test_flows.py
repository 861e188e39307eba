"""End to end through Prefect + Ray + MLflow on the tiny digits federation (slow)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from flows import config as C
from flows import federation as F

from .conftest import tiny_overrides

pytestmark = pytest.mark.slow


def cfg_for(tiny, *extra):
    return C.compose(tiny_overrides(tiny["tmp"]) + ["flow.retries=2", "flow.retry_delay_seconds=0"] + list(extra))


def runs_of(cfg, name):
    client = MlflowClient(C.tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.flow.experiment)
    return client, [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == name]


def test_arrival_flow_logs_lineage_metrics_artifacts_and_model(tiny):
    cfg = cfg_for(tiny, "flow.experiment=arrival-test")
    res = F.arrival(cfg)
    A = len(res.records)
    client, parents = runs_of(cfg, "bpa+ugsa-s0")
    run = parents[0]
    assert run.data.params["method.name"] == "bpa" and run.data.params["aggregator.gamma"] == "0.5"
    for tag in ("git_commit", "seed", "data_sha256", "partition_manifest_sha256", "config_fingerprint"):
        assert run.data.tags.get(tag), tag
    hist = client.get_metric_history(run.info.run_id, "online_acc")
    assert sorted(m.step for m in hist) == list(range(A))
    assert run.data.metrics["final_avg_online_acc"] == pytest.approx(res.summary["avg_online_acc"])
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert len(children) == A
    arts = {a.path for d in ("plots", "checkpoints") for a in client.list_artifacts(run.info.run_id, d)}
    for name in ("online_accuracy.png", "accuracy_matrix.png", "weight_drift.png", "gate_weights.png"):
        assert f"plots/{name}" in arts
    assert "checkpoints/server_state.pt" in arts
    versions = client.search_model_versions(f"name='{cfg.flow.register_model}'")
    assert any(v.run_id == run.info.run_id for v in versions)


def test_failed_client_task_is_retried_and_metrics_unchanged(tiny):
    clean = F.arrival(cfg_for(tiny, "flow.experiment=retry-clean", "aggregator=fedavg"))
    cfg = cfg_for(tiny, "flow.experiment=retry-fault", "aggregator=fedavg", "flow.inject_fault=2",
                  "paths.checkpoints=" + str(tiny["tmp"] / "ckpt-fault"))
    faulty = F.arrival(cfg)
    assert list(Path(cfg.paths.checkpoints).rglob("fault-2.marker")), "the injected fault never fired"
    assert faulty.summary == clean.summary


def test_pretrain_flow_writes_model_and_rounds(tiny, tmp_path):
    cfg = cfg_for(tiny, "flow.experiment=pretrain-test", "pretrain.rounds=2", f"paths.models={tmp_path}")
    path = F.pretrain(cfg)
    assert path.is_file()
    client, runs = runs_of(cfg, "pretrain-digits-cnn")
    run = runs[0]
    assert "source_test_acc" in run.data.metrics
    assert len(client.get_metric_history(run.info.run_id, "train_loss")) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive_nodes(ray: str, env) -> int:
    out = subprocess.run([ray, "status"], env=env, capture_output=True, text=True, timeout=60).stdout
    active = out.split("Active:")[-1].split("Pending:")[0]
    return sum(1 for line in active.splitlines() if line.strip().startswith("1 node_"))


def test_flow_on_a_multi_process_ray_cluster(tiny, tmp_path, monkeypatch):
    # `ray start` enables token auth; the worker node and the driver must present the token too.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    port = _free_port()
    env = {**os.environ}
    ray = str(Path(sys.executable).parent / "ray")
    head = ["--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
            "--disable-usage-stats"]
    subprocess.run([ray, "start", *head], check=True, env=env, capture_output=True, timeout=120)
    try:
        subprocess.run([ray, "start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                        "--disable-usage-stats"], check=True, env=env, capture_output=True, timeout=120)
        for _ in range(30):
            if _alive_nodes(ray, env) == 2:
                break
            time.sleep(1)
        assert _alive_nodes(ray, env) == 2, "head + worker should both be up"
        cfg = cfg_for(tiny, "flow.experiment=cluster-test", f"flow.ray_address=127.0.0.1:{port}", "adapt.passes=1",
                      f"paths.checkpoints={tmp_path}")
        res = F.arrival(cfg)
        assert len(res.records) == len(tiny["partition"].targets)
        import ray as ray_mod

        assert not ray_mod.is_initialized()
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
