"""Links between what the Prefect and MLflow UIs show of a run.

:func:`link_runs` ties each MLflow run to the Prefect flow run that wrote it, both ways. A flow run's
parameters are the resolved config it runs on (:func:`flows.config.compose.arrival_run`,
:func:`flows.config.compose.round_run`): the UI shows exactly the settings that ran.
"""

from __future__ import annotations

import os
import re

import mlflow

# ------------------------------------------------------------------------------------ links


def link_runs(run: "mlflow.ActiveRun | None" = None) -> None:
    """Tie an MLflow run (default: the active one) and the Prefect flow run it is written in, both ways.

    The MLflow run gets the tags ``prefect.flow_run_id``, ``prefect.flow_run_name`` and, when a
    Prefect server with a UI is known, ``prefect.flow_run_url``; under the temporary server (no UI,
    gone after the run) ``prefect.ui`` says how to serve the run instead. The flow run gets a
    Markdown artifact with the MLflow experiment, run id and the run's page (for a local store, the
    ``mlflow ui`` command that serves it). Outside a flow run nothing is done.
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
    else:
        tags["prefect.ui"] = (
            f"`prefect server start --host 127.0.0.1` serves this run (the temporary server's "
            f"database) at http://127.0.0.1:4200/runs/flow-run/{flow_run.id}"
        )
    client = mlflow.MlflowClient()
    for k, v in tags.items():
        client.set_tag(run.info.run_id, k, v)
    exp = client.get_experiment(run.info.experiment_id)
    uri = mlflow.get_tracking_uri()
    page = mlflow_run_url(uri, run.info.experiment_id, run.info.run_id)
    if page:
        where = f"[open the run in MLflow]({page})"
    else:  # a file or database store: no server to link to until one is started on it
        page = mlflow_page("http://127.0.0.1:5000", run.info.experiment_id, run.info.run_id)
        where = (
            f"serve the store with `mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000`, then open {page}"
        )
    create_markdown_artifact(
        key=_artifact_key(f"mlflow-{exp.name}-{run.info.run_name}"),
        markdown=(
            f"### MLflow run `{run.info.run_name}`\n\n| | |\n|---|---|\n| experiment | {exp.name} |\n"
            f"| run id | `{run.info.run_id}` |\n| tracking URI | `{uri}` |\n\n{where}.\n"
        ),
        description=f"The MLflow run {run.info.run_name} ({run.info.run_id}) this flow run wrote",
    )


def prefect_flow_run_url(flow_run_id: str) -> str | None:
    """The flow run's page in the Prefect UI: ``PREFECT_UI_URL``, else the API URL without its ``/api``;
    None under the temporary server, which serves no UI."""
    from prefect.settings import get_current_settings

    from flows.services import runtime

    if runtime.is_temporary_api():
        return None
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
    return mlflow_page(tracking_uri, experiment_id, run_id)


# MLflow 3's UI opens in its GenAI mode (traces, of which fedcore writes none) unless the address asks for
# the model-training mode, which shows the runs; the experiment tag `mlflow.experimentKind` does the same
# where the UI has no mode switch.
TRAINING_MODE = "workflowType=machine_learning"


def mlflow_page(server: str, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """The MLflow UI's page of an experiment (its runs table), of a run, or (neither) of the experiments list."""
    path = "/#/experiments" + (f"/{experiment_id}" if experiment_id else "") + (f"/runs/{run_id}" if run_id else "")
    return f"{server.rstrip('/')}{path}?{TRAINING_MODE}"


def _artifact_key(text: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes) from a run's names."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", text.lower())).strip("-")[:100]
