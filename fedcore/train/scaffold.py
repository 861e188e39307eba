"""SCAFFOLD's client (Karimireddy et al. 2020), option II control variates.

Each gradient is corrected by c − c_i (server and client control variates). After K local
steps with learning rate η the client sets c_i⁺ = c_i − c + (x − y_i) / (K η) (option II) and
sends Δc_i = c_i⁺ − c_i. c_i lives on the server between rounds (``client_state``).
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from fedcore.train.base import TRAINERS, LocalTrainer, State


@TRAINERS.register("scaffold")
class ScaffoldTrainer(LocalTrainer):
    """Local SGD with SCAFFOLD's drift correction; settings as :class:`LocalTrainer`."""

    def begin(self, model: nn.Module, *, global_state: State, broadcast: Dict[str, Any],
              client_state: Dict[str, Any]) -> None:
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
        scale = 1.0 / (max(steps, 1) * self.lr)
        new_ci, delta = {}, {}
        for k, p in model.named_parameters():
            new_ci[k] = (self._ci[k] - self._c[k] + (self._x[k] - p.detach()) * scale).cpu()
            delta[k] = new_ci[k] - self._ci[k].cpu()
        return {"c_i": new_ci}, {"delta_c": delta}
