"""Network builders; the norm layer (batch / group / layer) is a parameter."""

from __future__ import annotations

from torch import nn

from fedcore.models.cnn import SmallCNN
from fedcore.models.norm import NORMS, make_norm
from fedcore.models.resnet import ResNet20, resnet18_32
from fedcore.registry import Registry

MODELS: Registry[nn.Module] = Registry("model")
MODELS.register("cnn")(SmallCNN)
MODELS.register("resnet20")(ResNet20)
MODELS.register("resnet18")(resnet18_32)


def create_model(name: str, *, in_channels: int, num_classes: int, norm: str = "batch") -> nn.Module:
    """Build a model by name, e.g. ``create_model("cnn", in_channels=1, num_classes=10, norm="group")``."""
    return MODELS.create(name, in_channels=in_channels, num_classes=num_classes, norm=norm)


__all__ = ["create_model", "MODELS", "NORMS", "make_norm", "SmallCNN", "ResNet20", "resnet18_32"]
