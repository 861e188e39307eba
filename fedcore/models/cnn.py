"""A small CNN for greyscale digits (28x28 MNIST, 16x16 sklearn digits)."""

from __future__ import annotations

import torch
from torch import nn

from fedcore.models.norm import make_norm


class SmallCNN(nn.Module):
    """conv(32)-norm-relu-pool, conv(64)-norm-relu-pool, global average pool, linear.

    Global pooling makes the network indifferent to the input size.
    """

    def __init__(self, *, in_channels: int = 1, num_classes: int = 10, norm: str = "batch", width: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            make_norm(norm, width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            make_norm(norm, 2 * width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False),
            make_norm(norm, 2 * width),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(2 * width, num_classes)

    # PROSER mixes features after the second conv block; the layers run in registration order
    # with no skips, so optimal-transport alignment can follow them (fedcore.openset.align).
    mix_at = 8
    sequential = True

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features (N, 2·width): what prototype methods average per class."""
        return torch.flatten(self.features(x), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embed(x))


class LeNet(nn.Module):
    """conv5(32)-norm-relu-pool, conv5(64)-norm-relu-pool, pool to 4x4, fc(64)-relu, fc.

    About 118k parameters on greyscale input (120k on colour): the "small CNN" of the
    round-based benchmarks. Unlike :class:`SmallCNN` it keeps spatial layout up to the
    classifier, which makes it learn digits in a few rounds. Features are the 64-d fc output.
    """

    def __init__(self, *, in_channels: int = 1, num_classes: int = 10, norm: str = "batch", feature_dim: int = 64):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, bias=False),
            make_norm(norm, 32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, bias=False),
            make_norm(norm, 64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(64 * 16, feature_dim),
            nn.ReLU(inplace=True),
        )
        self.fc = nn.Linear(feature_dim, num_classes)

    mix_at = 8  # after the second conv block (before pooling to 4x4): where PROSER mixes
    sequential = True

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features (N, feature_dim)."""
        return self.features(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embed(x))
