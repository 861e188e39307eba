"""FedPD++: federated open-set recognition with importance masks and optimal-transport alignment."""

from flows.config.schema import GRID_KEYS
from flows.systems.base import System

SYSTEM = System(
    name="fedpd",
    title="FedPD++",
    paper="FedPD++: Enhanced Federated Open-Set Recognition with Parameter Disentanglement (IJCV)",
    page="docs/systems/fedpd.md",
    engine="rounds",
    evaluation="openset",
    headline="final_auroc",
    quick="quick",
    partition_stage="partition_fedpd",
    cron="30 3 * * *",
    description="FedPD++, FedPD and FedAvg + PROSER/MSP on an open-set domain grid (AUROC, OSCR)",
    grid_keys=GRID_KEYS | {"known", "unknown", "unknown_sets", "known_split"},  # its known and unknown classes
)
