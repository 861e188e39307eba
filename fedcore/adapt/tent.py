"""Tent: test entropy minimisation over the affine parameters of the norm layers (Wang et al., ICLR 2021)."""

from __future__ import annotations

from typing import Mapping

import torch

from fedcore.adapt.base import GradientMethod, softmax_entropy


class Tent(GradientMethod):
    """One gradient step on the mean prediction entropy per batch.

    Private form: each sample's entropy is its own loss; nothing else is data-dependent.
    """

    aux_in_loss = True

    def sample_loss(self, logits: torch.Tensor, aux: Mapping[str, torch.Tensor], params) -> torch.Tensor:
        return softmax_entropy(logits)
