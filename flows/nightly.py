"""The nightly job: rebuild data and partitions, pretrain, then run the sweep grid.

Deployed with a cron schedule by ``infra/prefect.yaml``; ``overrides`` are Hydra overrides.
"""

from __future__ import annotations

from typing import List, Optional

from prefect import flow, get_run_logger

from flows import config as C


@flow(name="nightly-federation")
def nightly(overrides: Optional[List[str]] = None) -> dict:
    from flows.federation import pretrain, sweep
    from flows.stages import _partition, _prepare

    logger = get_run_logger()
    cfg = C.compose(list(overrides or []))
    _prepare(cfg)
    _partition(cfg)
    pretrain(cfg)
    results = sweep(cfg)
    best = max(results, key=lambda r: r["summary"]["final_avg_holdout_acc"])
    logger.info("nightly sweep done: best %s+%s hold-out %.3f", best["method"], best["aggregator"],
                best["summary"]["final_avg_holdout_acc"])
    return {f"{r['method']}+{r['aggregator']}+s{r['seed']}": r["summary"] for r in results}
