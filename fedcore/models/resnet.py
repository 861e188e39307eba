"""CIFAR-style ResNets: ResNet-20 (He et al. 2016, 3x3 stages of 16/32/64) and resnet18 at 32x32."""

from __future__ import annotations

import torch
from torch import nn

from fedcore.models.norm import make_norm


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = make_norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = make_norm(norm, cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), make_norm(norm, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    def __init__(self, *, in_channels: int = 3, num_classes: int = 10, norm: str = "batch", depth: int = 20):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 (20, 32, 44, ...), got {depth}")
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.bn1 = make_norm(norm, 16)
        self.relu = nn.ReLU(inplace=True)
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                layers.append(BasicBlock(cin, cout, stride if i == 0 else 1, norm))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features (N, 64)."""
        x = self.layers(self.relu(self.bn1(self.conv1(x))))
        return torch.flatten(self.pool(x), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embed(x))

    mixable = True

    def mix_parts(self):
        """PROSER's mixing point: after the second of the three stages, ``(pre, post)`` with
        ``post(pre(x)) == self(x)``."""
        k = 2 * len(self.layers) // 3
        pre = nn.Sequential(self.conv1, self.bn1, self.relu, self.layers[:k])

        def post(h: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.flatten(self.pool(self.layers[k:](h)), 1))

        return pre, post


def resnet18_32(*, in_channels: int = 3, num_classes: int = 10, norm: str = "batch") -> nn.Module:
    """torchvision's resnet18 with a 3x3 stem and no max-pool, the usual 32x32 adaptation."""
    from torchvision.models import ResNet
    from torchvision.models.resnet import BasicBlock as TVBlock

    class ResNet18(ResNet):
        def embed(self, x: torch.Tensor) -> torch.Tensor:
            """Penultimate features (N, 512)."""
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return torch.flatten(self.avgpool(x), 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.embed(x))

        def mix_parts(self):
            """PROSER's mixing point: after ``layer2``, ``(pre, post)`` with ``post(pre(x)) == self(x)``."""
            pre = nn.Sequential(self.conv1, self.bn1, self.relu, self.maxpool, self.layer1, self.layer2)

            def post(h: torch.Tensor) -> torch.Tensor:
                return self.fc(torch.flatten(self.avgpool(self.layer4(self.layer3(h))), 1))

            return pre, post

    model = ResNet18(TVBlock, [2, 2, 2, 2], num_classes=num_classes, norm_layer=lambda c: make_norm(norm, c))
    model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


# builds a model with mix_parts (PROSER can mix in it)
resnet18_32.mixable = True  # type: ignore[attr-defined]  # mypy cannot type an attribute set on a function
