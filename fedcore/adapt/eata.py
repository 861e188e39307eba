"""EATA: efficient anti-forgetting test-time adaptation (Niu et al., ICML 2022).

Plain form, as the original:

* reliability filter: keep samples with entropy H < E₀ (default E₀ = 0.4·ln C);
* redundancy filter: drop a kept sample whose probability vector has cosine similarity
  ≥ d_margin (in absolute value) to an EMA (0.9) of the mean probability vector of the
  samples kept before; the EMA is updated with the samples that pass both filters;
* weight each kept sample by 1/exp(H − E₀) (detached); loss = mean over kept samples;
* Fisher regulariser fisher_alpha · Σ F·(θ − θ₀)², with F the mean squared gradient of the
  cross-entropy to the model's own predictions on ``fisher_size`` source samples, and θ₀
  the parameters the client received.

Clip-only form (DP-TTA's ablation): the plain form with the gradient of the weighted,
filtered entropies replaced by the sum of the kept samples' gradients, each clipped to C,
over the count of kept samples; the Fisher term's gradient is added unclipped.

Private form: both filters are removed (the redundancy filter couples samples through the
EMA, so no per-sample bound holds; the reliability filter goes with it, as in DP-TTA). The
weight 1/exp(H − E₀) depends on the sample alone and is folded into its clipped loss. The
Fisher term depends only on the parameters and the (server-side) source samples, so it stays,
outside the privacy boundary.
"""

from __future__ import annotations

import copy
import math
from typing import Dict, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from fedcore.adapt.base import GradientMethod, softmax_entropy
from fedcore.registry import signature_defaults
from fedcore.tensors import batches


def fisher_information(
    model: nn.Module, params: Dict[str, nn.Parameter], x: torch.Tensor, *, batch_size: int = 64
) -> Dict[str, torch.Tensor]:
    """Diagonal Fisher of the pseudo-label cross-entropy, averaged over batches (EATA's estimate).

    The model's buffers (BatchNorm running statistics) are restored afterwards: the source
    samples must not leak into the adapted statistics.
    """
    buffers = copy.deepcopy(dict(model.named_buffers()))
    fisher = {k: torch.zeros_like(p) for k, p in params.items()}
    n = 0
    with torch.enable_grad():
        for sl in batches(len(x), batch_size):
            logits = model(x[sl])
            loss = F.cross_entropy(logits, logits.argmax(1).detach())
            grads = torch.autograd.grad(loss, list(params.values()))
            for k, g in zip(params, grads):
                fisher[k] += g.detach() ** 2
            n += 1
    for k, b in model.named_buffers():
        b.copy_(buffers[k])
    return {k: v / max(n, 1) for k, v in fisher.items()}


class EATA(GradientMethod):
    aux_in_loss = True  # the private form's aux is the weight from the sample's own entropy

    @classmethod
    def source_samples(cls, params):
        """The Fisher regulariser's source samples (none when ``fisher_alpha`` is 0)."""
        default = signature_defaults(cls.__init__)
        wanted = float(params.get("fisher_alpha", default["fisher_alpha"])) > 0
        return int(params.get("fisher_size", default["fisher_size"])) if wanted else 0

    def __init__(
        self,
        model,
        optimizer,
        params,
        *,
        num_classes: int,
        e_margin_coeff: float = 0.4,
        d_margin: float = 0.05,
        fisher_alpha: float = 2000.0,
        fisher_size: int = 2000,
        fisher: Dict[str, torch.Tensor] | None = None,
        steps: int = 1,
        private=None,
        clip=None,
    ):
        super().__init__(model, optimizer, params, steps=steps, private=private, clip=clip)
        if not 0 < e_margin_coeff <= 1:
            raise ValueError(f"e_margin_coeff must be in (0, 1], got {e_margin_coeff}")
        if fisher_alpha < 0 or d_margin < 0:
            raise ValueError(f"fisher_alpha and d_margin must be >= 0, got {fisher_alpha}, {d_margin}")
        self.e_margin = e_margin_coeff * math.log(num_classes)
        if fisher_size < 1:
            raise ValueError(f"fisher_size (source samples for the Fisher) must be >= 1, got {fisher_size}")
        self.d_margin, self.fisher_alpha, self.fisher_size = d_margin, fisher_alpha, fisher_size
        self.fisher = fisher
        self.anchor = {k: p.detach().clone() for k, p in params.items()}
        self.mean_probs: torch.Tensor | None = None

    def aux(self, x, logits):
        h = softmax_entropy(logits)  # logits come detached (both forms)
        weight = torch.exp(-(h - self.e_margin))
        if self.private is not None:
            return {"weight": weight}
        keep = h < self.e_margin
        probs = logits.softmax(1)
        if self.mean_probs is not None:
            cos = F.cosine_similarity(self.mean_probs.unsqueeze(0), probs, dim=1)
            keep = keep & (cos.abs() < self.d_margin)
        if keep.any():
            new = probs[keep].mean(0)
            self.mean_probs = new if self.mean_probs is None else 0.9 * self.mean_probs + 0.1 * new
        return {"weight": weight, "mask": keep.float()}

    def sample_loss(self, logits, aux: Mapping[str, torch.Tensor], params) -> torch.Tensor:
        loss = aux["weight"] * softmax_entropy(logits)
        return loss * aux["mask"] if "mask" in aux else loss

    def penalty(self, params):
        if self.fisher is None or self.fisher_alpha == 0:
            return None
        return self.fisher_alpha * sum((self.fisher[k] * (p - self.anchor[k]) ** 2).sum() for k, p in params.items())

    def reset(self) -> None:
        super().reset()
        self.mean_probs = None
