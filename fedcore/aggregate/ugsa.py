"""UGSA (BPFedCTTA's uncertainty-gated sequential aggregation): how much of an arriving client to merge.

Each arriving client k reports the mean entropy σ_k of its adapted predictions. The gate weight
w_k = exp(−β σ_k) / Σ_{j≤k} exp(−β σ_j) favours confident clients over the history of arrivals,
and the global model moves θ_G ← θ_G + γ · w_k · (θ'_k − θ_G).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Tuple

from fedcore.aggregate.functions import interpolate
from fedcore.types import MergeHistory, State

UGSA_NORMALIZERS = ("history", "mean", "none")


def ugsa_weight(sigmas: Sequence[float], *, beta: float, normalizer: str) -> float:
    """The gate weight w_k of the newest client from the entropies σ_1..σ_k merged so far.

    ``history`` (the paper's rule): w_k = exp(−β σ_k) / Σ_{j≤k} exp(−β σ_j).
    ``mean``: divides by the mean instead of the sum, so w stays near 1 as k grows.
    ``none``: w_k = exp(−β σ_k).
    """
    if beta < 0:
        raise ValueError(f"UGSA beta must be >= 0, got {beta}")
    if not sigmas:
        raise ValueError("ugsa_weight needs the newest client's sigma")
    scores = [math.exp(-beta * s) for s in sigmas]
    if normalizer == "history":
        return scores[-1] / sum(scores)
    if normalizer == "mean":
        return scores[-1] / (sum(scores) / len(scores))
    if normalizer == "none":
        return scores[-1]
    raise ValueError(f"unknown UGSA normalizer {normalizer!r}; valid names are: {', '.join(UGSA_NORMALIZERS)}")


def ugsa_merge(global_state: State, client_state: State, *, gamma: float, weight: float) -> State:
    """UGSA: θ_G ← θ_G + γ · w_k · (θ'_k − θ_G)."""
    if gamma < 0:
        raise ValueError(f"UGSA gamma must be >= 0, got {gamma}")
    return interpolate(global_state, client_state, rate=gamma * weight)


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
            raise ValueError(
                f"unknown UGSA normalizer {self.normalizer!r}; valid names are: {', '.join(UGSA_NORMALIZERS)}"
            )

    def merge(
        self, global_state: State, client_state: State, *, sigma: float, history: MergeHistory
    ) -> Tuple[State, float]:
        w = ugsa_weight(list(history.sigmas) + [sigma], beta=self.beta, normalizer=self.normalizer)
        return ugsa_merge(global_state, client_state, gamma=self.gamma, weight=w), w
