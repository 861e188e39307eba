"""BPFedCTTA: federated continual test-time adaptation (BPA prior, UGSA gate, sequential arrival)."""

from flows.config.schema import STRESS
from flows.systems.base import System

SYSTEM = System(
    name="bpfedctta",
    title="BPFedCTTA",
    paper="Towards Stable Federated Continual Test-Time Adaptation in Wild World (CVPR 2026)",
    page="docs/systems/bpfedctta.md",
    engine="arrivals",
    evaluation="arrivals",
    headline="final_avg_holdout_acc",
    quick="mnist",
    stages=("prepare@mnist", "partition@mnist", "pretrain@mnist", "adapt@mnist"),
    cron="0 2 * * *",
    description="prepare -> partition -> FedAvg pretraining -> (method x aggregator x seed) test-time sweep",
    settings={"stress": STRESS, "stress_cifar": STRESS},
    extra_steps={
        "stress": ("flows.stages:stress", {"protocol": "bpfedctta"}),
        "stress_report": ("flows.stages:stress_report", {"protocol": "bpfedctta"}),
        "stress_cifar": ("flows.stages:stress", {"protocol": "cifar10"}),
        "stress_cifar_report": ("flows.stages:stress_report", {"protocol": "cifar10"}),
    },
)
