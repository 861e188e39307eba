"""What the Prefect and MLflow UIs show of a run: links between a Prefect flow run and its MLflow runs."""

from __future__ import annotations

import os
import re

import mlflow


def link_runs(run: "mlflow.ActiveRun | None" = None) -> None:
    """Tie an MLflow run (default: the active one) and the Prefect flow run it is written in, both ways.

    The MLflow run gets the tags ``prefect.flow_run_id``, ``prefect.flow_run_name`` and, when the
    Prefect API URL is known, ``prefect.flow_run_url``; the flow run gets a Markdown artifact with
    the MLflow experiment, run id and the run's page (for a local store, the ``mlflow ui`` command
    that serves it). Outside a flow run nothing is done.
    """
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    run = run or mlflow.active_run()
    if run is None:
        return
    flow_run = ctx.flow_run
    tags = {"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_name": flow_run.name}
    flow_url = prefect_flow_run_url(str(flow_run.id))
    if flow_url:
        tags["prefect.flow_run_url"] = flow_url
    client = mlflow.MlflowClient()
    for k, v in tags.items():
        client.set_tag(run.info.run_id, k, v)
    exp = client.get_experiment(run.info.experiment_id)
    uri = mlflow.get_tracking_uri()
    page = mlflow_run_url(uri, run.info.experiment_id, run.info.run_id)
    if page:
        where = f"[open the run in MLflow]({page})"
    else:  # a file or database store: no server to link to until one is started on it
        page = f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
        where = (f"serve the store with `mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000`, "
                 f"then open {page}")
    create_markdown_artifact(
        key=_artifact_key(f"mlflow-{exp.name}-{run.info.run_name}"),
        markdown=(f"### MLflow run `{run.info.run_name}`\n\n| | |\n|---|---|\n| experiment | {exp.name} |\n"
                  f"| run id | `{run.info.run_id}` |\n| tracking URI | `{uri}` |\n\n{where}.\n"),
        description=f"The MLflow run {run.info.run_name} ({run.info.run_id}) this flow run wrote")


def prefect_flow_run_url(flow_run_id: str) -> str | None:
    """The flow run's page in the Prefect UI: ``PREFECT_UI_URL``, else the API URL without its ``/api``."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    ui = os.environ.get("PREFECT_UI_URL") or settings.ui_url
    api = os.environ.get("PREFECT_API_URL") or settings.api.url
    if not ui and api:
        ui = re.sub(r"/api/?$", "", api)
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}" if ui else None


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page on an MLflow tracking server; None for a file or database store (no server)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def _artifact_key(text: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes) from a run's names."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", text.lower())).strip("-")[:100]
