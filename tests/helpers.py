"""Helpers the flow and end-to-end tests share: tiny-run overrides, and reading back what Prefect recorded."""

from __future__ import annotations

from pathlib import Path


def tiny_overrides(tmp: Path) -> list[str]:
    return [
        "data=digits",
        "pretrain.rounds=8",
        "pretrain.lr=0.1",
        "pretrain.local_epochs=2",
        "pretrain.batch_size=32",
        "adapt.passes=2",
        "flow.num_cpus=2",
        "flow.progress=false",
        f"paths.prepared={tmp}/prepared",
        f"paths.partitions={tmp}/partitions",
        f"paths.models={tmp}/models",
        f"paths.results={tmp}/results",
        f"paths.checkpoints={tmp}/checkpoints",
        f"flow.tracking_uri=sqlite:///{tmp}/mlruns.db",
    ]


def for_variant(overrides: list[str]) -> list[str]:
    """``overrides`` less the settings that the variant they select sets itself (a variant's
    ``paths.models`` replaces the root's; composing both is refused, see ``flows.config.compose.check_not_replaced``)."""
    from omegaconf import DictConfig, OmegaConf

    from flows.config import compose as C

    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("variant=")]
    if not chosen:
        return list(overrides)
    cfg = C.compose([o for o in overrides if o.startswith("variant=")], lay_variant=False)
    overlay = cfg[C.variant_system(cfg, chosen[-1])].variants[chosen[-1]]

    def replaced(o: str) -> bool:
        value = OmegaConf.select(overlay, o.split("=", 1)[0].lstrip("+"), default=None)
        return value is not None and not isinstance(value, DictConfig)  # a block: a group choice (data=digits)

    return [o for o in overrides if "=" not in o or o.startswith("variant=") or not replaced(o)]


# ------------------------------------------------------------------ the Prefect API, as the UI reads it


def prefect_flow_run(mlflow_run):
    """The Prefect flow run an MLflow run was written in (its ``prefect.flow_run_id`` tag), read from the API."""
    import uuid

    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(uuid.UUID(mlflow_run.data.tags["prefect.flow_run_id"]))


def prefect_task_runs(flow_run_id) -> dict:
    """``{task run name: task run}`` of a flow run, from the API."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name: r for r in runs}


def prefect_logs(flow_run_id) -> list:
    """``(task run name or None, level, message)`` of every log of a flow run that reached the API, in order."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)  # logs are sent in batches: send what is queued
    names = {r.id: name for name, r in prefect_task_runs(flow_run_id).items()}
    with get_client(sync_client=True) as client:
        logs, offset = [], 0
        while batch := client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
            limit=200,
            offset=offset,
            sort=LogSort.TIMESTAMP_ASC,
        ):
            logs += batch
            offset += len(batch)
    return [(names.get(log.task_run_id), log.level, log.message) for log in logs]


def prefect_artifacts(flow_run_id) -> list:
    """The artifacts a flow run created, from the API."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )


def write_checkpoint(folder, fingerprint="fp-a", *, corrupt=False):
    """A server checkpoint in ``folder``; ``corrupt``: one byte flipped, so that it fails its sha256."""
    import torch

    from fedcore.engine.checkpoint import save_state

    path = save_state(folder, {"done": 1, "w": torch.ones(3)}, fingerprint=fingerprint)
    if corrupt:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    return folder
