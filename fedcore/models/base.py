"""The model registry and what the methods ask of a network (a feature layer, a mixing point)."""

from __future__ import annotations

from typing import Callable, Protocol, Tuple, cast

import torch
from torch import nn

from fedcore.models.cnn import LeNet, SmallCNN
from fedcore.models.resnet import ResNet20, resnet18_32
from fedcore.registry import Registry

MODELS: Registry[nn.Module] = Registry("model")


class FeatureNet(Protocol):
    """A model with a feature layer (what :func:`check_feature_layer` checks): ``embed(x)`` and an ``fc`` head."""

    fc: nn.Module

    def embed(self, x: torch.Tensor) -> torch.Tensor: ...


class MixableNet(Protocol):
    """A model that declares its mixing point with ``mix_parts()`` (the ResNets)."""

    def mix_parts(self) -> Tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]: ...


MODELS.register("cnn")(SmallCNN)
MODELS.register("lenet")(LeNet)
MODELS.register("resnet20")(ResNet20)
MODELS.register("resnet18")(resnet18_32)


def create_model(name: str, *, in_channels: int, num_classes: int, norm: str = "batch") -> nn.Module:
    """Build a model by name, e.g. ``create_model("cnn", in_channels=1, num_classes=10, norm="group")``."""
    return MODELS.create(name, in_channels=in_channels, num_classes=num_classes, norm=norm)


def embed_and_classify(model: nn.Module, x):
    """(features, logits) of a model with a feature layer: ``embed(x)`` then its ``fc`` head.

    Prototype methods (FedProto, FedPAD) need the penultimate features; a model without
    them is refused with the names of the models that have them.
    """
    check_feature_layer(model)
    net = cast(FeatureNet, model)
    feats = net.embed(x)
    return feats, net.fc(feats)


def check_feature_layer(model: nn.Module) -> None:
    """Raise a ValueError naming the usable models when ``model`` has no ``embed`` + ``fc`` pair."""
    if not (callable(getattr(model, "embed", None)) and isinstance(getattr(model, "fc", None), nn.Module)):
        raise ValueError(
            f"{type(model).__name__} exposes no feature layer (an embed(x) method and an fc head); "
            f"prototype methods need one: use one of the models {', '.join(MODELS.names())}"
        )


__all__ = [
    "MODELS",
    "create_model",
    "embed_and_classify",
    "check_feature_layer",
    "mix_split",
    "FeatureNet",
    "MixableNet",
]


def mix_split(model: nn.Module):
    """``(pre, post)``: the layers before and after the model's mixing point, for PROSER's manifold mixup.

    ``post(pre(x))`` equals ``model(x)``. A model declares its mixing point with ``mix_at``, an index
    into its ``features``, or with a ``mix_parts()`` method that returns the pair (the ResNets); a
    model without one is refused with the names of those that have one.
    """
    if callable(getattr(model, "mix_parts", None)):
        return cast(MixableNet, model).mix_parts()
    at = getattr(model, "mix_at", None)
    if at is None or not isinstance(getattr(model, "features", None), nn.Sequential):
        usable = [
            n
            for n in MODELS.names()
            if getattr(MODELS.get(n), "mix_at", None) is not None or getattr(MODELS.get(n), "mixable", False)
        ]
        raise ValueError(
            f"{type(model).__name__} has no layer to mix at: PROSER mixes features at a middle layer "
            f"(a `mix_at` index into `features`); use one of the models {', '.join(usable)}"
        )
    features = cast(nn.Sequential, model.features)  # checked above
    head, tail = features[:at], features[at:]

    def post(h):
        return model.fc(torch.flatten(tail(h), 1))

    return head, post
