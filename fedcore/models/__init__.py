"""Network builders by name; the norm layer (batch / group / layer) is a parameter.

``create_model("lenet", in_channels=3, num_classes=10, norm="group")``; ``MODELS.names()`` lists them,
``dual-<backbone>`` included (PP-FCIL's dual model, :mod:`fedcore.models.dual`).
"""

from __future__ import annotations

from torch import nn

from fedcore.models.base import MODELS, check_feature_layer, create_model, embed_and_classify, mix_split
from fedcore.models.cnn import LeNet, SmallCNN
from fedcore.models.dual import DualNet
from fedcore.models.norm import NORMS, make_norm
from fedcore.models.resnet import ResNet20, resnet18_32


def _dual(base: str):
    def build(*, in_channels: int, num_classes: int, norm: str = "batch") -> nn.Module:
        return DualNet(backbone=base, in_channels=in_channels, num_classes=num_classes, norm=norm)

    build.__doc__ = f"PP-FCIL's dual model (fedcore.models.dual.DualNet) over the {base!r} backbone."
    return build


for _base in ("cnn", "lenet", "resnet20", "resnet18"):
    MODELS.register(f"dual-{_base}")(_dual(_base))


__all__ = [
    "embed_and_classify",
    "mix_split",
    "check_feature_layer",
    "create_model",
    "MODELS",
    "NORMS",
    "make_norm",
    "SmallCNN",
    "LeNet",
    "ResNet20",
    "resnet18_32",
    "DualNet",
]
