"""Server-side merging of each arriving client, and FedAvg for source pretraining.

A merger is a thin holder of configuration. ``merge(global_state, client_state, sigma, history)``
returns the new global state and the weight it used; the maths are the pure functions in
:mod:`fedcore.aggregate.functions`.
"""

from __future__ import annotations

from typing import List, Tuple

from fedcore.aggregate.functions import (
    State,
    interpolate,
    l2_distance,
    running_average_merge,
    weighted_average,
)
from fedcore.aggregate.ugsa import UGSA_NORMALIZERS, UGSAMerge, ugsa_merge, ugsa_weight
from fedcore.registry import Registry
from fedcore.types import MergeHistory


class NoMerge:
    """θ_G stays θ_G⁽⁰⁾; every client adapts from it."""

    def merge(
        self, global_state: State, client_state: State, *, sigma: float, history: MergeHistory
    ) -> Tuple[State, float]:
        return global_state, 0.0


class SequentialMerge:
    """θ_G ← θ'_k: the next client starts from the last client's adapted model.

    The canonical continual test-time setting (one model adapting along the whole stream of
    clients), and the baseline that shows whether continual adaptation degrades.
    """

    def merge(
        self, global_state: State, client_state: State, *, sigma: float, history: MergeHistory
    ) -> Tuple[State, float]:
        return {k: v.clone() for k, v in client_state.items()}, 1.0  # exactly θ'_k (g + 1·(c − g) rounds)


class FedAvgMerge:
    """Equal-weight running average of θ_G⁽⁰⁾ and every client model merged so far."""

    def merge(
        self, global_state: State, client_state: State, *, sigma: float, history: MergeHistory
    ) -> Tuple[State, float]:
        rate = 1.0 / (history.merged + 2)
        return running_average_merge(global_state, client_state, count=history.merged + 1), rate


AGGREGATORS: Registry = Registry("aggregator")
AGGREGATORS.register("none")(NoMerge)
AGGREGATORS.register("sequential")(SequentialMerge)
AGGREGATORS.register("fedavg")(FedAvgMerge)
AGGREGATORS.register("ugsa")(UGSAMerge)  # its defaults are written once, on the dataclass


def create_aggregator(name: str, **hparams):
    return AGGREGATORS.create(name, **hparams)


def advance(history: MergeHistory, *, sigma: float, weight: float) -> MergeHistory:
    return MergeHistory(
        sigmas=history.sigmas + (float(sigma),), weights=history.weights + (float(weight),), merged=history.merged + 1
    )


__all__: List[str] = [
    "AGGREGATORS",
    "create_aggregator",
    "MergeHistory",
    "advance",
    "NoMerge",
    "SequentialMerge",
    "FedAvgMerge",
    "UGSAMerge",
    "weighted_average",
    "interpolate",
    "ugsa_weight",
    "ugsa_merge",
    "running_average_merge",
    "l2_distance",
    "State",
    "UGSA_NORMALIZERS",
    "STRATEGIES",
    "create_strategy",
]

# Importing the package registers every round strategy by name (the baselines, FedPAD, FedPD++, PP-FCIL).
from fedcore.aggregate import fedpad, fedpd, ppfcil, strategies  # noqa: E402,F401
from fedcore.aggregate.base import STRATEGIES, create_strategy  # noqa: E402
