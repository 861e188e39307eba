"""The baseline round strategies: FedAvg, SCAFFOLD, FedDyn, FedAdam and FedProto.

A strategy is a thin holder of settings and server state around the pure functions in
:mod:`fedcore.aggregate.functions` and :mod:`fedcore.aggregate.prototypes`; what every strategy
offers is :class:`fedcore.aggregate.base.Strategy`. FedPAD, FedPD++ and PP-FCIL have modules of
their own (:mod:`~fedcore.aggregate.fedpad`, :mod:`~fedcore.aggregate.fedpd`,
:mod:`~fedcore.aggregate.ppfcil`); importing :mod:`fedcore.aggregate` registers them all.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch

from fedcore.aggregate import prototypes as P
from fedcore.aggregate.base import STRATEGIES, Aggregated, Strategy, Updates, create_strategy
from fedcore.aggregate.functions import State, fedadam_step, weighted_average

__all__ = [
    "STRATEGIES",
    "Aggregated",
    "Strategy",
    "Updates",
    "create_strategy",
    "FedAvg",
    "Scaffold",
    "FedDyn",
    "FedAdam",
    "PrototypeServer",
    "FedProto",
]


@STRATEGIES.register("fedavg")
class FedAvg(Strategy):
    """FedAvg; with the ``prox`` trainer this is FedProx (its server is FedAvg's)."""


@STRATEGIES.register("scaffold")
class Scaffold(Strategy):
    """SCAFFOLD's server: x ← x + η_g · mean(y_i − x); c ← c + (|S|/N) · mean(Δc_i).

    Parameters
    ----------
    server_lr:
        η_g (1 in the paper's experiments: the new model is the plain mean of the clients').
    """

    trainer = ("scaffold",)

    def __init__(self, *, server_lr: float = 1.0) -> None:
        if server_lr <= 0:
            raise ValueError(f"SCAFFOLD server_lr must be > 0, got {server_lr}")
        self.server_lr = float(server_lr)

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        super().setup(global_state, num_clients=num_clients, param_keys=param_keys)
        self.c = {k: torch.zeros_like(global_state[k]) for k in self.param_keys}

    def broadcast(self) -> Dict[str, Any]:
        return {"c": self.c}

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        mean = weighted_average([(u.state, 1.0) for _, u in updates])
        out = dict(mean)
        for k in self.param_keys:
            out[k] = global_state[k] + self.server_lr * (mean[k] - global_state[k])
            dc = sum(u.payload["delta_c"][k] for _, u in updates) / len(updates)
            self.c[k] = self.c[k] + (len(updates) / num_clients) * dc
        return Aggregated(out, {"control_norm": float(sum(float((v**2).sum()) for v in self.c.values())) ** 0.5})

    def state_dict(self) -> Dict[str, Any]:
        return {"c": self.c}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.c = dict(state["c"])


@STRATEGIES.register("feddyn")
class FedDyn(Strategy):
    """FedDyn's server: h ← h − α/N · Σ_{i∈P}(θ_i − θ); θ ← mean(θ_i) − h/α.

    ``alpha`` must equal the ``feddyn`` trainer's (the engine checks).
    """

    trainer = ("feddyn",)

    def __init__(self, *, alpha: float = 0.01) -> None:
        if alpha <= 0:
            raise ValueError(f"FedDyn alpha must be > 0, got {alpha}")
        self.alpha = float(alpha)

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        super().setup(global_state, num_clients=num_clients, param_keys=param_keys)
        self.h = {k: torch.zeros_like(global_state[k]) for k in self.param_keys}

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        mean = weighted_average([(u.state, 1.0) for _, u in updates])
        out = dict(mean)
        for k in self.param_keys:
            drift = sum(u.state[k] - global_state[k] for _, u in updates)
            self.h[k] = self.h[k] - self.alpha / num_clients * drift
            out[k] = mean[k] - self.h[k] / self.alpha
        return Aggregated(out)

    def state_dict(self) -> Dict[str, Any]:
        return {"h": self.h}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.h = dict(state["h"])


@STRATEGIES.register("fedadam")
class FedAdam(Strategy):
    """FedAdam (Reddi et al. 2021): Adam on the server over the averaged client update.

    Defaults are the FedOpt paper's: β₁ = 0.9, β₂ = 0.99, τ = 1e-3; server ``lr`` η = 0.01
    (the paper tunes η per task over a grid; 10^-2 is within its reported range for FedAdam).
    """

    trainer = ("sgd", "prox")

    def __init__(self, *, lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> None:
        if lr <= 0 or tau <= 0 or not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(
                f"FedAdam needs lr > 0, tau > 0 and betas in [0, 1); got lr={lr}, tau={tau}, "
                f"beta1={beta1}, beta2={beta2}"
            )
        self.lr, self.beta1, self.beta2, self.tau = float(lr), float(beta1), float(beta2), float(tau)

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        super().setup(global_state, num_clients=num_clients, param_keys=param_keys)
        self.m = {k: torch.zeros_like(global_state[k]) for k in self.param_keys}
        self.v = {k: torch.zeros_like(global_state[k]) for k in self.param_keys}

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        avg = weighted_average([(u.state, u.num_examples) for _, u in updates])
        out, self.m, self.v = fedadam_step(
            global_state,
            avg,
            m=self.m,
            v=self.v,
            keys=self.param_keys,
            lr=self.lr,
            beta1=self.beta1,
            beta2=self.beta2,
            tau=self.tau,
        )
        return Aggregated(out)

    def state_dict(self) -> Dict[str, Any]:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.m, self.v = dict(state["m"]), dict(state["v"])


class PrototypeServer(Strategy):
    """A server that keeps global class prototypes and broadcasts them (FedProto, FedPAD)."""

    trainer = ("proto",)

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        super().setup(global_state, num_clients=num_clients, param_keys=param_keys)
        self.protos = P.empty_protos()

    def broadcast(self) -> Dict[str, Any]:
        return {"prototypes": self.protos}


@STRATEGIES.register("fedproto")
class FedProto(PrototypeServer):
    """FedProto (Tan et al. 2022) under one global model: count-weighted class prototypes, FedAvg weights.

    The original keeps a personal model per client and shares prototypes only; here every
    system is judged on one global model per domain, so the weights are averaged as FedAvg
    does. Against FedPAD this isolates the θ/α weighting.
    """

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        client_protos = [u.payload["prototypes"] for _, u in updates]
        self.protos = P.aggregate_prototypes(client_protos, [1.0] * len(updates), self.protos, by_counts=True)
        per = {cid: {"proto_dist": P.mean_distance(p, self.protos)} for (cid, _), p in zip(updates, client_protos)}
        return Aggregated(weighted_average([(u.state, u.num_examples) for _, u in updates]), per_client=per)

    def state_dict(self) -> Dict[str, Any]:
        return {"protos": self.protos}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.protos = dict(state["protos"])
