"""COME: test-time adaptation by conservatively minimising entropy (Zhang et al., ICLR 2025).

COME replaces the softmax entropy with the entropy of a subjective-logic opinion. The logits
f(x) give Dirichlet evidence e_k = exp(f_k); with prior weight W the opinion is

    b_k = e_k / (Σ_j e_j + W)   (belief masses),     u = W / (Σ_j e_j + W)   (uncertainty mass)

and the loss is the entropy of the (C+1)-vector (b_1, …, b_C, u). Since the opinion is the
softmax of the logits with log W appended, we compute it that way (stable in float32).
Before that the logits are rescaled as f · (‖f‖ / ‖f‖)|detached: the gradient can turn the
logit vector but not lengthen it, the "conservative" constraint that keeps the uncertainty
mass from being driven to zero.

The constant: the paper's Dirichlet has W = C, the number of classes (prior_weight=null,
our default). The official code hard-codes W = 1000, which equals C on ImageNet; set
prior_weight: 1000 to use it on other data.

The update is Tent's with this loss. Private form: the loss is per-sample, nothing else.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from fedcore.adapt.base import GradientMethod


def opinion_entropy(logits: torch.Tensor, prior_weight: float) -> torch.Tensor:
    """Per-sample entropy of the Dirichlet opinion (b, u) of ``logits`` with prior weight W."""
    norm = logits.norm(p=2, dim=-1, keepdim=True)
    f = logits / norm.clamp_min(1e-12) * norm.detach()
    aug = torch.cat([f, torch.full_like(f[:, :1], math.log(prior_weight))], dim=1)
    return -(aug.softmax(1) * aug.log_softmax(1)).sum(1)


class COME(GradientMethod):
    aux_in_loss = True

    def __init__(
        self,
        model,
        optimizer,
        params,
        *,
        num_classes: int,
        prior_weight: float | None = None,
        steps: int = 1,
        private=None,
        clip=None,
    ):
        super().__init__(model, optimizer, params, steps=steps, private=private, clip=clip)
        self.prior_weight = float(num_classes if prior_weight is None else prior_weight)
        if self.prior_weight <= 0:
            raise ValueError(f"COME prior_weight must be > 0, got {prior_weight}")

    def sample_loss(self, logits, aux: Mapping[str, torch.Tensor], params) -> torch.Tensor:
        return opinion_entropy(logits, self.prior_weight)
