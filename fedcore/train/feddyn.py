"""FedDyn's client (Acar et al. 2021): a dynamic regulariser that aligns local and global optima.

Local objective: L_i(θ) − ⟨∇L_i(θ_i^{t−1}), θ⟩ + α/2 ‖θ − θ^{t−1}‖². The gradient memory
∇L_i(θ_i^{t−1}) is updated as ∇L_i ← ∇L_i − α (θ_i^t − θ^{t−1}) and lives on the server
between rounds (``client_state``).
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from fedcore.train.base import TRAINERS, LocalTrainer, State


@TRAINERS.register("feddyn")
class FedDynTrainer(LocalTrainer):
    """Parameters: ``alpha`` (> 0), the weight of the dynamic regulariser; the rest as :class:`LocalTrainer`."""

    def __init__(self, *, alpha: float = 0.01, **kw) -> None:
        super().__init__(**kw)
        if alpha <= 0:
            raise ValueError(f"FedDyn alpha must be > 0, got {alpha}")
        self.alpha = float(alpha)

    def begin(
        self, model: nn.Module, *, global_state: State, broadcast: Dict[str, Any], client_state: Dict[str, Any]
    ) -> None:
        self._anchor = {k: p.detach().clone() for k, p in model.named_parameters()}
        grads = client_state.get("grad_memory", {})
        self._h = {k: grads[k].to(p.device) if k in grads else torch.zeros_like(p) for k, p in model.named_parameters()}

    def loss(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        ce = super().loss(model, xb, yb)
        lin = sum((p * self._h[k]).sum() for k, p in model.named_parameters())
        quad = sum(((p - self._anchor[k]) ** 2).sum() for k, p in model.named_parameters())
        return ce - lin + 0.5 * self.alpha * quad

    def finish(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int):
        memory = {
            k: (self._h[k] - self.alpha * (p.detach() - self._anchor[k])).cpu() for k, p in model.named_parameters()
        }
        return {"grad_memory": memory}, {}
