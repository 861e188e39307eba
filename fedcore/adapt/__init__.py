"""Client-side test-time adaptation methods, chosen by name.

``create_method(name, model, ...)`` configures the model for the method, builds its optimizer
and returns the wrapped :class:`~fedcore.adapt.base.TTAMethod`.
"""

from __future__ import annotations

from torch import nn

from fedcore.adapt.base import (
    TTAMethod,
    check_norm_params,
    collect_norm_params,
    configure_norm_adaptation,
    make_optimizer,
    softmax_entropy,
)
from fedcore.adapt.bpa import BPA, PRECISION_MODES, prior_precision
from fedcore.adapt.simple import BatchNormAdapt, Source
from fedcore.adapt.tent import Tent
from fedcore.registry import Registry

METHODS: Registry[TTAMethod] = Registry("adaptation method")


@METHODS.register("source")
def _source(*, model: nn.Module, **_) -> TTAMethod:
    model.eval().requires_grad_(False)
    return Source(model)


@METHODS.register("bn")
def _bn(*, model: nn.Module, **_) -> TTAMethod:
    configure_norm_adaptation(model, grad=False)
    return BatchNormAdapt(model)


@METHODS.register("tent")
def _tent(*, model: nn.Module, lr: float, optimizer: str = "sgd", momentum: float = 0.9, steps: int = 1,
          **_) -> TTAMethod:
    configure_norm_adaptation(model, grad=True)
    check_norm_params(model)
    params, _ = collect_norm_params(model)
    return Tent(model, make_optimizer(params, optimizer=optimizer, lr=lr, momentum=momentum), steps=steps)


@METHODS.register("bpa")
def _bpa(*, model: nn.Module, lr: float, num_classes: int, optimizer: str = "sgd", momentum: float = 0.9,
         steps: int = 1, sigma0: float = 1.0, precision_mode: str = "confidence", **_) -> TTAMethod:
    configure_norm_adaptation(model, grad=True)
    check_norm_params(model)
    params, _ = collect_norm_params(model)
    opt = make_optimizer(params, optimizer=optimizer, lr=lr, momentum=momentum)
    return BPA(model, opt, num_classes=num_classes, sigma0=sigma0, precision_mode=precision_mode, steps=steps)


# Methods that normalise with test-batch statistics; their models are scored the same way.
USES_BATCH_STATS = frozenset({"bn", "tent", "bpa"})


def create_method(name: str, model: nn.Module, **hparams) -> TTAMethod:
    """Wrap ``model`` (modified in place) with the named method and its hyper-parameters."""
    return METHODS.create(name, model=model, **hparams)


__all__ = ["METHODS", "create_method", "TTAMethod", "Tent", "BPA", "Source", "BatchNormAdapt", "softmax_entropy",
           "prior_precision", "USES_BATCH_STATS", "PRECISION_MODES", "configure_norm_adaptation", "collect_norm_params"]
