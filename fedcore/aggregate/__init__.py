"""Server-side merging of each arriving client, and FedAvg for source pretraining.

A merger is a thin holder of configuration. ``merge(global_state, client_state, sigma, history)``
returns the new global state and the weight it used; the maths are the pure functions in
:mod:`fedcore.aggregate.functions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from fedcore.aggregate.functions import (
    UGSA_NORMALIZERS,
    State,
    interpolate,
    l2_distance,
    running_average_merge,
    ugsa_merge,
    ugsa_weight,
    weighted_average,
)
from fedcore.registry import Registry


@dataclass(frozen=True)
class MergeHistory:
    """What the server remembers between arrivals (checkpointed with the flow)."""

    sigmas: Tuple[float, ...] = ()
    weights: Tuple[float, ...] = ()
    merged: int = 0  # client models merged so far


class NoMerge:
    """θ_G stays θ_G⁽⁰⁾; every client adapts from it."""

    def merge(self, global_state: State, client_state: State, *, sigma: float,
              history: MergeHistory) -> Tuple[State, float]:
        return global_state, 0.0


class SequentialMerge:
    """θ_G ← θ'_k: the next client starts from the last client's adapted model.

    The canonical continual test-time setting (one model adapting along the whole stream of
    clients), and the baseline that shows whether continual adaptation degrades.
    """

    def merge(self, global_state: State, client_state: State, *, sigma: float,
              history: MergeHistory) -> Tuple[State, float]:
        return {k: v.clone() for k, v in client_state.items()}, 1.0  # exactly θ'_k (g + 1·(c − g) rounds)


class FedAvgMerge:
    """Equal-weight running average of θ_G⁽⁰⁾ and every client model merged so far."""

    def merge(self, global_state: State, client_state: State, *, sigma: float,
              history: MergeHistory) -> Tuple[State, float]:
        rate = 1.0 / (history.merged + 2)
        return running_average_merge(global_state, client_state, count=history.merged + 1), rate


@dataclass(frozen=True)
class UGSAMerge:
    """Uncertainty-gated sequential aggregation: θ_G ← θ_G + γ · w_k · (θ'_k − θ_G)."""

    gamma: float = 0.5
    beta: float = 0.2
    normalizer: str = "history"

    def __post_init__(self) -> None:
        if self.gamma < 0:
            raise ValueError(f"UGSA gamma must be >= 0, got {self.gamma}")
        if self.beta < 0:
            raise ValueError(f"UGSA beta must be >= 0, got {self.beta}")
        if self.normalizer not in UGSA_NORMALIZERS:
            raise ValueError(f"unknown UGSA normalizer {self.normalizer!r}; valid names are: "
                             f"{', '.join(UGSA_NORMALIZERS)}")

    def merge(self, global_state: State, client_state: State, *, sigma: float,
              history: MergeHistory) -> Tuple[State, float]:
        w = ugsa_weight(list(history.sigmas) + [sigma], beta=self.beta, normalizer=self.normalizer)
        return ugsa_merge(global_state, client_state, gamma=self.gamma, weight=w), w


AGGREGATORS: Registry = Registry("aggregator")
AGGREGATORS.register("none")(NoMerge)
AGGREGATORS.register("sequential")(SequentialMerge)
AGGREGATORS.register("fedavg")(FedAvgMerge)
AGGREGATORS.register("ugsa")(UGSAMerge)  # its defaults are written once, on the dataclass


def create_aggregator(name: str, **hparams):
    return AGGREGATORS.create(name, **hparams)


def advance(history: MergeHistory, *, sigma: float, weight: float) -> MergeHistory:
    return MergeHistory(sigmas=history.sigmas + (float(sigma),), weights=history.weights + (float(weight),),
                        merged=history.merged + 1)


__all__: List[str] = ["AGGREGATORS", "create_aggregator", "MergeHistory", "advance", "NoMerge", "SequentialMerge", "FedAvgMerge",
                      "UGSAMerge", "weighted_average", "interpolate", "ugsa_weight", "ugsa_merge",
                      "running_average_merge", "l2_distance", "State"]
