"""Round strategies: the server side of synchronous federated training, chosen by name.

A strategy is a thin holder of settings and server state around the pure functions in
:mod:`fedcore.aggregate.functions` and :mod:`fedcore.aggregate.prototypes`:

* ``setup(global_state, num_clients)``: fresh server state for a new run;
* ``broadcast()``: what every selected client receives besides the weights;
* ``aggregate(global_state, updates, num_clients)`` -> :class:`Aggregated`;
* ``state_dict()`` / ``load_state_dict()``: everything it must remember, checkpointed each round.

``trainer`` names the local objective it is written for; the engine refuses other pairings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import torch

from fedcore.aggregate import prototypes as P
from fedcore.aggregate.functions import State, fedadam_step, weighted_average
from fedcore.registry import Registry
from fedcore.train.base import ClientUpdate

Updates = Sequence[Tuple[int, ClientUpdate]]


@dataclass
class Aggregated:
    """A round's server result: the new global weights, round metrics, and per-client diagnostics."""

    state: State
    metrics: Dict[str, float] = field(default_factory=dict)
    per_client: Dict[int, Dict[str, float]] = field(default_factory=dict)


class Strategy:
    """FedAvg: the example-weighted average of the client models (McMahan et al. 2017)."""

    trainer: Tuple[str, ...] = ("sgd", "prox", "proser")  # local objectives this server rule is written for
    needs_model = False  # True: the engine calls bind_model(network) before setup (alignment needs the layers)

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        """Fresh server state; ``param_keys`` are the trainable entries (the rest are buffers)."""
        self.param_keys = list(param_keys)

    def broadcast(self) -> Dict[str, Any]:
        return {}

    def select(self, round_index: int, default: List[int], *, num_clients: int) -> List[int]:
        """The clients of round ``round_index``; ``default`` is the run's seeded sample (or everyone)."""
        return default

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        return Aggregated(weighted_average([(u.state, u.num_examples) for _, u in updates]))

    def discarded(self, updates: Updates) -> Dict[int, Dict[str, float]]:
        """Updates of this round that the engine will not merge (weights with NaN or inf), before
        :meth:`aggregate`: their weights are unusable, but what their sending implies (a privacy budget
        spent) still holds. Returns per-client diagnostics for the round's record (merged into
        ``Aggregated.per_client``, also in a round where every update is discarded). Most servers ignore them."""
        return {}

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass


STRATEGIES: Registry[Strategy] = Registry("strategy")


def create_strategy(name: str, **settings) -> Strategy:
    """A strategy by name, e.g. ``create_strategy("fedpad", gamma=0.1)``; bad names and settings list the valid ones."""
    return STRATEGIES.create(name, **settings)


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
        return Aggregated(out, {"control_norm": float(sum(float((v ** 2).sum()) for v in self.c.values())) ** 0.5})

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
            raise ValueError(f"FedAdam needs lr > 0, tau > 0 and betas in [0, 1); got lr={lr}, tau={tau}, "
                             f"beta1={beta1}, beta2={beta2}")
        self.lr, self.beta1, self.beta2, self.tau = float(lr), float(beta1), float(beta2), float(tau)

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        super().setup(global_state, num_clients=num_clients, param_keys=param_keys)
        self.m = {k: torch.zeros_like(global_state[k]) for k in self.param_keys}
        self.v = {k: torch.zeros_like(global_state[k]) for k in self.param_keys}

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        avg = weighted_average([(u.state, u.num_examples) for _, u in updates])
        out, self.m, self.v = fedadam_step(global_state, avg, m=self.m, v=self.v, keys=self.param_keys, lr=self.lr,
                                           beta1=self.beta1, beta2=self.beta2, tau=self.tau)
        return Aggregated(out)

    def state_dict(self) -> Dict[str, Any]:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.m, self.v = dict(state["m"]), dict(state["v"])


class _PrototypeServer(Strategy):
    trainer = ("proto",)

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        super().setup(global_state, num_clients=num_clients, param_keys=param_keys)
        self.protos = P.empty_protos()

    def broadcast(self) -> Dict[str, Any]:
        return {"prototypes": self.protos}


@STRATEGIES.register("fedproto")
class FedProto(_PrototypeServer):
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


@STRATEGIES.register("fedpad")
class FedPAD(_PrototypeServer):
    """FedPAD: coverage-oriented prototype weights θ, stability-oriented model weights α(θ).

    Parameters
    ----------
    gamma:
        Prototype temperature γ in θ = softmax(γ d). The paper gives no default; ours is
        chosen from the scale of d on our data (see docs/fedpad.md).
    tau:
        Model temperature τ in α = softmax(−θ/τ) (paper default 0.1).
    alpha_mode:
        ``fedpad`` (the paper), or the ablations ``uniform`` (α ≡ 1/m), ``direct`` (d → α),
        ``normalized`` (d/Σd → α).
    proto_weighting:
        ``theta`` (the paper) or ``uniform`` (the "no θ-weighting" ablation).
    """

    def __init__(self, *, gamma: float = 0.01, tau: float = 0.1, alpha_mode: str = "fedpad",
                 proto_weighting: str = "theta") -> None:
        if gamma < 0:
            raise ValueError(f"FedPAD gamma must be >= 0, got {gamma}")
        if tau <= 0:
            raise ValueError(f"FedPAD tau must be > 0, got {tau}")
        if alpha_mode not in P.ALPHA_MODES:
            raise ValueError(f"unknown FedPAD alpha_mode {alpha_mode!r}; valid names are: {', '.join(P.ALPHA_MODES)}")
        if proto_weighting not in P.PROTO_WEIGHTINGS:
            raise ValueError(f"unknown FedPAD proto_weighting {proto_weighting!r}; valid names are: "
                             f"{', '.join(P.PROTO_WEIGHTINGS)}")
        self.gamma, self.tau, self.alpha_mode, self.proto_weighting = float(gamma), float(tau), alpha_mode, \
            proto_weighting

    def setup(self, global_state: State, *, num_clients: int, param_keys: Sequence[str]) -> None:
        super().setup(global_state, num_clients=num_clients, param_keys=param_keys)
        self.last_alpha: Dict[int, float] = {}
        self.last_d: Dict[int, float] = {}

    def aggregate(self, global_state: State, updates: Updates, *, num_clients: int) -> Aggregated:
        ids = [cid for cid, _ in updates]
        client_protos = [u.payload["prototypes"] for _, u in updates]
        d = [P.deviation(p, self.protos) for p in client_protos]
        theta = P.prototype_weights(d, gamma=self.gamma)
        alpha = P.model_weights(theta, tau=self.tau, mode=self.alpha_mode, deviations=d)
        state = weighted_average([(u.state, a) for (_, u), a in zip(updates, alpha)])
        pw = theta if self.proto_weighting == "theta" else [1.0] * len(updates)
        self.protos = P.aggregate_prototypes(client_protos, pw, self.protos)
        alpha_now, d_now = dict(zip(ids, alpha)), dict(zip(ids, d))
        metrics = {"weight_drift": P.l1_change(alpha_now, self.last_alpha) if self.last_alpha else float("nan"),
                   "deviation_change": P.max_change(d_now, self.last_d) if self.last_d else float("nan")}
        self.last_alpha, self.last_d = alpha_now, d_now
        per = {cid: {"alpha": a, "theta": t, "deviation": dv, "proto_dist": P.mean_distance(p, self.protos)}
               for cid, a, t, dv, p in zip(ids, alpha, theta, d, client_protos)}
        return Aggregated(state, metrics, per)

    def state_dict(self) -> Dict[str, Any]:
        return {"protos": self.protos, "last_alpha": dict(self.last_alpha), "last_d": dict(self.last_d)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.protos = dict(state["protos"])
        self.last_alpha = {int(k): float(v) for k, v in state["last_alpha"].items()}
        self.last_d = {int(k): float(v) for k, v in state["last_d"].items()}


# FedPD++ lives in its own module (it brings the open-set alignment); importing it registers "fedpd".
from fedcore.aggregate import fedpd as _fedpd  # noqa: E402,F401
# PP-FCIL's multi-factor weights and Mahalanobis selection; importing it registers "ppfcil".
from fedcore.aggregate import ppfcil as _ppfcil  # noqa: E402,F401
