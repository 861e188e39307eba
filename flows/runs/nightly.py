"""The nightly jobs, deployed with cron schedules by ``infra/prefect.yaml``.

* ``nightly``: a test-time adaptation system (BPFedCTTA, DP-TTA): rebuild data and partitions, pretrain,
  then run its quick variant's sweep;
* ``nightly_rounds``: a round-based system's grid (FedPAD, FedPD++, PP-FCIL): partition, then every cell.

Each system's deployment (schedule, quick default, stages to push) comes from its declaration
(:mod:`flows.systems`); ``python -m flows.runs.deploy`` writes them into ``infra/prefect.yaml``.

``overrides`` are Hydra overrides. Each job rebuilds its inputs outside DVC, so what it reads
back is checked against the md5s it recorded as it wrote them, not against ``dvc.lock``.

A run without overrides writes exactly what the DVC stages declare,
so after it succeeds the flow records those stages (``dvc commit``: dvc.lock and the DVC cache) and
pushes them to the DVC remote (``flows/services/remote.py``). Another machine then gets the run with
``make pull`` once it has this dvc.lock. A run with overrides is not what dvc.yaml describes, so it
is neither recorded nor pushed; ``push=False`` turns sharing off. A remote that is still unreachable after
the push's retries does not fail the run: the error is logged with the command that pushes later.
"""

from __future__ import annotations

from typing import List, Optional

from prefect import flow, get_run_logger, task

from flows import systems
from flows.config import compose as C
from flows.services import integrity


def _share_run_name(parameters) -> str:
    return "share-" + "+".join(parameters["stages"])


@task(retries=2, retry_delay_seconds=30, task_run_name=_share_run_name)
def share(stages: List[str], root: str = str(C.ROOT)) -> str:
    """Record what the run wrote as ``stages`` in dvc.lock and the cache, then push them.

    Retried because the remote is outside I/O; both steps are idempotent.
    """
    from flows.services import remote

    remote.commit(root, stages)
    report = remote.push(root, stages)
    return f"pushed {len(report.pushed)} outputs of {', '.join(stages)} to {report.remote.describe()}"


def _share(stages: List[str], overrides: Optional[List[str]], push: bool, root: str = str(C.ROOT)) -> str:
    if not push:
        return "not pushed to the DVC remote: push=false"
    if overrides:
        return (
            "not pushed to the DVC remote: a run with overrides is not what dvc.yaml records "
            f"(overrides: {' '.join(overrides)})"
        )
    from flows.services.remote import RemoteUnreachable

    try:
        return share(stages, root)
    except RemoteUnreachable as exc:  # the run succeeded and is recorded (dvc commit ran first); only the push failed
        fix = f"python -m flows.services.remote push {' '.join(stages)}"
        get_run_logger().error(
            "the run finished, but pushing it to the DVC remote failed after retries: %s\n"
            "Its outputs are recorded in dvc.lock and the DVC cache of %s; once the remote is reachable, "
            "send them with `%s` (or `make push`).",
            exc,
            root,
            fix,
        )
        return f"NOT pushed to the DVC remote (it failed; push later with `{fix}`)"


@flow(name="nightly-federation")
def nightly(system: str = "bpfedctta", overrides: Optional[List[str]] = None, push: bool = True) -> dict:
    """A test-time adaptation system's nightly run: its quick variant's data, partition, source model and sweep."""
    from flows.runs.federation import partition_dir, pretrain
    from flows.runs.steps import adapt, partition, prepare

    systems.configured_plugins(overrides or [])  # a plug-in system is known before it is looked up
    decl = systems.get(system)
    if decl.engine != "arrivals":
        raise ValueError(
            f"{system} runs rounds; its nightly flow is nightly_rounds (systems: "
            f"{', '.join(systems.names('arrivals'))} run here)"
        )
    logger = get_run_logger()
    cfg = C.compose([f"variant={decl.quick}", *(overrides or [])])
    cfg.flow.aliases = [*cfg.flow.aliases, "nightly"]  # the registered version of a scheduled run
    prepare(cfg)
    partition(cfg)
    written = integrity.record(partition_dir(cfg))
    written.update(integrity.record(pretrain(cfg, written=written)))
    results = adapt(cfg, written=written)  # the sweep plus the table and summary the adapt stage declares
    best = max(results, key=lambda r: r["summary"][decl.headline])
    logger.info(
        "nightly %s sweep done: best %s+%s %s %.3f",
        system,
        best["method"],
        best["aggregator"],
        decl.headline,
        best["summary"][decl.headline],
    )
    logger.info(_share(decl.nightly_stages(), overrides, push))
    return {f"{r['method']}+{r['aggregator']}+s{r['seed']}": r["summary"] for r in results}


@flow(name="nightly-rounds")
def nightly_rounds(
    system: str = "fedpad", grid: str = "quick", overrides: Optional[List[str]] = None, push: bool = True
) -> dict:
    """A round-based system's nightly run: a grid's partition, then every (method, seed) cell."""
    from flows.runs.rounds import grid as run_grid
    from flows.runs.steps import partition_domains

    systems.configured_plugins(overrides or [])
    decl = systems.get(system)
    if decl.engine != "rounds":
        raise ValueError(
            f"{system} adapts arriving clients; its nightly flow is nightly (systems: "
            f"{', '.join(systems.names('rounds'))} run here)"
        )
    logger = get_run_logger()
    cfg = C.compose([f"{system}.grid={grid}", *(overrides or [])])
    cfg.flow.aliases = [*cfg.flow.aliases, "nightly"]  # the registered version of a scheduled run
    partition_domains(cfg, system)
    rows = run_grid(cfg, system, written=integrity.record(C.domains_dir(cfg, system)))
    best = max(rows, key=lambda r: r["summary"][decl.headline])
    logger.info(
        "nightly %s grid %s done: best %s %.3f (%s, seed %d)",
        system,
        grid,
        decl.headline,
        best["summary"][decl.headline],
        best["method"],
        best["seed"],
    )
    if grid in cfg[system].get("stages", []):
        logger.info(_share(decl.nightly_stages(grid), overrides, push))
    else:
        logger.info("not pushed to the DVC remote: dvc.yaml has no %s@%s stage (%s.stages)", system, grid, system)
    return {f"{r['method']}+s{r['seed']}": r["summary"] for r in rows}
