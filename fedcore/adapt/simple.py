"""The two reference points: no adaptation, and test-time BatchNorm statistics."""

from __future__ import annotations

import torch

from fedcore.adapt.base import TTAMethod


class Source(TTAMethod):
    """The global model as it is, in eval mode."""

    @torch.no_grad()
    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class BatchNormAdapt(TTAMethod):
    """Normalise with test-batch statistics (Schneider et al. 2020; Nado et al. 2020).

    Running statistics are updated with the layer's momentum so the adapted statistics can be
    merged by the server. On a model without BatchNorm this is the same as ``source``.
    """

    @torch.no_grad()
    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)
