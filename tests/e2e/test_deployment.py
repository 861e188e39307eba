"""The nightly deployment against a real Prefect server on loopback, run once by a process worker (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flows.config.compose import ROOT
from tests.flows.test_flows import _free_port
from tests.helpers import tiny_overrides

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def prefect(*args, env, timeout=300, check=True):
    return subprocess.run(
        [str(BIN / "prefect"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=check
    )


@pytest.fixture
def prefect_server(tmp_path):
    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_CLI_PROMPT": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(120):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("prefect server did not come up on loopback")
        yield env
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_nightly_deployment_has_cron_and_runs_through_a_worker(prefect_server, tmp_path):
    env = prefect_server
    prefect("work-pool", "create", "fedcore-process", "--type", "process", env=env)
    prefect("deploy", "--all", "--prefect-file", "infra/prefect.yaml", env=env)
    from flows import systems

    inspect = prefect("deployment", "inspect", "nightly-federation/nightly-bpfedctta", env=env).stdout
    assert systems.get("bpfedctta").cron in inspect
    for name in systems.names("rounds"):  # every round-based system's deployment, with its own schedule
        rounds = prefect("deployment", "inspect", f"nightly-rounds/nightly-{name}", env=env).stdout
        assert systems.get(name).cron in rounds and name in rounds

    overrides = tiny_overrides(tmp_path) + [
        "pretrain.rounds=2",
        "adapt.passes=1",
        "sweep.methods=[bn]",
        "sweep.aggregators=[ugsa]",
        "method=bn",
        "flow.experiment=nightly-test",
    ]
    run = prefect(
        "deployment",
        "run",
        "nightly-federation/nightly-bpfedctta",
        "--params",
        json.dumps({"overrides": overrides}),
        env=env,
    ).stdout
    prefect("worker", "start", "--pool", "fedcore-process", "--run-once", env=env, timeout=900)
    runs = httpx.post(f"{env['PREFECT_API_URL']}/flow_runs/filter", json={"limit": 20}, timeout=30).json()
    nightly = [r for r in runs if r["deployment_id"] and r["name"] in run]
    assert nightly and nightly[0]["state_type"] == "COMPLETED", (run, [(r["name"], r["state_type"]) for r in runs])
    assert (tmp_path / "results" / "cells" / "bn-ugsa-s0" / "accuracy_matrix.png").is_file()
    # the configured cell (method=bn, ugsa) is registered as <system>-<data>, with the nightly alias
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns.db")
    nightly_version = client.get_model_version_by_alias("bpfedctta-digits", "nightly")
    assert nightly_version.tags["method"] == "bn" and nightly_version.tags["aggregator"] == "ugsa"
    assert client.get_model_version_by_alias("bpfedctta-digits", "champion").version == nightly_version.version
    parent = client.get_run(nightly_version.run_id)
    # the sweep cell's run was created after the cell ended: it still spans the cell's own time
    assert abs((parent.info.end_time - parent.info.start_time) / 1000 - parent.data.metrics["run_seconds"]) < 0.5
    # The sweep as the UI shows it: its settings as parameters, its cell's task run named for the cell
    [sweep] = [r for r in runs if r["name"] == "sweep-digits"]
    grid = sweep["parameters"]["config"]["sweep"]
    assert grid["methods"] == ["bn"] and grid["aggregators"] == ["ugsa"]
    tasks = httpx.post(
        f"{env['PREFECT_API_URL']}/task_runs/filter", json={"flow_runs": {"id": {"any_": [sweep["id"]]}}}, timeout=30
    ).json()
    assert [t["name"] for t in tasks] == ["bn+ugsa-s0"]
