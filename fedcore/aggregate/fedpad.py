"""FedPAD (Zhang, Wan and Long, Neurocomputing 2026): prototype-aware weights for domain-imbalanced training.

The server keeps global class prototypes. Each client's deviation d from them sets its prototype
weight θ = softmax(γ d) (coverage) and its model weight α = softmax(−θ/τ) (stability); the
maths are the pure functions in :mod:`fedcore.aggregate.prototypes`.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

from fedcore.aggregate import prototypes as P
from fedcore.aggregate.base import STRATEGIES, Aggregated, Updates
from fedcore.aggregate.functions import State, weighted_average
from fedcore.aggregate.strategies import PrototypeServer


@STRATEGIES.register("fedpad")
class FedPAD(PrototypeServer):
    """FedPAD: coverage-oriented prototype weights θ, stability-oriented model weights α(θ).

    Parameters
    ----------
    gamma:
        Prototype temperature γ in θ = softmax(γ d). The paper gives no default; ours is
        chosen from the scale of d on our data (see docs/systems/fedpad.md).
    tau:
        Model temperature τ in α = softmax(−θ/τ) (paper default 0.1).
    alpha_mode:
        ``fedpad`` (the paper), or the ablations ``uniform`` (α ≡ 1/m), ``direct`` (d → α),
        ``normalized`` (d/Σd → α); ``sized`` (α ∝ n·softmax(−θ/τ)) is a variant of ours, not the paper's.
    proto_weighting:
        ``theta`` (the paper) or ``uniform`` (the "no θ-weighting" ablation).
    """

    client_weighting = "alpha"  # the per-client metric of each round's record that holds a client's weight

    def __init__(
        self, *, gamma: float = 0.01, tau: float = 0.1, alpha_mode: str = "fedpad", proto_weighting: str = "theta"
    ) -> None:
        if gamma < 0:
            raise ValueError(f"FedPAD gamma must be >= 0, got {gamma}")
        if tau <= 0:
            raise ValueError(f"FedPAD tau must be > 0, got {tau}")
        if alpha_mode not in P.ALPHA_MODES:
            raise ValueError(f"unknown FedPAD alpha_mode {alpha_mode!r}; valid names are: {', '.join(P.ALPHA_MODES)}")
        if proto_weighting not in P.PROTO_WEIGHTINGS:
            raise ValueError(
                f"unknown FedPAD proto_weighting {proto_weighting!r}; valid names are: {', '.join(P.PROTO_WEIGHTINGS)}"
            )
        self.gamma, self.tau, self.alpha_mode, self.proto_weighting = (
            float(gamma),
            float(tau),
            alpha_mode,
            proto_weighting,
        )

    @property
    def weighting_label(self) -> str:
        return {"fedpad": "α(θ)", "uniform": "1/m", "direct": "α(d)", "normalized": "α(d/Σd)", "sized": "n·α(θ)"}[
            self.alpha_mode
        ]

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        super().setup(global_state, num_clients=num_clients, param_keys=param_keys)
        self.last_alpha: Dict[int, float] = {}
        self.last_d: Dict[int, float] = {}

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        ids = [cid for cid, _ in updates]
        client_protos = [u.payload["prototypes"] for _, u in updates]
        d = [P.deviation(p, self.protos) for p in client_protos]
        theta = P.prototype_weights(d, gamma=self.gamma)
        sizes = [u.num_examples for _, u in updates]
        alpha = P.model_weights(theta, tau=self.tau, mode=self.alpha_mode, deviations=d, sizes=sizes)
        state = weighted_average([(u.state, a) for (_, u), a in zip(updates, alpha)])
        pw = theta if self.proto_weighting == "theta" else [1.0] * len(updates)
        self.protos = P.aggregate_prototypes(client_protos, pw, self.protos)
        alpha_now, d_now = dict(zip(ids, alpha)), dict(zip(ids, d))
        metrics = {
            "weight_drift": P.l1_change(alpha_now, self.last_alpha) if self.last_alpha else float("nan"),
            "deviation_change": P.max_change(d_now, self.last_d) if self.last_d else float("nan"),
        }
        self.last_alpha, self.last_d = alpha_now, d_now
        per = {
            cid: {"alpha": a, "theta": t, "deviation": dv, "proto_dist": P.mean_distance(p, self.protos)}
            for cid, a, t, dv, p in zip(ids, alpha, theta, d, client_protos)
        }
        return Aggregated(state, metrics, per)

    def state_dict(self) -> Dict[str, Any]:
        return {"protos": self.protos, "last_alpha": dict(self.last_alpha), "last_d": dict(self.last_d)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.protos = dict(state["protos"])
        self.last_alpha = {int(k): float(v) for k, v in state["last_alpha"].items()}
        self.last_d = {int(k): float(v) for k, v in state["last_d"].items()}
