"""BPA: BPFedCTTA's Bayesian-prior adaptation.

MAP over the affine norm parameters θ:

    L(θ) = mean_i H(p_θ(y | x_i)) + ½ (θ − θ_G)ᵀ Σ₀⁻¹ (θ − θ_G),   Σ₀⁻¹ = λ · I

where θ_G is the global model the client received, and the scalar precision λ follows the
global model's mean prediction entropy Ē on this client's data (a running mean over the
batches seen so far, so the method stays streaming). Two precision rules:

* ``confidence`` (default, the behaviour the paper describes): tighten the prior when the
  global model is confident, loosen it when uncertain: λ = (ln C − Ē) / σ₀².
* ``literal`` (the formula as printed): λ = Ē / σ₀², which does the opposite.

Both span the same range [0, ln C / σ₀²], so they are directly comparable.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from fedcore.adapt.base import TTAMethod, collect_norm_params, softmax_entropy

PRECISION_MODES = ("confidence", "literal")


def prior_precision(mean_entropy: float, *, num_classes: int, sigma0: float, mode: str) -> float:
    """The scalar prior precision λ for a mean global entropy ``mean_entropy`` (nats)."""
    if sigma0 <= 0:
        raise ValueError(f"sigma0 must be > 0, got {sigma0}")
    h_max = math.log(num_classes)
    h = min(max(mean_entropy, 0.0), h_max)
    if mode == "confidence":
        return (h_max - h) / sigma0**2
    if mode == "literal":
        return h / sigma0**2
    raise ValueError(f"unknown precision_mode {mode!r}; valid names are: {', '.join(PRECISION_MODES)}")


class BPA(TTAMethod):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, num_classes: int,
                 sigma0: float = 1.0, precision_mode: str = "confidence", steps: int = 1):
        super().__init__(model, optimizer, steps=steps)
        prior_precision(0.0, num_classes=num_classes, sigma0=sigma0, mode=precision_mode)  # validate early
        self.num_classes, self.sigma0, self.precision_mode = num_classes, sigma0, precision_mode
        params, _ = collect_norm_params(model)
        self._params = params
        self._anchor = [p.detach().clone() for p in params]
        self._global = copy.deepcopy(model).eval()  # the received θ_G, frozen, for Ē
        self._global.requires_grad_(False)
        self._entropy_sum, self._entropy_n = 0.0, 0
        self.last_precision = float("nan")

    @torch.no_grad()
    def _update_global_entropy(self, x: torch.Tensor) -> float:
        h = softmax_entropy(self._global(x))
        self._entropy_sum += float(h.sum())
        self._entropy_n += len(h)
        return self._entropy_sum / self._entropy_n

    @torch.enable_grad()
    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        mean_h = self._update_global_entropy(x)
        lam = prior_precision(mean_h, num_classes=self.num_classes, sigma0=self.sigma0, mode=self.precision_mode)
        self.last_precision = lam
        logits = self.model(x)
        prior = sum(((p - a) ** 2).sum() for p, a in zip(self._params, self._anchor))
        loss = softmax_entropy(logits).mean(0) + 0.5 * lam * prior
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return logits.detach()

    def reset(self) -> None:
        super().reset()
        self._entropy_sum, self._entropy_n = 0.0, 0
