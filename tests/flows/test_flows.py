"""End to end through Prefect + Ray + MLflow on the tiny digits federation (slow)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from flows.config import compose as C
from flows.runs import federation as F
from flows.services import tracking
from tests.helpers import (
    for_variant,
    prefect_artifacts,
    prefect_flow_run,
    prefect_logs,
    prefect_task_runs,
    tiny_overrides,
)

pytestmark = pytest.mark.slow


def cfg_for(tiny, *extra):
    return C.compose(
        for_variant(tiny_overrides(tiny["tmp"]) + ["flow.retries=2", "flow.retry_delay_seconds=0"] + list(extra))
    )


def runs_of(cfg, name):
    client = MlflowClient(C.tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.flow.experiment)
    return client, [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == name]


def count_streams(monkeypatch) -> list:
    """The Ray generators the arrival flow starts (one per worker that runs arrivals), counted."""
    from flows.services import runtime

    started, real = [], runtime.ray_stream

    def counted(fn, /, **kw):
        started.append(kw["start"].done)
        return real(fn, **kw)

    monkeypatch.setattr(runtime, "ray_stream", counted)
    return started


def test_arrival_flow_logs_lineage_metrics_artifacts_and_model(tiny, monkeypatch):
    cfg = cfg_for(tiny, "flow.experiment=arrival-test")
    streams = count_streams(monkeypatch)
    events, real_start, real_run = [], F.ArrivalPasses.start, F._start_experiment_run
    monkeypatch.setattr(F.ArrivalPasses, "start", lambda self: events.append("stream") or real_start(self))
    monkeypatch.setattr(F, "_start_experiment_run", lambda *a, **kw: events.append("mlflow") or real_run(*a, **kw))
    reads, real_hashes = [], tracking.dvc_lock_hashes
    monkeypatch.setattr(
        tracking, "dvc_lock_hashes", lambda paths, **kw: reads.extend(paths) or real_hashes(paths, **kw)
    )
    res = F.arrival(cfg)
    # the lineage names the data, the partition and the source model the run read
    assert {F.prepared_path(cfg), F.partition_dir(cfg), F.source_model_path(cfg)} <= set(reads)
    assert streams == [0]  # one worker runs both passes: it does not stop at a pass's end
    assert events[:2] == ["stream", "mlflow"]  # the worker computes while the flow opens its MLflow run
    A = len(res.records)
    client, parents = runs_of(cfg, "bpa+ugsa-s0")
    run = parents[0]
    assert run.data.params["method.name"] == "bpa" and run.data.params["aggregator.gamma"] == "0.5"
    for tag in ("git_commit", "seed", "data_sha256", "partition_manifest_sha256", "config_fingerprint"):
        assert run.data.tags.get(tag), tag
    # this run's settings, not the other systems' grids or the variants' definitions
    assert not [k for k in run.data.params if k.split(".")[0] in (*C.round_systems(), *C.variant_systems())]
    assert run.data.params["data.name"] == "digits"
    hist = client.get_metric_history(run.info.run_id, "online_acc")
    assert sorted(m.step for m in hist) == list(range(A))
    assert run.data.metrics["final_avg_online_acc"] == pytest.approx(res.summary["avg_online_acc"])
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert len(children) == A
    arts = {a.path for d in ("plots", "checkpoints") for a in client.list_artifacts(run.info.run_id, d)}
    for name in ("online_accuracy.png", "accuracy_matrix.png", "weight_drift.png", "gate_weights.png"):
        assert f"plots/{name}" in arts
    assert "checkpoints/server_state.pt" in arts
    assert run.data.metrics["final_avg_holdout_acc"] == pytest.approx(res.summary["final_avg_holdout_acc"])
    assert not any(k.startswith("final_final") for k in run.data.metrics)
    assert run.info.end_time - run.info.start_time > 1000  # the parent spans the experiment
    name = "bpfedctta-digits"  # <system>-<data>: the configured cell (bpa+ugsa) is registered
    versions = [v for v in client.search_model_versions(f"name='{name}'") if v.run_id == run.info.run_id]
    assert len(versions) == 1
    v = versions[0]
    assert (v.tags["method"], v.tags["aggregator"], v.tags["privacy_form"], v.tags["seed"]) == (
        "bpa",
        "ugsa",
        "plain",
        "0",
    )
    assert v.tags["data_sha256"] == run.data.tags["data_sha256"] and v.tags["git_commit"] == run.data.tags["git_commit"]
    assert float(v.tags["metric.final_avg_holdout_acc"]) == pytest.approx(
        res.summary["final_avg_holdout_acc"], abs=1e-5
    )
    assert "bpa+ugsa (plain), seed 0, on digits" in v.description
    from flows.services.tracking import load_registered

    model = load_registered(name, "champion", tracking_uri=C.tracking_uri(cfg))
    for k, v in model.state_dict().items():
        assert torch.equal(v, res.final_state[k]), k

    # The same run in the Prefect UI: its parameters, a task run named per pass, each arrival logged at INFO, the link back
    flow_run = prefect_flow_run(run)
    ui_url = run.data.tags.get("prefect.flow_run_url") or run.data.tags["prefect.ui"]  # a server, or the temporary one
    assert flow_run.name == "bpa+ugsa-s0" and ui_url.endswith(f"/runs/flow-run/{flow_run.id}")
    c = flow_run.parameters["config"]  # what ran: the resolved config the flow was given
    assert (c["method"]["name"], c["aggregator"]["name"], c["privacy"]["mode"], c["seed"]) == ("bpa", "ugsa", "off", 0)
    assert (
        c["data"]["name"] == cfg.data.name and c["adapt"]["passes"] == 2 and c["aggregator"]["params"]["gamma"] == 0.5
    )
    K, A = len(tiny["partition"].targets), len(res.records)
    names = {f"pass-{p}-arrivals-{p * K:03d}-{min(p * K + K, A) - 1:03d}" for p in range(-(-A // K))}
    assert set(prefect_task_runs(flow_run.id)) == names
    logs = prefect_logs(flow_run.id)
    for r in res.records:  # each arrival on its pass's task run, at INFO
        p = r["arrival"] // K
        assert any(
            task == f"pass-{p}-arrivals-{p * K:03d}-{min(p * K + K, A) - 1:03d}"
            and level == logging.INFO
            and msg.startswith(f"arrival {r['arrival']} (")
            for task, level, msg in logs
        ), r["arrival"]
    [link] = prefect_artifacts(flow_run.id)
    assert link.type == "markdown" and run.info.run_id in link.data and "mlflow ui --backend-store-uri" in link.data


def test_the_arrivals_stream_is_stopped_when_the_run_cannot_open(tiny, monkeypatch):
    """The worker starts on the arrivals before the flow opens its MLflow run; if that fails (an unreachable
    tracking server, say), the stream is cancelled, not left computing."""
    from flows.services import runtime

    cfg = cfg_for(tiny, "flow.experiment=no-start")
    streams = count_streams(monkeypatch)
    cancelled, real_cancel = [], runtime.ray_cancel
    monkeypatch.setattr(runtime, "ray_cancel", lambda refs: cancelled.extend(refs) or real_cancel(refs))

    def unreachable(*a, **kw):
        raise RuntimeError("the tracking server is unreachable")

    monkeypatch.setattr(F, "_start_experiment_run", unreachable)
    with pytest.raises(RuntimeError, match="unreachable"):
        F.arrival(cfg)
    assert streams == [0] and len(cancelled) == 1


def test_failed_and_killed_client_tasks_are_rerun_and_metrics_unchanged(tiny, monkeypatch):
    """Arrival 2 raises once (Prefect retries its pass from the last state); the Ray worker is killed by PID as
    arrival 1 starts (the pass goes on from the last state on a new worker)."""
    clean = F.arrival(cfg_for(tiny, "flow.experiment=retry-clean", "aggregator=fedavg"))
    cfg = cfg_for(
        tiny,
        "flow.experiment=retry-fault",
        "aggregator=fedavg",
        "flow.inject_fault=2",
        "flow.inject_crash=1",
        "paths.checkpoints=" + str(tiny["tmp"] / "ckpt-fault"),
    )
    streams = count_streams(monkeypatch)
    faulty = F.arrival(cfg)
    # One stream from the start; one after the killed worker, again from the start (a worker sends an arrival's
    # state once it has begun the next, and it died beginning arrival 1); one for the retry, from arrival 1 (the
    # fault fired beginning arrival 2).
    assert streams == [0, 0, 1], streams
    assert list(Path(cfg.paths.checkpoints).rglob("fault-2.marker")), "the injected fault never fired"
    assert list(Path(cfg.paths.checkpoints).rglob("crash-1.marker")), "the worker was never killed"
    assert faulty.summary == clean.summary
    # The worker died while arrival 0's state was on its way (arrival 1 starts before 0 is sent back):
    # the warning on the pass's task run says where it went on from
    _, runs = runs_of(cfg, "bpa+fedavg-s0")
    warned = [
        (task[: len("pass-0")], msg)
        for task, level, msg in prefect_logs(prefect_flow_run(runs[0]).id)
        if level == logging.WARNING and "died" in msg
    ]
    assert len(warned) == 1 and warned[0][0] == "pass-0", warned
    assert "WorkerCrashedError" in warned[0][1] and warned[0][1].endswith("on a new worker: attempt 2"), warned


def test_pretrain_flow_writes_model_and_rounds(tiny, tmp_path):
    cfg = cfg_for(tiny, "flow.experiment=pretrain-test", "pretrain.rounds=2", f"paths.models={tmp_path}")
    path = F.pretrain(cfg)
    assert path.is_file()
    client, runs = runs_of(cfg, "pretrain-digits-cnn")
    run = runs[0]
    assert "source_test_acc" in run.data.metrics
    assert len(client.get_metric_history(run.info.run_id, "train_loss")) == 2
    flow_run = prefect_flow_run(run)
    config = flow_run.parameters["config"]
    assert config["pretrain"]["rounds"] == 2 and (config["model"]["name"], config["model"]["norm"]) == ("cnn", "batch")
    assert sorted(n[: len("round-000-")] for n in prefect_task_runs(flow_run.id)) == ["round-000-", "round-001-"]


def _save_source(cfg, state, spec):
    from dataclasses import asdict

    import torch

    path = F.source_model_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": state, "spec": asdict(spec)}, path)


def test_private_arrival_flow_logs_each_clients_ledger_and_refusals(tiny_gn, tmp_path):
    cfg = cfg_for(
        tiny_gn,
        "flow.experiment=private-test",
        "model.norm=group",
        "method=tent",
        "privacy=dp",
        "privacy.epsilon=5",
        "privacy.budget=6",
        f"paths.models={tmp_path}",
    )
    _save_source(cfg, tiny_gn["source"], tiny_gn["spec"])
    res = F.arrival(cfg)
    A, K = len(res.records), len(tiny_gn["partition"].targets)
    client, runs = runs_of(cfg, "tent+ugsa dp-eps5-s0")
    run = runs[0]
    assert run.data.tags["privacy_form"] == "dp-eps5"
    # the paper's 1.966 for epsilon 5, raised so that the gate statistic's release (mu = 0.1) fits too
    assert float(run.data.params["privacy.sigma"]) == pytest.approx(1.975, abs=0.002)
    assert run.data.params["privacy.noise_source"] == "secure"  # conf/privacy/dp.yaml's default, logged
    assert float(run.data.params["privacy.gate_noise_multiplier"]) == 10.0
    for name in ("eps_arrival", "eps_client_total", "eps_budget_remaining", "privacy_refused"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, name)) == list(range(A)), name
    refused = [m for m in client.get_metric_history(run.info.run_id, "privacy_refused") if m.value == 1.0]
    assert sorted(m.step for m in refused) == list(range(K, A))  # the second pass would exceed the budget
    total = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eps_client_total")}
    assert max(total.values()) <= 6.0
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert sum(c.data.tags.get("privacy", "").startswith("REFUSED") for c in children) == A - K
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/privacy_ledger.png", "plots/privacy_ledger.json"} <= arts
    assert run.data.metrics["final_privacy_refusals"] == A - K


def test_audit_stage_bounds_stay_below_the_accountant(tiny_gn, tmp_path):
    import json

    from flows.runs.steps import audit as _audit

    cfg = cfg_for(
        tiny_gn,
        "flow.experiment=audit-test",
        "variant=private",
        f"dptta.variants.private.paths.models={tmp_path}/m",
        f"dptta.variants.private.paths.results={tmp_path}/r",
        "dptta.audit.trials=40",
        "dptta.audit.epsilons=[1,20]",
    )
    _save_source(cfg, tiny_gn["source"], tiny_gn["spec"])
    _audit(cfg)
    rows = json.loads((tmp_path / "r" / "audit.json").read_text())
    assert [r["form"] for r in rows] == ["dp0", "dp-eps1", "dp-eps20"]
    for r in rows:
        assert r["epsilon_lower"] <= r["epsilon_accountant"]
    assert rows[0]["epsilon_lower"] > rows[1]["epsilon_lower"]  # without noise the canary shows
    assert (tmp_path / "r" / "audit.md").read_text().count("\n") == 5
    client, runs = runs_of(cfg, "privacy-audit")
    assert runs and "dp-eps1.eps_accountant" in runs[0].data.metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive_nodes(ray: str, env, port: int) -> int:
    out = subprocess.run(
        [ray, "status", f"--address=127.0.0.1:{port}"], env=env, capture_output=True, text=True, timeout=60
    ).stdout
    active = out.split("Active:")[-1].split("Pending:")[0]
    return sum(1 for line in active.splitlines() if line.strip().startswith("1 node_"))


def _stop_our_ray(temp_dir: str) -> None:
    """Stop only the Ray processes of this test's cluster (their command lines name its temp dir).

    ``ray stop --force`` would also kill every other Ray on the machine, e.g. a nightly run.
    """
    import psutil

    ours = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in arg for arg in (p.info["cmdline"] or [])):
                ours.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for p in ours:
        p.terminate()
    _, alive = psutil.wait_procs(ours, timeout=10)
    for p in alive:
        p.kill()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.own_ray  # joins the cluster it starts
def test_flow_on_a_multi_process_ray_cluster(tiny, tmp_path, monkeypatch):
    import tempfile

    # `ray start` enables token auth; the worker node and the driver must present the token too.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    port = _free_port()
    env = {**os.environ}
    ray = str(Path(sys.executable).parent / "ray")
    temp_dir = tempfile.mkdtemp(prefix="fcray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    node = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    head = ["--head", f"--port={port}", "--include-dashboard=false", *node]
    subprocess.run([ray, "start", *head], check=True, env=env, capture_output=True, timeout=120)
    try:
        subprocess.run(
            [ray, "start", f"--address=127.0.0.1:{port}", *node], check=True, env=env, capture_output=True, timeout=120
        )
        for _ in range(30):
            if _alive_nodes(ray, env, port) == 2:
                break
            time.sleep(1)
        assert _alive_nodes(ray, env, port) == 2, "head + worker should both be up"
        cfg = cfg_for(
            tiny,
            "flow.experiment=cluster-test",
            f"flow.ray_address=127.0.0.1:{port}",
            "adapt.passes=1",
            f"paths.checkpoints={tmp_path}",
        )
        res = F.arrival(cfg)
        assert len(res.records) == len(tiny["partition"].targets)
        import ray as ray_mod

        assert not ray_mod.is_initialized()
    finally:
        _stop_our_ray(temp_dir)


def test_a_resumed_arrival_run_continues_its_mlflow_run_from_arrival_zero(tiny):
    """Interrupted after 3 arrivals, then resumed: one MLflow run, whose charts hold every arrival once."""
    from fedcore.engine import RunInterrupted

    overrides = ("flow.experiment=resume-one-run", "paths.checkpoints=" + str(tiny["tmp"] / "ckpt-resume-one"))
    with pytest.raises(RunInterrupted):
        F.arrival(cfg_for(tiny, *overrides, "flow.stop_after=3"))
    client, stopped = runs_of(cfg_for(tiny, *overrides), "bpa+ugsa-s0")
    assert [r.info.status for r in stopped] == ["FAILED"]

    res = F.arrival(cfg_for(tiny, *overrides, "flow.resume=true"))

    _, runs = runs_of(cfg_for(tiny, *overrides), "bpa+ugsa-s0")
    assert [r.info.run_id for r in runs] == [stopped[0].info.run_id]
    assert runs[0].info.status == "FINISHED" and runs[0].data.tags["resumed"] == "true"
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "online_acc")]
    assert sorted(steps) == list(range(len(res.records)))


def test_a_resumed_sweep_logs_no_finished_cell_twice(tiny):
    """Every cell of the sweep finished: a resume logs none of them again; a cell whose run was deleted
    from MLflow is logged again."""
    overrides = (
        "flow.experiment=resume-sweep",
        "paths.checkpoints=" + str(tiny["tmp"] / "ckpt-resume-sweep"),
        "sweep.methods=[bn,tent]",
        "sweep.aggregators=[fedavg]",
        "sweep.seeds=[0]",
        "sweep.privacy=[plain]",
        "adapt.passes=1",
    )
    first = F.sweep(cfg_for(tiny, *overrides))
    client = MlflowClient(C.tracking_uri(cfg_for(tiny, *overrides)))
    exp = client.get_experiment_by_name("resume-sweep")

    def cells():
        runs = client.search_runs([exp.experiment_id], "tags.stage = 'adapt'")  # active runs, not deleted ones
        return sorted((r.info.run_name, r.info.run_id) for r in runs)

    before = cells()
    assert [name for name, _ in before] == ["bn+fedavg-s0", "tent+fedavg-s0"]
    client.delete_run(before[1][1])

    again = F.sweep(cfg_for(tiny, *overrides, "flow.resume=true"))

    after = cells()
    assert [name for name, _ in after] == ["bn+fedavg-s0", "tent+fedavg-s0"]  # one run each
    assert after[0] == before[0]  # the same run, not a second one
    assert after[1] != before[1]  # logged again: MLflow no longer held it
    assert [(r["method"], r["summary"]) for r in again] == [(r["method"], r["summary"]) for r in first]
