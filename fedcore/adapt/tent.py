"""Tent: test entropy minimisation over the affine parameters of the norm layers (Wang et al., ICLR 2021)."""

from __future__ import annotations

import torch

from fedcore.adapt.base import TTAMethod, softmax_entropy


class Tent(TTAMethod):
    """One gradient step on the mean prediction entropy per batch."""

    @torch.enable_grad()
    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        loss = softmax_entropy(logits).mean(0)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return logits.detach()
