"""FedProx's client (Li et al. 2020): cross-entropy plus μ/2 · ‖w − w_global‖²."""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from fedcore.train.base import TRAINERS, LocalTrainer, State


@TRAINERS.register("prox")
class ProxTrainer(LocalTrainer):
    """Local SGD with a proximal term that keeps the client near the model it received.

    Parameters
    ----------
    mu:
        Weight of the proximal term (μ >= 0; μ = 0 is FedAvg's client).
    """

    def __init__(self, *, mu: float = 0.01, **kw) -> None:
        super().__init__(**kw)
        if mu < 0:
            raise ValueError(f"FedProx mu must be >= 0, got {mu}")
        self.mu = float(mu)

    def begin(
        self, model: nn.Module, *, global_state: State, broadcast: Dict[str, Any], client_state: Dict[str, Any]
    ) -> None:
        self._anchor = {k: p.detach().clone() for k, p in model.named_parameters()}

    def loss(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        ce = super().loss(model, xb, yb)
        prox = sum(((p - self._anchor[k]) ** 2).sum() for k, p in model.named_parameters())
        return ce + 0.5 * self.mu * prox
