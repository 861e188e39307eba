"""PP-FCIL: federated class-incremental learning with a dual model, exemplars and local Bayesian DP."""

from flows.config.schema import GRID_KEYS, LEAF
from flows.systems.base import System

SYSTEM = System(
    name="ppfcil",
    title="PP-FCIL",
    paper="Privacy-Preserving Federated Class-Incremental Learning (venue not stated)",
    page="docs/systems/ppfcil.md",
    engine="rounds",
    evaluation="incremental",
    headline="avg_inc_acc",
    quick="quick",
    partition_stage="partition_ppfcil",
    cron="0 4 * * *",
    description="PP-FCIL and fine-tuning over class-incremental tasks (average incremental accuracy, forgetting)",
    grid_keys=(GRID_KEYS - {"rounds"}) | {"tasks", "rounds_per_task", "clients", "alpha"},  # rounds: per task
    settings={"privacy_report": LEAF, "privacy_report_with": LEAF},  # the privacy curve's grids
    extra_steps={"ppfcil_privacy": ("flows.reports.tables:ppfcil_privacy", {})},
)
