"""A plug-in that adds a server strategy and a round-based system without touching the platform's files.

Importing it registers:

* ``fedmedian``, a strategy: the coordinate-wise median of the client models;
* ``toy``, a system: FedAvg against FedMedian on two digit domains, judged by the mean accuracy over
  domains, with its own report.

Run it with ``plugins=[tests.flows.example_plugin]`` (docs/extending.md walks through each part).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from fedcore.aggregate.base import STRATEGIES, Aggregated, Strategy, Updates
from fedcore.types import State
from flows import systems
from flows.reports import evaluations
from flows.reports.evaluations import Evaluation, GridRun


# --- a strategy -----------------------------------------------------------------------------------------
@STRATEGIES.register("fedmedian")
class FedMedian(Strategy):
    """The coordinate-wise median of the client models: robust to a few clients far from the rest."""

    trainer = ("sgd", "prox")  # the local objectives it is written for

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        states = [u.state for _, u in updates]
        merged = {}
        for key, value in global_state.items():
            if value.is_floating_point():
                merged[key] = torch.stack([s[key] for s in states]).median(dim=0).values
            else:  # counters (BatchNorm's num_batches_tracked): the newest client's
                merged[key] = states[-1][key].clone()
        return Aggregated(merged)


# --- an evaluation: how the grid is judged and reported ---------------------------------------------------
def mean_domain_report(run: GridRun) -> str:
    """table.md and summary.json: each method's final accuracy averaged over domains and seeds."""
    run.out.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in run.rows))
    means = {m: float(np.mean([r["summary"]["final_avg_acc"] for r in run.rows if r["method"] == m])) for m in methods}
    table = "| method | mean accuracy over domains |\n|---|---|\n" + "".join(
        f"| {m} | {v:.3f} |\n" for m, v in means.items()
    )
    (run.out / "table.md").write_text(f"{run.title}\n\n{table}")
    (run.out / "summary.json").write_text(json.dumps({m: {"avg_acc": v} for m, v in means.items()}, indent=1))
    return table


evaluations.register(
    Evaluation(
        "mean-domain", inputs=evaluations.domain_inputs, plot=evaluations.get("domains").plot, report=mean_domain_report
    )
)


# --- a system -------------------------------------------------------------------------------------------
SYSTEM = systems.register(
    systems.System(
        name="toy",
        title="Toy",
        paper="none: a worked example",
        page="docs/extending.md",
        engine="rounds",
        evaluation="mean-domain",
        headline="final_avg_acc",
        quick="tiny",
        partition_stage="partition_toy",
        cron="0 5 * * *",
        description="FedAvg against FedMedian on two digit domains",
        config=str(Path(__file__).with_name("toy.yaml")),
    )
)
