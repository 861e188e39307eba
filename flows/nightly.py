"""The nightly jobs, deployed with cron schedules by ``infra/prefect.yaml``.

* ``nightly``: rebuild data and partitions, pretrain, then run the test-time sweep grid;
* ``nightly_rounds``: a round-based system's grid (FedPAD by default): partition, then every cell.

``overrides`` are Hydra overrides. Each job rebuilds its inputs outside DVC, so what it reads
back is checked against the md5s it recorded as it wrote them, not against ``dvc.lock``.
"""

from __future__ import annotations

from typing import List, Optional

from prefect import flow, get_run_logger

from flows import config as C
from flows import integrity


@flow(name="nightly-federation")
def nightly(overrides: Optional[List[str]] = None) -> dict:
    from flows.federation import partition_dir, pretrain, sweep
    from flows.stages import _partition, _prepare

    logger = get_run_logger()
    cfg = C.compose(list(overrides or []))
    _prepare(cfg)
    _partition(cfg)
    written = integrity.record(partition_dir(cfg))
    written.update(integrity.record(pretrain(cfg, written=written)))
    results = sweep(cfg, written=written)
    best = max(results, key=lambda r: r["summary"]["final_avg_holdout_acc"])
    logger.info("nightly sweep done: best %s+%s hold-out %.3f", best["method"], best["aggregator"],
                best["summary"]["final_avg_holdout_acc"])
    return {f"{r['method']}+{r['aggregator']}+s{r['seed']}": r["summary"] for r in results}


@flow(name="nightly-rounds")
def nightly_rounds(system: str = "fedpad", grid: str = "quick", overrides: Optional[List[str]] = None) -> dict:
    from flows.rounds import grid as run_grid
    from flows.stages import _partition_domains

    logger = get_run_logger()
    cfg = C.compose([f"{system}.grid={grid}", *(overrides or [])])
    _partition_domains(cfg, system)
    rows = run_grid(cfg, system, written=integrity.record(C.domains_dir(cfg, system)))
    best = max(rows, key=lambda r: r["summary"]["final_worst_acc"])
    logger.info("nightly %s grid %s done: best worst-domain accuracy %.3f (%s, seed %d)", system, grid,
                best["summary"]["final_worst_acc"], best["method"], best["seed"])
    return {f"{r['method']}+s{r['seed']}": r["summary"] for r in rows}
