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
from fedcore.aggregate.base import (
    STRATEGIES,
    Aggregated,
    Fold,
    FoldingStrategy,
    Strategy,
    Updates,
    create_strategy,
)
from fedcore.aggregate.functions import State, WeightedSum, fedadam_step, weighted_average
from fedcore.registry import check_choice
from fedcore.types import ClientUpdate

WEIGHTINGS = ("examples", "clients")  # FedAvg's client weights: by example count, or each client alike

__all__ = [
    "STRATEGIES",
    "Aggregated",
    "Strategy",
    "Updates",
    "Fold",
    "FoldingStrategy",
    "create_strategy",
    "FedAvg",
    "Scaffold",
    "FedDyn",
    "FedAdam",
    "PrototypeServer",
    "FedProto",
]


@STRATEGIES.register("fedavg")
class FedAvg(FoldingStrategy):
    """FedAvg; with the ``prox`` trainer this is FedProx (its server is FedAvg's).

    ``weighting``: ``examples`` (McMahan et al.: each client by its example count) or ``clients`` (each
    client alike, as SCAFFOLD's and FedDyn's servers weigh them and as FedPAD's α starts).

    Its average is folded in as updates arrive (:class:`fedcore.aggregate.functions.WeightedSum`),
    as are SCAFFOLD's, FedDyn's and FedAdam's: the server holds a few model-sized sums, not the round.
    """

    client_weighting = "examples"

    def __init__(self, *, weighting: str = "examples") -> None:
        self.client_weighting = check_choice("weighting", weighting, WEIGHTINGS)

    def new_fold(self, global_state: State, *, sizes: Sequence[int], num_clients: int) -> Fold:
        equal = self.client_weighting == "clients"
        total = float(len(sizes) if equal else sum(sizes))
        return _AverageFold(self, global_state, num_clients=num_clients, total=total, equal=equal)


class _AverageFold(Fold):
    """The example-weighted mean of the client models, one model at a time (``equal``: each client weighs 1)."""

    def __init__(
        self, strategy: Strategy, global_state: State, *, num_clients: int, total: float, equal: bool = False
    ) -> None:
        super().__init__(strategy, global_state, num_clients=num_clients)
        self.mean = WeightedSum(total if total > 0 else 1.0)
        self.equal = equal

    def add(self, client: int, update: ClientUpdate) -> None:
        self.mean.add(update.state, 1.0 if self.equal else update.num_examples)

    def finish(self) -> Aggregated:
        return Aggregated(self.mean.result())


@STRATEGIES.register("scaffold")
class Scaffold(FoldingStrategy):
    """SCAFFOLD's server: x ← x + η_g · mean(y_i − x); c ← c + (|S|/N) · mean(Δc_i).

    Parameters
    ----------
    server_lr:
        η_g (1 in the paper's experiments: the new model is the plain mean of the clients').
    """

    client_weighting = "clients"

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

    def new_fold(self, global_state: State, *, sizes: Sequence[int], num_clients: int) -> Fold:
        return _ScaffoldFold(self, global_state, num_clients=num_clients, total=float(len(sizes)), equal=True)

    def state_dict(self) -> Dict[str, Any]:
        return {"c": self.c}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.c = dict(state["c"])


class _ScaffoldFold(_AverageFold):
    strategy: Scaffold

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delta_c: Dict[str, Any] = {k: 0 for k in self.strategy.param_keys}  # Σ Δc_i, summed in client order

    def add(self, client: int, update: ClientUpdate) -> None:
        super().add(client, update)
        for k in self.delta_c:
            self.delta_c[k] = self.delta_c[k] + update.payload["delta_c"][k]

    def finish(self) -> Aggregated:
        s, g, n = self.strategy, self.global_state, self.mean.count
        mean = self.mean.result()
        out = dict(mean)
        for k in s.param_keys:
            out[k] = g[k] + s.server_lr * (mean[k] - g[k])
            s.c[k] = s.c[k] + (n / self.num_clients) * (self.delta_c[k] / n)
        return Aggregated(out, {"control_norm": float(sum(float((v**2).sum()) for v in s.c.values())) ** 0.5})


@STRATEGIES.register("feddyn")
class FedDyn(FoldingStrategy):
    """FedDyn's server: h ← h − α/N · Σ_{i∈P}(θ_i − θ); θ ← mean(θ_i) − h/α.

    ``alpha`` must equal the ``feddyn`` trainer's (the engine checks).
    """

    client_weighting = "clients"

    trainer = ("feddyn",)

    def __init__(self, *, alpha: float = 0.01) -> None:
        if alpha <= 0:
            raise ValueError(f"FedDyn alpha must be > 0, got {alpha}")
        self.alpha = float(alpha)

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        super().setup(global_state, num_clients=num_clients, param_keys=param_keys)
        self.h = {k: torch.zeros_like(global_state[k]) for k in self.param_keys}

    def new_fold(self, global_state: State, *, sizes: Sequence[int], num_clients: int) -> Fold:
        return _FedDynFold(self, global_state, num_clients=num_clients, total=float(len(sizes)), equal=True)

    def state_dict(self) -> Dict[str, Any]:
        return {"h": self.h}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.h = dict(state["h"])


class _FedDynFold(_AverageFold):
    strategy: FedDyn

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drift: Dict[str, Any] = {k: 0 for k in self.strategy.param_keys}  # Σ (θ_i − θ), in client order

    def add(self, client: int, update: ClientUpdate) -> None:
        super().add(client, update)
        for k in self.drift:
            self.drift[k] = self.drift[k] + (update.state[k] - self.global_state[k])

    def finish(self) -> Aggregated:
        s = self.strategy
        out = dict(self.mean.result())
        for k in s.param_keys:
            s.h[k] = s.h[k] - s.alpha / self.num_clients * self.drift[k]
            out[k] = out[k] - s.h[k] / s.alpha
        return Aggregated(out)


@STRATEGIES.register("fedadam")
class FedAdam(FoldingStrategy):
    """FedAdam (Reddi et al. 2021): Adam on the server over the averaged client update.

    Defaults are the FedOpt paper's: β₁ = 0.9, β₂ = 0.99, τ = 1e-3; server ``lr`` η = 0.01
    (the paper tunes η per task over a grid; 10^-2 is within its reported range for FedAdam).
    """

    client_weighting = "examples"

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

    def new_fold(self, global_state: State, *, sizes: Sequence[int], num_clients: int) -> Fold:
        return _FedAdamFold(self, global_state, num_clients=num_clients, total=float(sum(sizes)))

    def state_dict(self) -> Dict[str, Any]:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.m, self.v = dict(state["m"]), dict(state["v"])


class _FedAdamFold(_AverageFold):
    strategy: FedAdam

    def finish(self) -> Aggregated:
        s = self.strategy
        out, s.m, s.v = fedadam_step(
            self.global_state,
            self.mean.result(),
            m=s.m,
            v=s.v,
            keys=s.param_keys,
            lr=s.lr,
            beta1=s.beta1,
            beta2=s.beta2,
            tau=s.tau,
        )
        return Aggregated(out)


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

    client_weighting = "examples"

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        client_protos = [u.payload["prototypes"] for _, u in updates]
        self.protos = P.aggregate_prototypes(client_protos, [1.0] * len(updates), self.protos, by_counts=True)
        per = {cid: {"proto_dist": P.mean_distance(p, self.protos)} for (cid, _), p in zip(updates, client_protos)}
        return Aggregated(weighted_average([(u.state, u.num_examples) for _, u in updates]), per_client=per)

    def state_dict(self) -> Dict[str, Any]:
        return {"protos": self.protos}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.protos = dict(state["protos"])
