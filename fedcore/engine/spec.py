"""What a worker needs to rebuild the network, and the seeded initial weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedcore.aggregate.functions import State
from fedcore.models import create_model
from fedcore.tensors import state_to_cpu


@dataclass(frozen=True)
class ModelSpec:
    """Enough to rebuild the network on any worker."""

    name: str
    in_channels: int
    num_classes: int
    norm: str = "batch"

    def build(self) -> nn.Module:
        return create_model(self.name, in_channels=self.in_channels, num_classes=self.num_classes, norm=self.norm)


def init_state(spec: ModelSpec, seed: int) -> State:
    """The network's initial weights under ``torch.manual_seed(seed)``, on the CPU."""
    torch.manual_seed(seed)
    return state_to_cpu(spec.build().state_dict())
