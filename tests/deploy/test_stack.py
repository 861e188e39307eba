"""The deployment end to end (``make deploy-check``): ``infra/stack.py up`` on loopback, every system's nightly
deployment triggered through the Prefect API and run by the worker, then what each service holds, then faults.

Runs on a copy of the work tree (the nightly runs write results and record them in its dvc.lock), with a
stack of its own on free ports. The tests run in file order and share the stack.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import httpx
import pytest

from flows import systems

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
NIGHTLY_MINUTES = 45  # the six runs one after another: about 20 minutes on 2 cores
# DP-TTA's nightly is its whole private grid, 43 cells (24 minutes here): the check runs 4 of them through the
# same deployment, the configured cell (bpa+ugsa, plain) among them, so that CI stays well inside its time.
# With overrides the run is not recorded or pushed; BPFedCTTA's run pushes the data and partition both share.
SMALLER = {
    "dptta": [
        "dptta.variants.private.sweep.methods=[tent,bpa]",
        "dptta.variants.private.sweep.privacy=[plain,dp-eps1]",
    ]
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _copy_work_tree(dst: Path) -> None:
    """The checkout as it is (tracked and untracked files, not ignored ones) in a git repository of its own."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    git = ["git", "-c", "user.name=fedcore", "-c", "user.email=ci@fedcore.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dst, check=True)
    subprocess.run([*git, "commit", "-qm", "work tree under test"], cwd=dst, check=True)


class Deployment:
    def __init__(self, base: Path):
        self.base = base
        self.repo = base / "repo"
        self.dir = base / "stack"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PREFECT_API_URL"))},
            "FEDCORE_STACK_DIR": str(self.dir),
            **{
                k: str(_free_port())
                for k in ("FEDCORE_PG_PORT", "FEDCORE_MLFLOW_PORT", "FEDCORE_PREFECT_PORT", "FEDCORE_RAY_PORT")
            },
            "FEDCORE_SSH_PORT": str(_free_port()),
        }
        self.runs: Dict[str, Dict[str, Any]] = {}  # deployment name -> its flow run, once finished

    def stack(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PY, str(self.repo / "infra" / "stack.py"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def client_env(self) -> Dict[str, str]:
        env = dict(self.env)
        for line in (self.dir / "env").read_text().splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value
        return env

    @property
    def api(self) -> str:
        return self.client_env()["PREFECT_API_URL"]

    def post(self, path: str, body: Dict[str, Any] | None = None) -> Any:
        r = httpx.post(f"{self.api}{path}", json=body or {}, timeout=60)
        r.raise_for_status()
        return r.json()

    def trigger(self, deployment: str, parameters: Dict[str, Any] | None = None) -> str:
        """A flow run of ``flow/deployment`` created through the Prefect API, for the worker to pick up."""
        dep = httpx.get(f"{self.api}/deployments/name/{deployment}", timeout=60).json()
        run = self.post(f"/deployments/{dep['id']}/create_flow_run", {"parameters": parameters or {}})
        return str(run["id"])

    def wait(self, run_ids: List[str], minutes: float) -> Dict[str, Dict[str, Any]]:
        deadline = time.monotonic() + 60 * minutes
        while time.monotonic() < deadline:
            runs = self.post("/flow_runs/filter", {"flow_runs": {"id": {"any_": run_ids}}})
            if all(r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for r in runs):
                return {r["id"]: r for r in runs}
            time.sleep(5)
        raise AssertionError(
            f"flow runs not finished after {minutes} min: {[(r['name'], r['state_type']) for r in runs]}"
        )

    def running_tasks(self, run_id: str) -> List[Dict[str, Any]]:
        """The task runs of a flow run's subflows that are RUNNING now."""
        subs = self.post("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}})
        body = {
            "flow_runs": {"id": {"any_": [run_id, *(r["id"] for r in subs)]}},
            "task_runs": {"state": {"type": {"any_": ["RUNNING"]}}},
        }
        return list(self.post("/task_runs/filter", body))

    def family_logs(self, run_id: str) -> List[str]:
        """The logs of a flow run and of its subflow runs (and their tasks)."""
        subs = self.post("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}})
        return [msg for rid in [run_id, *(r["id"] for r in subs)] for msg in self.logs(rid)]

    def logs(self, run_id: str) -> List[str]:
        return [entry["message"] for entry in self.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}})]


@pytest.fixture(scope="module")
def deployed():
    base = Path(tempfile.mkdtemp(prefix="fcdeploy", dir="/tmp"))  # the postgres user must reach it
    base.chmod(0o755)
    d = Deployment(base)
    d.repo.mkdir()
    _copy_work_tree(d.repo)
    up = d.stack("up")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        # the schedules stay defined but fire nothing while the check runs: its runs are the ones it creates
        for dep in d.post("/deployments/filter"):
            assert dep["schedules"], dep["name"]
            httpx.patch(f"{d.api}/deployments/{dep['id']}", json={"paused": True}, timeout=60).raise_for_status()
        yield d
    finally:
        down = d.stack("down")
        print(down.stdout, down.stderr)
        shutil.rmtree(base, ignore_errors=True)


def _cmdlines() -> List[bytes]:
    found = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            found.append(path.read_bytes())
        except OSError:  # the process ended meanwhile
            continue
    return found


def _mlflow(d: Deployment):
    from mlflow.tracking import MlflowClient

    return MlflowClient(d.client_env()["FEDCORE_TRACKING_URI"])


def test_the_stack_is_up_on_loopback(deployed):
    status = deployed.stack("status")
    assert status.returncode == 0, status.stdout
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
    for var in ("FEDCORE_PG_PORT", "FEDCORE_MLFLOW_PORT", "FEDCORE_PREFECT_PORT", "FEDCORE_SSH_PORT"):
        port = deployed.env[var]
        addresses = {
            line.split()[3].rsplit(":", 1)[0] for line in listening.splitlines() if line.split()[3].endswith(f":{port}")
        }
        assert addresses == {"127.0.0.1"}, (var, addresses)
    state = json.loads((deployed.dir / "stack.json").read_text())
    if state.get("netns_name"):  # Ray, the worker and the flow runs: inside a namespace that has only loopback
        inner = subprocess.run(
            ["ip", "netns", "exec", state["netns_name"], "ss", "-ltnH"], capture_output=True, text=True
        )
        hosts = {line.split()[3].rsplit(":", 1)[0] for line in inner.stdout.splitlines()}
        assert hosts and hosts <= {"127.0.0.1", "[::ffff:127.0.0.1]"}, hosts
        links = subprocess.run(
            ["ip", "netns", "exec", state["netns_name"], "ip", "-o", "link"], capture_output=True, text=True
        )
        assert [line.split(":")[1].strip() for line in links.stdout.splitlines()] == ["lo"]
    # the MLflow and Prefect servers keep their records in the stack's PostgreSQL
    env = {**deployed.client_env(), "PGPASSWORD": (deployed.dir / "postgres.password").read_text().strip()}
    tables = subprocess.run(
        [
            "psql",
            "-h",
            "127.0.0.1",
            "-p",
            deployed.env["FEDCORE_PG_PORT"],
            "-U",
            "fedcore",
            "-d",
            "mlflow",
            "-tAc",
            "SELECT count(*) FROM information_schema.tables WHERE table_name IN ('runs', 'registered_models')",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert tables.stdout.strip() == "2", tables.stderr
    # the database password is on no command line (every local user can read those)
    password = (deployed.dir / "postgres.password").read_text().strip()
    assert not any(password.encode() in c for c in _cmdlines())


def test_every_nightly_deployment_completes_through_the_worker(deployed):
    d = deployed
    names = {
        s: f"{'nightly-rounds' if systems.get(s).engine == 'rounds' else 'nightly-federation'}/nightly-{s}"
        for s in systems.names()
    }
    ids = {s: d.trigger(dep, {"overrides": SMALLER.get(s, [])}) for s, dep in names.items()}
    # a run that asks for GPUs (device=auto on a cluster that declares one): its cells land on the GPU node
    gpu = d.trigger(
        "nightly-rounds/nightly-fedpad",
        {
            "overrides": [
                "device=auto",
                "flow.register=none",
                f"paths.results={d.base}/gpu/results",
                f"paths.checkpoints={d.base}/gpu/checkpoints",
            ]
        },
    )
    runs = d.wait([*ids.values(), gpu], NIGHTLY_MINUTES)
    for s, run_id in [*ids.items(), ("gpu", gpu)]:
        assert runs[run_id]["state_type"] == "COMPLETED", (s, runs[run_id]["state"], d.logs(run_id)[-20:])
        d.runs[s] = runs[run_id]
    for s in names:  # each run's named task runs, and its logs
        logs = "\n".join(d.logs(ids[s]))
        assert f"nightly {s}" in logs, (s, logs[-2000:])
        if s in SMALLER:  # a run with overrides is not what dvc.yaml records: neither recorded nor pushed
            assert "not pushed to the DVC remote: a run with overrides" in logs, (s, logs[-2000:])
            continue
        tasks = d.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [ids[s]]}}})
        assert any(t["name"].startswith("share-") and t["state_type"] == "COMPLETED" for t in tasks), s
        assert re.search(r"\bpushed \d+ outputs", logs) and "NOT pushed" not in logs, (s, logs[-2000:])
    # the GPU run's cells say, in their task logs, that torch saw no CUDA on that node
    assert "torch sees no CUDA here: the model runs on the CPU" in "\n".join(d.family_logs(gpu))


def _cells(d: Deployment, *run_ids: str) -> List[Any]:
    """The MLflow runs of the cells that ran on Ray (tagged with their node), of the flow runs ``run_ids`` and
    their subflows (every cell when none is named)."""
    client = _mlflow(d)
    family = {
        sub["id"] for sub in d.post("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": list(run_ids)}}})
    }
    family |= set(run_ids)
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps, "tags.`ray.node_id` != ''", max_results=5000)
    return [r for r in runs if not run_ids or r.data.tags.get("prefect.flow_run_id") in family]


def test_cells_ran_on_both_ray_nodes_and_gpu_cells_on_the_gpu_node(deployed):
    d = deployed
    assert d.runs, "the nightly runs did not finish"
    nightly = _cells(d, *(d.runs[s]["id"] for s in systems.names()))
    nodes = {r.data.tags["ray.node_id"] for r in nightly}
    assert len(nodes) == 2, nodes
    gpu_cells = _cells(d, d.runs["gpu"]["id"])
    # the code came through Ray's runtime_env, not from the checkout
    code = {r.data.tags["code.fedcore"] for r in nightly + gpu_cells}
    assert all("runtime_resources" in c for c in code), code
    assert gpu_cells and all(r.data.tags["ray.gpu_ids"] == "0" for r in gpu_cells)
    gpu_nodes = {r.data.tags["ray.node_id"] for r in gpu_cells}
    assert len(gpu_nodes) == 1 and gpu_nodes < nodes
    assert all(r.data.tags["ray.gpu_ids"] == "" for r in nightly)  # device=cpu asks for none


def test_mlflow_holds_runs_lineage_registry_and_artifacts(deployed, tmp_path):
    d = deployed
    client = _mlflow(d)
    registered = {m.name: m for m in client.search_registered_models()}
    for s in systems.names():
        mine = [name for name in registered if name.startswith(f"{s}-")]
        assert mine, (s, sorted(registered))
        version = client.get_model_version_by_alias(mine[0], "nightly")
        assert client.get_model_version_by_alias(mine[0], "champion").version == version.version
        run = client.get_run(version.run_id)
        assert run.info.status == "FINISHED"
        assert len(run.data.tags["git_commit"]) == 40 and "dvc_lock_sha256" in run.data.tags
    # the registered run's artifacts, read back through the server, equal the files its cell wrote
    version = client.get_model_version_by_alias("fedpad-quick", "nightly")
    plots = [a.path for a in client.list_artifacts(version.run_id, "plots")]
    assert plots, "the cell logged no plots"
    cell = d.repo / "results" / "fedpad" / "quick" / "cells" / "fedpad-s0"
    for path in plots:
        got = Path(client.download_artifacts(version.run_id, path, str(tmp_path)))
        assert got.read_bytes() == (cell / Path(path).name).read_bytes(), path


def _pushed_stages(d: Deployment) -> List[str]:
    stages = []
    for s in systems.names():
        if s in SMALLER:
            continue
        decl = systems.get(s)
        stages += decl.nightly_stages() if decl.engine == "arrivals" else decl.nightly_stages(decl.quick)
    return list(dict.fromkeys(stages))  # BPFedCTTA and DP-TTA share the MNIST data and partition


def _missing_from_remote(d: Deployment, stages: List[str]) -> List[str]:
    """The outputs of ``stages`` (as the copy's dvc.lock records them) that the SSH remote's folder lacks."""
    from flows.services import remote

    base = d.dir / "dvc-remote"
    missing = []
    for out in remote.outputs(d.repo, stages):
        obj = remote._object(base, out.md5)
        if not obj.is_file():
            missing.append(out.path)
    return missing


def test_the_ssh_remote_holds_every_output_and_a_second_clone_pulls_them(deployed):
    d = deployed
    stages = _pushed_stages(d)
    assert _missing_from_remote(d, stages) == []
    git = ["git", "-c", "user.name=fedcore", "-c", "user.email=ci@fedcore.invalid"]
    # On the CPU type that recorded dvc.lock the nightly runs reproduce it byte for byte, and there is
    # nothing to commit; on another type the lock records the new outputs.
    subprocess.run([*git, "commit", "--allow-empty", "-qam", "the nightly runs' dvc.lock"], cwd=d.repo, check=True)
    second = d.base / "second"
    subprocess.run(["git", "clone", "-q", str(d.repo), str(second)], check=True)
    env = {**d.client_env(), "PYTHONPATH": str(second)}
    pull = subprocess.run(  # what `make pull STAGES=...` runs, less the set-up of a second .venv
        [PY, "-m", "flows.services.remote", "pull", *stages], cwd=second, env=env, capture_output=True, text=True
    )
    assert pull.returncode == 0, pull.stdout + pull.stderr
    # what was pulled is what dvc.lock records: DVC finds nothing changed in those stages
    status = subprocess.run(
        [PY, "-m", "dvc", "status", "--json", *stages],
        cwd=second,
        env=env,
        capture_output=True,
        text=True,
    )
    assert status.returncode == 0 and json.loads(status.stdout) == {}, status.stdout + status.stderr


# ------------------------------------------------------------------------------------------------ faults
def _aside(d: Deployment, name: str) -> List[str]:
    """Overrides that keep a fault run's results, checkpoints and MLflow records apart from the nightly ones."""
    return [
        "flow.register=none",
        f"paths.results={d.base}/{name}/results",
        f"paths.checkpoints={d.base}/{name}/checkpoints",
    ]


def _summaries(d: Deployment, run_id: str) -> Dict[str, Dict[str, float]]:
    """Each cell's metrics (less its timings) by name, for the cells of one flow run; every cell FINISHED."""
    runs = _cells(d, run_id)
    assert runs and all(r.info.status == "FINISHED" for r in runs), [(r.info.run_name, r.info.status) for r in runs]
    timed = ("seconds", "_ms")  # how long a step took differs from run to run; nothing else may
    return {r.info.run_name: {k: v for k, v in r.data.metrics.items() if not any(t in k for t in timed)} for r in runs}


def _wait_for(ready, what: str, minutes: float = 10) -> None:
    deadline = time.monotonic() + 60 * minutes
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    raise AssertionError(f"never happened: {what}")


def _wait_for_log(d: Deployment, run_id: str, text: str, minutes: float = 10) -> None:
    _wait_for(lambda: any(text in m for m in d.family_logs(run_id)), f"{text!r} in the logs of {run_id}", minutes)


def _state(d: Deployment) -> Dict[str, Any]:
    import json

    return json.loads((d.dir / "stack.json").read_text())


def test_a_ray_node_stopped_mid_round_changes_no_metric(deployed):
    """The worker node's raylet is killed while cells run on both nodes: Ray reruns its cell on the head."""
    d = deployed
    run = d.trigger("nightly-rounds/nightly-fedpad", {"overrides": _aside(d, "fault-ray-node")})
    # two cells running at once, on two nodes of one CPU each: one of them is on the worker node
    _wait_for(lambda: len(d.running_tasks(run)) >= 2, f"two cells of flow run {run} running at once")
    raylet = _state(d)["ray-worker"]["pids"][0]
    os.kill(raylet, 9)
    finished = d.wait([run], 15)[run]
    assert finished["state_type"] == "COMPLETED", d.logs(run)[-20:]
    assert _summaries(d, run) == _summaries(d, d.runs["fedpad"]["id"])
    up = d.stack("up")  # brings the worker node back for the tests after this one
    assert up.returncode == 0, up.stdout + up.stderr


def test_postgres_restarted_while_a_flow_logs_loses_nothing(deployed):
    """PostgreSQL restarts under the MLflow and Prefect servers while a grid logs its cells: their clients
    retry, the run completes, and every cell's run is FINISHED with the undisturbed run's metrics."""
    d = deployed
    run = d.trigger("nightly-rounds/nightly-fedpad", {"overrides": _aside(d, "fault-postgres")})
    _wait_for_log(d, run, "[1/3]")
    restart = d.stack("restart", "postgres")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    finished = d.wait([run], 15)[run]
    assert finished["state_type"] == "COMPLETED", d.logs(run)[-20:]
    assert _summaries(d, run) == _summaries(d, d.runs["fedpad"]["id"])


def test_an_unreachable_ssh_remote_fails_the_push_not_the_run(deployed):
    """sshd is stopped before a nightly run: the run completes, its log names the command that pushes later,
    and that command, once the remote is back, sends every output."""
    d = deployed
    stop = d.stack("stop", "sshd")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    run = d.trigger("nightly-rounds/nightly-fedpad", {"overrides": []})
    finished = d.wait([run], 15)[run]
    assert finished["state_type"] == "COMPLETED", d.logs(run)[-20:]
    logs = "\n".join(d.logs(run))
    fix = "python -m flows.services.remote push partition_domains@quick fedpad@quick"
    assert "pushing it to the DVC remote failed" in logs and fix in logs, logs[-3000:]
    up = d.stack("up")
    assert up.returncode == 0, up.stdout + up.stderr
    push = subprocess.run(
        [PY, *fix.split()[1:]],
        cwd=d.repo,
        env={**d.client_env(), "PYTHONPATH": str(d.repo)},
        capture_output=True,
        text=True,
    )
    assert push.returncode == 0, push.stdout + push.stderr
    assert _missing_from_remote(d, ["partition_domains@quick", "fedpad@quick"]) == []
