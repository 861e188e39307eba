"""SCAFFOLD's client (Karimireddy et al. 2020), option II control variates.

Each gradient is corrected by c − c_i (server and client control variates). After K local
steps with learning rate η the client sets c_i⁺ = c_i − c + (x − y_i) / (K η) (option II) and
sends Δc_i = c_i⁺ − c_i. c_i lives on the server between rounds (``client_state``).

Option II assumes plain SGD, where K steps of a constant gradient g move the weights by Kηg.
With heavy-ball momentum β (torch's SGD, a fresh buffer each round) they move by K_eff·η·g,
K_eff = Σ_{t=1}^{K} (1 − β^t)/(1 − β), so we divide by K_eff instead of K; with β = 0 this is
the paper's rule. Dividing by K would inflate c_i by up to 1/(1 − β) = 10× at β = 0.9.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from fedcore.train.base import TRAINERS, LocalTrainer, State


def effective_steps(steps: int, momentum: float) -> float:
    """K_eff: how many plain-SGD steps ``steps`` heavy-ball steps amount to for a constant gradient."""
    if steps < 1:
        return 1.0
    if momentum == 0:
        return float(steps)
    b = momentum
    return (steps - b * (1 - b**steps) / (1 - b)) / (1 - b)


@TRAINERS.register("scaffold")
class ScaffoldTrainer(LocalTrainer):
    """Local SGD with SCAFFOLD's drift correction; settings as :class:`LocalTrainer`."""

    constant_lr_because = "SCAFFOLD's control variates divide by the lr"

    def begin(
        self, model: nn.Module, *, global_state: State, broadcast: Dict[str, Any], client_state: Dict[str, Any]
    ) -> None:
        names = [k for k, _ in model.named_parameters()]
        zeros = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
        self._c = {k: broadcast.get("c", zeros)[k].to(zeros[k].device) for k in names}
        self._ci = {k: client_state.get("c_i", zeros)[k].to(zeros[k].device) for k in names}
        self._x = {k: p.detach().clone() for k, p in model.named_parameters()}

    def after_backward(self, model: nn.Module) -> None:
        for k, p in model.named_parameters():
            if p.grad is not None:
                p.grad.add_(self._c[k] - self._ci[k])

    def finish(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int):
        scale = 1.0 / (effective_steps(steps, self.momentum) * self.lr)
        new_ci, delta = {}, {}
        for k, p in model.named_parameters():
            new_ci[k] = (self._ci[k] - self._c[k] + (self._x[k] - p.detach()) * scale).cpu()
            delta[k] = new_ci[k] - self._ci[k].cpu()
        return {"c_i": new_ci}, {"delta_c": delta}
