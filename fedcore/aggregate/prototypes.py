"""Prototype maths for FedProto and FedPAD, as pure functions.

A prototype set is a dict ``{"classes": (K,) int64, "protos": (K, D) float32, "counts": (K,) int64}``:
one row per class the holder has, none for the classes it lacks.

FedPAD (Zhang, Wan and Long, Neurocomputing 2026), per round t over the participating clients:

* deviation  d_i = Σ_{k ∈ K_i ∩ K_g} ‖p_i^(k) − p_g^(k),t−1‖₂;
* prototype weights θ = softmax(γ d) (the closed form of the entropy-regularised simplex problem);
* model weights α = softmax(−θ / τ); the global model is Σ α_i w_i.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

import torch

from fedcore.aggregate.functions import softmax

Protos = Dict[str, torch.Tensor]

ALPHA_MODES = ("fedpad", "uniform", "direct", "normalized", "sized")
PROTO_WEIGHTINGS = ("theta", "uniform")


def empty_protos() -> Protos:
    return {
        "classes": torch.zeros(0, dtype=torch.long),
        "protos": torch.zeros(0, 0),
        "counts": torch.zeros(0, dtype=torch.long),
    }


def as_table(p: Protos) -> Dict[int, torch.Tensor]:
    return {int(k): p["protos"][i] for i, k in enumerate(p["classes"].tolist())}


def deviation(client: Protos, global_protos: Protos) -> float:
    """d_i: the summed L2 distance to the global prototypes over the classes both have (0 if none)."""
    g = as_table(global_protos)
    return float(
        sum(float(torch.linalg.vector_norm(v.double() - g[k].double())) for k, v in as_table(client).items() if k in g)
    )


def mean_distance(client: Protos, global_protos: Protos) -> float:
    """Mean over the shared classes of ‖p_i^(k) − p_g^(k)‖₂ (nan if none): the paper's Fig. 8 quantity."""
    g = as_table(global_protos)
    shared = [k for k in as_table(client) if k in g]
    return deviation(client, global_protos) / len(shared) if shared else float("nan")


def prototype_weights(deviations: Sequence[float], *, gamma: float) -> List[float]:
    """θ = softmax(γ d): clients further from the global prototypes weigh more in the prototypes."""
    return softmax(deviations, scale=gamma)


def model_weights(
    theta: Sequence[float],
    *,
    tau: float,
    mode: str = "fedpad",
    deviations: Sequence[float] | None = None,
    sizes: Sequence[int] | None = None,
) -> List[float]:
    """α, the model-aggregation weights.

    ``fedpad``: softmax(−θ/τ) (the paper). Ablations: ``uniform`` (α ≡ 1/m); ``direct``:
    softmax(−d/τ) from the raw deviations; ``normalized``: softmax(−(d/Σd)/τ), the
    deviations normalised to sum 1 but without the softmax step to θ. ``sized`` is not in the paper:
    α ∝ n_i·softmax(−θ/τ)_i with ``sizes`` n, FedAvg's example weights tilted by FedPAD's, so that a
    domain's share follows its example count, as FedAvg's does, and not its client count.
    """
    if tau <= 0:
        raise ValueError(f"FedPAD tau must be > 0, got {tau}")
    m = len(theta)
    if mode == "fedpad":
        return softmax(theta, scale=-1.0 / tau)
    if mode == "uniform":
        return [1.0 / m] * m
    if mode == "sized":
        if sizes is None or len(sizes) != m:
            raise ValueError("alpha mode 'sized' needs each client's example count")
        tilted = [n * a for n, a in zip(sizes, softmax(theta, scale=-1.0 / tau))]
        total = sum(tilted)
        return [t / total for t in tilted] if total > 0 else [1.0 / m] * m
    if deviations is None:
        raise ValueError(f"alpha mode {mode!r} needs the deviations")
    if mode == "direct":
        return softmax(deviations, scale=-1.0 / tau)
    if mode == "normalized":
        total = sum(deviations)
        return softmax([d / total if total > 0 else 0.0 for d in deviations], scale=-1.0 / tau)
    raise ValueError(f"unknown alpha mode {mode!r}; valid names are: {', '.join(ALPHA_MODES)}")


def aggregate_prototypes(
    clients: Sequence[Protos], weights: Sequence[float], previous: Protos | None = None, *, by_counts: bool = False
) -> Protos:
    """Class-wise weighted mean of the clients' prototypes.

    For class k the weights of the clients that have k are renormalised to sum 1
    (``by_counts`` multiplies each by the client's count of k, FedProto's rule). A class no
    client has this round keeps its ``previous`` global prototype, so partial participation
    does not erase it.
    """
    sums: Dict[int, torch.Tensor] = {}
    mass: Dict[int, float] = {}
    counts: Dict[int, int] = {}
    for p, w in zip(clients, weights):
        for i, k in enumerate(p["classes"].tolist()):
            wk = float(w) * (float(p["counts"][i]) if by_counts else 1.0)
            sums[k] = sums.get(k, 0) + wk * p["protos"][i].double()
            mass[k] = mass.get(k, 0.0) + wk
            counts[k] = counts.get(k, 0) + int(p["counts"][i])
    table = {k: (sums[k] / mass[k]).float() for k in sums if mass[k] > 0}
    if previous is not None:
        prev = as_table(previous)
        prev_counts = dict(zip(previous["classes"].tolist(), previous["counts"].tolist()))
        for k, v in prev.items():
            if k not in table:
                table[k], counts[k] = v.clone(), int(prev_counts[k])
    if not table:
        return empty_protos()
    classes = sorted(table)
    return {
        "classes": torch.tensor(classes, dtype=torch.long),
        "protos": torch.stack([table[k] for k in classes]),
        "counts": torch.tensor([counts[k] for k in classes], dtype=torch.long),
    }


def l1_change(new: Mapping[int, float], old: Mapping[int, float]) -> float:
    """Σ_i |new_i − old_i| over the union of clients (a missing client counts as 0): ‖α^t − α^{t−1}‖₁."""
    return float(sum(abs(new.get(i, 0.0) - old.get(i, 0.0)) for i in set(new) | set(old)))


def max_change(new: Mapping[int, float], old: Mapping[int, float]) -> float:
    """max_i |new_i − old_i| over the clients in both (nan if none): ‖d^t − d^{t−1}‖_∞."""
    shared = set(new) & set(old)
    return float(max(abs(new[i] - old[i]) for i in shared)) if shared else float("nan")
