"""DP-TTA: five test-time methods with per-sample clipping and noise, μ-GDP, per-client ledgers."""

from flows.config.schema import AUDIT, STRESS
from flows.systems.base import System

SYSTEM = System(
    name="dptta",
    title="DP-TTA",
    paper="Private and Stable Test-Time Adaptation with Differential Privacy (ICML 2026)",
    page="docs/systems/dptta.md",
    engine="arrivals",
    evaluation="arrivals",
    headline="final_avg_holdout_acc",
    quick="private",
    stages=("prepare@mnist", "partition@mnist", "pretrain@private", "private"),
    cron="30 2 * * *",
    description="GroupNorm pretraining -> every test-time method in every privacy form (plain, clip, DP)",
    settings={"audit": AUDIT, "stress": STRESS},
    extra_steps={
        "stress_private": ("flows.stages:stress", {"protocol": "dptta"}),
        "stress_private_report": ("flows.stages:stress_report", {"protocol": "dptta"}),
    },
)
