"""BPA: BPFedCTTA's Bayesian-prior adaptation.

MAP over the affine norm parameters θ:

    L(θ) = mean_i H(p_θ(y | x_i)) + ½ (θ − θ_G)ᵀ Σ₀⁻¹ (θ − θ_G),   Σ₀⁻¹ = λ · I

where θ_G is the global model the client received, and the scalar precision λ follows the
global model's mean prediction entropy Ē on this client's data (scored as the client predicts:
BatchNorm with batch statistics) (a running mean over the
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

from fedcore.adapt.base import GradientMethod, collect_norm_params, softmax_entropy
from fedcore.evaluate.metrics import batch_statistics

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


class BPA(GradientMethod):
    """Clip-only form: the plain form (running-mean λ, the prior outside the clip) with the
    entropies' gradient replaced by the sum of per-sample gradients, each clipped to C.

    Private form: the precision becomes per-sample, λ_i from the global model's entropy on
    x_i alone, and the prior term ½·λ_i·‖θ − θ_G‖² joins that sample's clipped loss (its batch
    mean is the plain form's prior with the batch's mean entropy). A running mean over
    batches would couple every later update to every earlier sample, with no sensitivity bound.
    """

    direct_param_terms = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        params=None,
        *,
        num_classes: int,
        sigma0: float = 1.0,
        precision_mode: str = "confidence",
        steps: int = 1,
        private=None,
        clip=None,
    ):
        prior_precision(0.0, num_classes=num_classes, sigma0=sigma0, mode=precision_mode)  # validate early
        if params is None:
            norm_params, names = collect_norm_params(model)
            params = dict(zip(names, norm_params))
        super().__init__(model, optimizer, params, steps=steps, private=private, clip=clip)
        self.num_classes, self.sigma0, self.precision_mode = num_classes, sigma0, precision_mode
        self._anchor = {k: p.detach().clone() for k, p in params.items()}
        # The received θ_G, frozen, for Ē. It is scored as the client predicts: BatchNorm with
        # the batch's statistics. In eval mode (the source statistics) a model on a shifted
        # domain is often confidently wrong, and λ would tighten the prior where θ_G is worst.
        self._global = copy.deepcopy(model)
        self._global.requires_grad_(False)
        self._entropy_sum, self._entropy_n = 0.0, 0
        self.last_precision = float("nan")

    def _prior(self, params) -> torch.Tensor:
        return sum(((p - self._anchor[k]) ** 2).sum() for k, p in params.items())

    @torch.no_grad()
    def aux(self, x, logits):
        with batch_statistics(self._global):
            h = softmax_entropy(self._global(x))
        if self.private is not None:
            lam = (
                (math.log(self.num_classes) - h.clamp(0, math.log(self.num_classes)))
                if self.precision_mode == "confidence"
                else h.clamp(0, math.log(self.num_classes))
            ) / self.sigma0**2
            self.last_precision = float(lam.mean())
            return {"lam": lam}
        self._entropy_sum += float(h.sum())
        self._entropy_n += len(h)
        self.last_precision = prior_precision(
            self._entropy_sum / self._entropy_n,
            num_classes=self.num_classes,
            sigma0=self.sigma0,
            mode=self.precision_mode,
        )
        return {}

    def sample_loss(self, logits, aux, params) -> torch.Tensor:
        loss = softmax_entropy(logits)
        if "lam" in aux:
            loss = loss + 0.5 * aux["lam"] * self._prior(params)
        return loss

    def penalty(self, params):
        return None if self.private is not None else 0.5 * self.last_precision * self._prior(params)

    def diagnostics(self):
        return {**super().diagnostics(), "prior_precision": float(self.last_precision)}

    def reset(self) -> None:
        super().reset()
        self._entropy_sum, self._entropy_n = 0.0, 0
