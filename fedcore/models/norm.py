"""The norm layer is a choice. DP methods need GroupNorm or LayerNorm (per-sample sensitivity)."""

from __future__ import annotations

from torch import nn

NORMS = ("batch", "group", "layer")


def make_norm(kind: str, channels: int, *, groups: int = 8) -> nn.Module:
    """A 2-d norm layer over ``channels`` feature maps.

    ``layer`` is LayerNorm over (C, H, W) computed as GroupNorm with one group, which keeps
    it independent of the spatial size; ``group`` uses ``min(groups, channels)`` groups.
    """
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        g = min(groups, channels)
        while channels % g:
            g -= 1
        return nn.GroupNorm(g, channels)
    if kind == "layer":
        return nn.GroupNorm(1, channels)
    raise ValueError(f"unknown norm {kind!r}; valid names are: {', '.join(NORMS)}")


NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)
