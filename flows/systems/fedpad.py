"""FedPAD: prototype-weighted federated training under domain imbalance, judged by the worst domain."""

from flows.config.schema import LEAF
from flows.systems.base import System

SYSTEM = System(
    name="fedpad",
    title="FedPAD",
    paper="FedPAD (Zhang, Wan and Long; Neurocomputing 695, 2026, 133967)",
    page="docs/systems/fedpad.md",
    engine="rounds",
    evaluation="domains",
    headline="final_worst_acc",
    quick="quick",
    partition_stage="partition_domains",
    cron="0 3 * * *",
    description="FedPAD and its baselines on a domain-silo grid (partition -> every method x seed cell)",
    settings={"report": LEAF, "baselines": LEAF, "ablations": LEAF},  # the pooled report's grids and rows
    extra_steps={
        "rounds": ("flows.runs.steps:single_run", {"system": "fedpad"}),
        "fedpad_report": ("flows.reports.tables:fedpad_report", {}),
    },
)
