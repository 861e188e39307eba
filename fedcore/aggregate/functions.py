"""Server-side rules as pure functions of state dicts.

A model is a ``dict[str, Tensor]`` (a ``state_dict``). Nothing here mutates its inputs.

Norm-layer buffers: floating-point buffers (BatchNorm running mean and variance) are merged
by exactly the same rule as parameters, so the global model's statistics move with its
affine parameters. Integer buffers (``num_batches_tracked``) are counters, not estimates:
they are taken from the newest model rather than averaged.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch

from fedcore.types import State


def _is_mergeable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def weighted_average(updates: Sequence[Tuple[State, float]]) -> State:
    """FedAvg: the average of states weighted by (e.g.) example counts.

    Parameters
    ----------
    updates:
        ``[(state, weight), ...]`` with weights >= 0 and a positive total.
    """
    if not updates:
        raise ValueError("weighted_average needs at least one update")
    total = float(sum(w for _, w in updates))
    if total <= 0 or any(w < 0 for _, w in updates):
        raise ValueError(f"weights must be >= 0 with a positive sum, got {[w for _, w in updates]}")
    acc = WeightedSum(total)
    for state, w in updates:
        acc.add(state, w)
    return acc.result()


class WeightedSum:
    """:func:`weighted_average` taken one state at a time, for a server that must not hold a round's updates.

    Each state adds ``s · (w / total)`` in float64, in the order added, so when the weights
    added sum to ``total`` the result is the whole-list average bit for bit. When they sum to
    something else (the server dropped an update it expected), the sum is rescaled once at the
    end: the same average up to float64 rounding.
    """

    def __init__(self, total: float) -> None:
        if not total > 0:
            raise ValueError(f"the expected total weight must be > 0, got {total}")
        self.total = float(total)
        self.seen = 0.0  # the weights added so far
        self.count = 0
        self._keys: List[str] = []
        self._acc: Dict[str, torch.Tensor] = {}
        self._dtype: Dict[str, torch.dtype] = {}
        self._newest: State = {}  # integer buffers: the newest state's

    def add(self, state: State, weight: float) -> None:
        if weight < 0:
            raise ValueError(f"weights must be >= 0, got {weight}")
        if not self._keys:
            self._keys = list(state)
        rate = weight / self.total
        for key, t in state.items():
            if _is_mergeable(t):
                if key not in self._acc:
                    self._acc[key] = torch.zeros_like(t, dtype=torch.float64)
                    self._dtype[key] = t.dtype
                self._acc[key] += t.to(torch.float64) * rate
            else:
                self._newest[key] = t
        self.seen += weight
        self.count += 1

    def result(self) -> State:
        if not self.count or self.seen <= 0:
            raise ValueError(f"an average needs weights with a positive sum; {self.count} added, sum {self.seen}")
        scale = self.total / self.seen
        out: State = {}
        for key in self._keys:
            if key in self._acc:
                acc = self._acc[key] if scale == 1.0 else self._acc[key] * scale
                out[key] = acc.to(self._dtype[key])
            else:
                out[key] = self._newest[key].clone()
        return out


def interpolate(global_state: State, client_state: State, *, rate: float) -> State:
    """θ_G + rate · (θ_client − θ_G): the step every sequential rule here is made of."""
    if not math.isfinite(rate):
        raise ValueError(f"merge rate must be finite, got {rate}")
    out: State = {}
    for key, g in global_state.items():
        c = client_state[key]
        out[key] = g + rate * (c - g) if _is_mergeable(g) else c.clone()
    return out


def running_average_merge(global_state: State, client_state: State, *, count: int) -> State:
    """Equal-weight running average: with ``count`` models already averaged, add one more."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    return interpolate(global_state, client_state, rate=1.0 / (count + 1))


def l2_distance(a: State, b: State, keys: List[str] | None = None) -> float:
    """‖a − b‖₂ over ``keys`` (default: every floating-point entry)."""
    keys = keys if keys is not None else [k for k, v in a.items() if _is_mergeable(v)]
    sq = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in keys)
    return math.sqrt(sq)


def param_delta(new: State, old: State, keys: Sequence[str]) -> State:
    """new − old over ``keys`` (float64 would be overkill: the states are float32)."""
    return {k: new[k] - old[k] for k in keys}


def fedadam_step(
    global_state: State,
    average: State,
    *,
    m: State,
    v: State,
    keys: Sequence[str],
    lr: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> Tuple[State, State, State]:
    """FedAdam (Reddi et al. 2021, Algorithm 2) on the pseudo-gradient Δ = average − global.

    m ← β₁m + (1−β₁)Δ; v ← β₂v + (1−β₂)Δ²; x ← x + η · m / (√v + τ). No bias correction,
    as in the paper. Entries outside ``keys`` (norm-layer buffers) take the average.

    Returns
    -------
    (new global state, new m, new v)
    """
    out: State = {k: t.clone() for k, t in average.items()}
    new_m, new_v = {}, {}
    for k in keys:
        delta = average[k] - global_state[k]
        new_m[k] = beta1 * m[k] + (1 - beta1) * delta
        new_v[k] = beta2 * v[k] + (1 - beta2) * delta * delta
        out[k] = global_state[k] + lr * new_m[k] / (new_v[k].sqrt() + tau)
    return out, new_m, new_v


def softmax(scores: Sequence[float], *, scale: float = 1.0) -> List[float]:
    """softmax(scale · scores), computed stably in float64."""
    if not scores:
        return []
    z = [scale * float(s) for s in scores]
    top = max(z)
    e = [math.exp(v - top) for v in z]
    total = sum(e)
    return [v / total for v in e]
