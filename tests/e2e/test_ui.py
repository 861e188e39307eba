"""The two UIs a user opens, checked in a headless browser: MLflow's run page and Prefect's flow-run page.

One arrival run goes through a real Prefect server, then an MLflow server serves its tracking
store. Chromium (the system's package; ``make test`` installs it where it can) renders each page
as a user would see it; the test reads the rendered DOM and keeps a screenshot of every page
under ``test-artifacts/ui/`` (``FEDCORE_TEST_ARTIFACTS`` moves it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flows.services import ui
from tests.helpers import tiny_overrides

from .test_deployment import BIN, _free_port, prefect_server  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
ARTIFACTS = Path(os.environ.get("FEDCORE_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "ui"


class Browser:
    """Headless Chromium driven over the DevTools protocol: open a page, poll its DOM, take a screenshot.

    Polling the live DOM until what the test looks for is there (or a deadline passes) is what a
    user does, and does not depend on how long a loaded machine takes to answer the page's requests.
    """

    def __init__(self, profile: Path) -> None:
        port = _free_port()
        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                f"--remote-debugging-port={port}",
                "--remote-debugging-address=127.0.0.1",
                f"--user-data-dir={profile}",
                "--window-size=1400,2000",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.base = f"http://127.0.0.1:{port}"
        _wait_http(f"{self.base}/json/version", seconds=60)
        self._id = 0

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def _call(self, ws, method: str, **params):
        self._id += 1
        ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(ws.recv(timeout=120))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def page(self, url: str, name: str, needles, *, deadline_s: float = 240) -> str:
        """The page's DOM once every needle is in it (or at the deadline); its screenshot goes to ARTIFACTS."""
        import base64

        from websockets.sync.client import connect

        target = httpx.put(f"{self.base}/json/new?about:blank", timeout=30).json()
        with connect(target["webSocketDebuggerUrl"], max_size=None) as ws:
            self._call(ws, "Page.enable")
            self._call(ws, "Page.navigate", url=url)
            end, dom = time.monotonic() + deadline_s, ""
            while time.monotonic() < end:
                time.sleep(2)
                dom = self._call(
                    ws, "Runtime.evaluate", expression="document.documentElement.outerHTML", returnByValue=True
                )["result"].get("value", "")
                if all(n in dom for n in needles):
                    time.sleep(2)  # let the charts finish drawing before the screenshot
                    break
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shot = self._call(ws, "Page.captureScreenshot", format="png")["data"]
            (ARTIFACTS / f"{name}.png").write_bytes(base64.b64decode(shot))
            (ARTIFACTS / f"{name}.html").write_text(dom)
        httpx.get(f"{self.base}/json/close/{target['id']}", timeout=30)
        return dom


def _wait_http(url: str, seconds: int = 180) -> None:
    for _ in range(seconds):
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"{url} did not come up")


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium: `make test` installs it as root (apt-get install "
    "chromium); elsewhere install it to run the browser check",
)
def test_mlflow_and_prefect_pages_show_lineage_charts_and_named_task_runs(prefect_server, tiny, tmp_path):  # noqa: F811
    env = dict(prefect_server)  # Prefect's log level as a user has it: the flows send INFO to the UI
    # the session's tiny federation (data, partition, source model); this run's store and checkpoints are its own
    overrides = tiny_overrides(tiny["tmp"]) + [
        "adapt.passes=1",
        "flow.experiment=ui-test",
        f"flow.tracking_uri=sqlite:///{tmp_path}/mlruns.db",
        f"paths.checkpoints={tmp_path}/checkpoints",
    ]
    script = (
        "import json, sys\n"
        "from flows.config import compose as C\n"
        "from flows.runs import federation as F\n"
        "F.arrival(C.compose(json.loads(sys.argv[1])))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, json.dumps(overrides)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]

    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path}/mlruns.db"
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("ui-test")
    parent = next(r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == "bpa+ugsa-s0")

    browser = Browser(tmp_path / "chromium-profile")
    try:
        port = _free_port()
        server = subprocess.Popen(
            [
                str(BIN / "mlflow"),
                "server",
                "--backend-store-uri",
                store,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            cwd=tmp_path,
            # MLflow's job runner (eight more processes, for GenAI jobs fedcore never submits) would take
            # the 2 cores the browser needs
            env={**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_http(f"http://127.0.0.1:{port}/health")
            # an experiment opens on its runs table (MLflow 3 would open a GenAI overview of traces)
            assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
            listing = browser.page(
                ui.mlflow_page(f"http://127.0.0.1:{port}", exp.experiment_id),
                "mlflow-experiment",
                ["bpa+ugsa-s0"],
                deadline_s=90,
            )
            assert "bpa+ugsa-s0" in listing, "the experiment does not open on its runs table"
            page = ui.mlflow_page(f"http://127.0.0.1:{port}", exp.experiment_id, parent.info.run_id)
            overview = browser.page(page, "mlflow-run", ["partition_manifest_sha256"])
            for tag in ("git_commit", "data_sha256", "partition_manifest_sha256", "config_fingerprint"):
                assert tag in overview, f"the run page shows no {tag} tag"
            assert parent.data.tags["data_sha256"] in overview
            charts = browser.page(
                page.replace("?", "/model-metrics?"), "mlflow-run-charts", ["online_acc", "drift_total"]
            )
            for metric in ("online_acc", "drift_total"):
                assert metric in charts, f"no per-arrival chart of {metric} on the run's metrics page"
        finally:
            server.terminate()
            server.wait(timeout=60)

        api = prefect_server["PREFECT_API_URL"]
        runs = httpx.post(f"{api}/flow_runs/filter", json={"limit": 50}, timeout=30).json()
        arrival = next(
            f
            for f in runs
            if f["state_type"] == "COMPLETED"
            and httpx.get(f"{api}/flows/{f['flow_id']}", timeout=30).json()["name"] == "sequential-arrival"
        )
        prefect_ui = api.removesuffix("/api")
        flow_run = browser.page(
            f"{prefect_ui}/runs/flow-run/{arrival['id']}", "prefect-flow-run", ["pass-0-arrivals-000-", "arrival 0 ("]
        )
    finally:
        browser.close()
    assert arrival["name"] == "bpa+ugsa-s0", "the flow run is named for its experiment, as its MLflow run"
    assert "pass-0-arrivals-000-" in flow_run, "the flow-run page does not show the named pass task runs"
    assert "arrival 0 (" in flow_run, "the flow-run page shows no INFO logs"
