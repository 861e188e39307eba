"""SAR: sharpness-aware and reliable entropy minimisation (Niu et al., ICLR 2023).

Plain form, as the original:

1. reliable entropy: keep samples with H < E₀ = 0.4·ln C; loss = mean H over them;
2. SAM: ε̂ = ρ·g/‖g‖ (ρ = 0.05), move to θ + ε̂, recompute the entropy of the samples kept in
   step 1, keep those still below E₀, and step the base optimizer (SGD, momentum 0.9) from
   θ with the gradient taken at θ + ε̂;
3. model recovery: an EMA (0.9) of the second loss; when it falls below reset_constant
   (0.2) the model and optimizer are reset to what the client received.

Clip-only form (DP-TTA's ablation): all of the above, with each of the two gradients (at θ
and at θ + ε̂) replaced by the sum of the kept samples' gradients, each clipped to C, over the
same count of kept samples.

Private form (DP-TTA): each batch costs one private gradient. The perturbation direction is
the previous batch's private gradient (public, post-processing), so only the gradient at
θ + ε̂ touches this batch; the first batch takes no perturbation. Both entropy filters belong
to one sample and are folded into its clipped loss as 0/1 weights (the first from the
prediction at θ, the second inside the per-sample loss at θ + ε̂). Model recovery reads the
loss of the whole batch, a data-dependent switch with no sensitivity bound, so it is removed.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, Mapping, cast

import torch

from fedcore.adapt.base import GradientMethod, softmax_entropy


class SAR(GradientMethod):
    def __init__(
        self,
        model,
        optimizer,
        params,
        *,
        num_classes: int,
        e_margin_coeff: float = 0.4,
        rho: float = 0.05,
        reset_constant: float = 0.2,
        ema_momentum: float = 0.9,
        steps: int = 1,
        private=None,
        clip=None,
    ):
        super().__init__(model, optimizer, params, steps=steps, private=private, clip=clip)
        if rho < 0:
            raise ValueError(f"SAR rho must be >= 0, got {rho}")
        self.e_margin = e_margin_coeff * math.log(num_classes)
        self.rho, self.reset_constant, self.ema_momentum = rho, reset_constant, ema_momentum
        self.ema: float | None = None
        self.resets = 0
        self._prev: Dict[str, torch.Tensor] | None = None  # previous private gradient (private form)

    def aux(self, x, logits):
        return {"mask": (softmax_entropy(logits) < self.e_margin).float()}

    def sample_loss(self, logits, aux: Mapping[str, torch.Tensor], params) -> torch.Tensor:
        h = softmax_entropy(logits)
        second = (h.detach() < self.e_margin).float()  # the filter at θ + ε̂ (a no-op at θ for kept samples)
        return aux["mask"] * second * h

    @torch.no_grad()
    def _perturb(self, direction: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        norm = torch.sqrt(cast(torch.Tensor, sum((g**2).sum() for g in direction.values())))  # params are non-empty
        scale = self.rho / (norm + 1e-12)
        eps = {k: direction[k] * scale for k in self.params}
        for k, p in self.params.items():
            p.add_(eps[k])
        return eps

    @torch.no_grad()
    def _restore(self, eps: Mapping[str, torch.Tensor]) -> None:
        for k, p in self.params.items():
            p.sub_(eps[k])

    @torch.enable_grad()
    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        if self.private is not None:
            return self._private_sam_step(x)
        hooks = self.clip_by_hooks  # then the forwards run without gradients and hooks give each g_i
        with torch.no_grad() if hooks else contextlib.nullcontext():
            logits = self.model(x)
        aux = self.aux(x, logits.detach())
        kept = float(aux["mask"].sum())
        self.kept += int(kept)
        if kept == 0:
            return logits.detach()
        if self.clip is not None:  # clip-only form: each sample's gradient clipped, at both SAM evaluations
            grads = self._clipped(x, logits, aux["mask"], kept)
        else:
            loss = (softmax_entropy(logits) * aux["mask"]).sum() / kept
            grads = dict(zip(self.params, torch.autograd.grad(loss, list(self.params.values()))))
        eps = self._perturb(grads)
        with torch.no_grad() if hooks else contextlib.nullcontext():
            logits2 = self.model(x)
        h2 = softmax_entropy(logits2)
        mask2 = aux["mask"] * (h2.detach() < self.e_margin).float()
        kept2 = float(mask2.sum())
        if kept2 > 0:
            loss2 = (h2 * mask2).sum() / kept2
            if self.clip is not None:
                for k, g in self._clipped(x, logits2, mask2, kept2).items():
                    self.params[k].grad = g
            else:
                loss2.backward()
            m = self.ema_momentum
            v = float(loss2.detach())
            self.ema = v if self.ema is None else m * self.ema + (1 - m) * v
        self._restore(eps)
        if kept2 > 0:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None and self.ema < self.reset_constant:
            self.reset()
            self.resets += 1
        return logits.detach()

    def _clipped(self, x, logits, mask, kept) -> Dict[str, torch.Tensor]:
        """Σ_i clip(∇ mask_i·H_i) / kept at the current parameters: from ``logits``' graph, or from hooks."""
        if self.clip_by_hooks:
            return self.clip.by_hooks(
                self.model, self.params, lambda lg, _a, _p: softmax_entropy(lg) * mask, x, {}, kept
            )
        return self.clip(softmax_entropy(logits) * mask, self.params, kept)

    def _private_sam_step(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = self.model(x)
            aux = self.aux(x, logits)
        eps = self._perturb(self._prev) if self._prev is not None else None
        grads, _ = self.private(self.sample_loss, x, aux)
        if eps is not None:
            self._restore(eps)
        self._prev = {k: g.detach().clone() for k, g in grads.items()}
        self.apply_gradient(grads)
        return logits

    def reset(self) -> None:
        super().reset()
        self.ema = None
        self._prev = None

    def diagnostics(self):
        return {**super().diagnostics(), "sar_resets": float(self.resets)}
