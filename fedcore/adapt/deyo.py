"""DeYO: destroy your object (Lee et al., ICLR 2024).

Plain form, as the original:

* entropy filter: keep samples with H < deyo_margin (default 0.5·ln C);
* x′ = x with its patch_len × patch_len grid of patches shuffled (default 4 × 4), which
  destroys shape and keeps texture;
* PLPD = p(ŷ | x) − p(ŷ | x′) for the predicted class ŷ; keep samples with PLPD > plpd_threshold (0.2);
* weight = 1/exp(H − E₀) + 1/exp(−PLPD) with E₀ = 0.4·ln C (both detached); loss = mean over kept.

Clip-only form: the plain form with the sum of the kept samples' gradients, each clipped to C,
in place of the gradient of their summed loss (still divided by the count kept).

Private form: every quantity above belongs to one sample, so the filters become 0/1 weights
and the weights are folded into that sample's clipped loss; the batch is divided by |B|.

One difference from the original: x′ is the whole shuffled batch (the original passes only
the entropy-filtered samples), which matters only for BatchNorm's batch statistics; the x′
pass leaves the running statistics untouched.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedcore.adapt.base import GradientMethod, softmax_entropy


def shuffle_patches(x: torch.Tensor, grid: int = 4, generator: torch.Generator | None = None) -> torch.Tensor:
    """Cut each image into a grid × grid set of patches and permute them, independently per image."""
    n, c, h, w = x.shape
    if grid < 1:
        raise ValueError(f"patch grid must be >= 1, got {grid}")
    hh, ww = max(grid, h // grid * grid), max(grid, w // grid * grid)
    y = x if (hh, ww) == (h, w) else F.interpolate(x, size=(hh, ww), mode="bilinear", align_corners=False)
    ph, pw = hh // grid, ww // grid
    patches = y.reshape(n, c, grid, ph, grid, pw).permute(0, 2, 4, 1, 3, 5).reshape(n, grid * grid, c, ph, pw)
    perm = torch.argsort(torch.rand(n, grid * grid, generator=generator, device=x.device), dim=1)
    patches = torch.gather(patches, 1, perm.view(n, -1, 1, 1, 1).expand_as(patches))
    y = patches.reshape(n, grid, grid, c, ph, pw).permute(0, 3, 1, 4, 2, 5).reshape(n, c, hh, ww)
    return y if (hh, ww) == (h, w) else F.interpolate(y, size=(h, w), mode="bilinear", align_corners=False)


class DeYO(GradientMethod):
    def __init__(
        self,
        model,
        optimizer,
        params,
        *,
        num_classes: int,
        deyo_margin_coeff: float = 0.5,
        e_margin_coeff: float = 0.4,
        plpd_threshold: float = 0.2,
        patch_len: int = 4,
        reweight_ent: float = 1.0,
        reweight_plpd: float = 1.0,
        steps: int = 1,
        private=None,
        clip=None,
    ):
        super().__init__(model, optimizer, params, steps=steps, private=private, clip=clip)
        self.deyo_margin = deyo_margin_coeff * math.log(num_classes)
        self.e_margin = e_margin_coeff * math.log(num_classes)
        self.plpd_threshold, self.patch_len = plpd_threshold, int(patch_len)
        self.reweight_ent, self.reweight_plpd = reweight_ent, reweight_plpd
        if self.patch_len < 1:
            raise ValueError(f"patch_len must be >= 1, got {patch_len}")

    @torch.no_grad()
    def aux(self, x, logits):
        h = softmax_entropy(logits)
        probs = logits.softmax(1)
        yhat = probs.argmax(1, keepdim=True)
        # x' must not move the BatchNorm running statistics, so its pass updates copies of them. (Copying
        # saved values back in place would bump the buffers' versions, and the first forward's graph,
        # which saved them for backward, could no longer be differentiated.)
        copies = {k: b.clone() for k, b in self.model.named_buffers()}
        probs_prime = functional_call(self.model, copies, (shuffle_patches(x, self.patch_len),)).softmax(1)
        plpd = (probs.gather(1, yhat) - probs_prime.gather(1, yhat)).squeeze(1)
        keep = (h < self.deyo_margin) & (plpd > self.plpd_threshold)
        weight = self.reweight_ent * torch.exp(-(h - self.e_margin)) + self.reweight_plpd * torch.exp(plpd)
        return {"weight": weight, "mask": keep.float(), "plpd": plpd}

    def sample_loss(self, logits, aux: Mapping[str, torch.Tensor], params) -> torch.Tensor:
        return aux["mask"] * aux["weight"] * softmax_entropy(logits)
