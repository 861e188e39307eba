"""The nightly jobs, deployed with cron schedules by ``infra/prefect.yaml``.

* ``nightly``: rebuild data and partitions, pretrain, then run the test-time sweep grid;
* ``nightly_rounds``: a round-based system's grid (FedPAD by default): partition, then every cell.

``overrides`` are Hydra overrides. Each job rebuilds its inputs outside DVC, so what it reads
back is checked against the md5s it recorded as it wrote them, not against ``dvc.lock``.

A run without overrides writes exactly what the DVC stages declare,
so after it succeeds the flow records those stages (``dvc commit``: dvc.lock and the DVC cache) and
pushes them to the DVC remote (``flows/remote.py``). Another machine then gets the run with
``make pull`` once it has this dvc.lock. A run with overrides is not what dvc.yaml describes, so it
is neither recorded nor pushed; ``push=False`` turns sharing off.
"""

from __future__ import annotations

from typing import List, Optional

from prefect import flow, get_run_logger, task

from flows import config as C
from flows import integrity

PIPELINE = ["prepare@mnist", "partition@mnist", "pretrain@mnist", "adapt@mnist"]  # the default variant's stages
PARTITION_STAGE = {"fedpad": "partition_domains", "fedpd": "partition_fedpd"}


def _share_run_name(parameters) -> str:
    return "share-" + "+".join(parameters["stages"])


@task(retries=2, retry_delay_seconds=60, task_run_name=_share_run_name)
def share(stages: List[str], root: str = str(C.ROOT)) -> str:
    """Record what the run wrote as ``stages`` in dvc.lock and the cache, then push them.

    Retried because the remote is outside I/O; both steps are idempotent.
    """
    from flows import remote

    remote.commit(root, stages)
    report = remote.push(root, stages)
    return f"pushed {len(report.pushed)} outputs of {', '.join(stages)} to {report.remote.describe()}"


def _share(stages: List[str], overrides: Optional[List[str]], push: bool, root: str = str(C.ROOT)) -> str:
    if not push:
        return "not pushed to the DVC remote: push=false"
    if overrides:
        return ("not pushed to the DVC remote: a run with overrides is not what dvc.yaml records "
                f"(overrides: {' '.join(overrides)})")
    return share(stages, root)


@flow(name="nightly-federation")
def nightly(overrides: Optional[List[str]] = None, push: bool = True) -> dict:
    from flows.federation import partition_dir, pretrain
    from flows.stages import _adapt, _partition, _prepare

    logger = get_run_logger()
    cfg = C.compose(list(overrides or []))
    cfg.flow.aliases = [*cfg.flow.aliases, "nightly"]  # the registered version of a scheduled run
    _prepare(cfg)
    _partition(cfg)
    written = integrity.record(partition_dir(cfg))
    written.update(integrity.record(pretrain(cfg, written=written)))
    results = _adapt(cfg, written=written)  # the sweep plus the table and summary the adapt stage declares
    best = max(results, key=lambda r: r["summary"]["final_avg_holdout_acc"])
    logger.info("nightly sweep done: best %s+%s hold-out %.3f", best["method"], best["aggregator"],
                best["summary"]["final_avg_holdout_acc"])
    logger.info(_share(PIPELINE, overrides, push))
    return {f"{r['method']}+{r['aggregator']}+s{r['seed']}": r["summary"] for r in results}


@flow(name="nightly-rounds")
def nightly_rounds(system: str = "fedpad", grid: str = "quick", overrides: Optional[List[str]] = None,
                   push: bool = True) -> dict:
    from flows.rounds import grid as run_grid
    from flows.stages import _partition_domains

    logger = get_run_logger()
    cfg = C.compose([f"{system}.grid={grid}", *(overrides or [])])
    cfg.flow.aliases = [*cfg.flow.aliases, "nightly"]  # the registered version of a scheduled run
    _partition_domains(cfg, system)
    rows = run_grid(cfg, system, written=integrity.record(C.domains_dir(cfg, system)))
    best = max(rows, key=lambda r: r["summary"]["final_worst_acc"])
    logger.info("nightly %s grid %s done: best worst-domain accuracy %.3f (%s, seed %d)", system, grid,
                best["summary"]["final_worst_acc"], best["method"], best["seed"])
    if grid in cfg[system].get("stages", []) and system in PARTITION_STAGE:
        logger.info(_share([f"{PARTITION_STAGE[system]}@{grid}", f"{system}@{grid}"], overrides, push))
    else:
        logger.info("not pushed to the DVC remote: dvc.yaml has no %s@%s stage (%s.stages)", system, grid, system)
    return {f"{r['method']}+s{r['seed']}": r["summary"] for r in rows}
