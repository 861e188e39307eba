"""Client-side test-time adaptation methods, chosen by name.

``create_method(name, model, ...)`` configures the model for the method, builds its optimizer
and returns the wrapped :class:`~fedcore.adapt.base.TTAMethod`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Mapping, TypeVar

import torch
from torch import nn

from fedcore.adapt.base import (
    GradientMethod,
    TTAMethod,
    check_norm_params,
    collect_norm_params,
    collect_params,
    configure_norm_adaptation,
    make_optimizer,
    softmax_entropy,
)
from fedcore.adapt.bpa import BPA, PRECISION_MODES, prior_precision
from fedcore.adapt.come import COME, opinion_entropy
from fedcore.adapt.deyo import DeYO, shuffle_patches
from fedcore.adapt.eata import EATA, fisher_information
from fedcore.adapt.sar import SAR
from fedcore.adapt.simple import BatchNormAdapt, Source
from fedcore.adapt.tent import Tent
from fedcore.privacy.dp import ClippedGradient, PrivacySpec, PrivateGradient
from fedcore.registry import Registry

METHODS: Registry[TTAMethod] = Registry("adaptation method")
G = TypeVar("G", bound=GradientMethod)


@METHODS.register("source")
def _source(*, model: nn.Module, **_) -> TTAMethod:
    model.eval().requires_grad_(False)
    return Source(model)


@METHODS.register("bn")
def _bn(*, model: nn.Module, **_) -> TTAMethod:
    configure_norm_adaptation(model, grad=False)
    return BatchNormAdapt(model)


def _gradient_method(
    cls: type[G],
    *,
    model: nn.Module,
    lr: float,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    steps: int = 1,
    adapt_params: str = "norm",
    privacy: PrivacySpec | None = None,
    **kw,
) -> G:
    """Configure ``model`` (norm layers in train mode, the rest frozen), pick the adapted
    parameters, and wire in the private gradient (modes ``dp``, ``dp0``) or the clip-only
    form's clipped gradient (mode ``clip``) when ``privacy`` asks for one."""
    own = set(inspect.signature(cls.__init__).parameters) - {
        "self",
        "model",
        "optimizer",
        "params",
        "steps",
        "private",
        "clip",
    }
    unknown = sorted(set(kw) - own)
    if unknown:
        valid = sorted(own | {"lr", "optimizer", "momentum", "steps", "adapt_params"})
        raise ValueError(f"{cls.__name__} has no setting {', '.join(unknown)}; valid settings are: {', '.join(valid)}")
    configure_norm_adaptation(model, grad=False)
    params = collect_params(model, adapt_params)
    private = clip = None
    if privacy is not None and privacy.clip_only:
        clip = ClippedGradient(clip_norm=privacy.clip_norm)
    if privacy is not None and privacy.private:
        if privacy.backend == "auto":
            # Measured (benchmarks/dp_step.py): Opacus' hooks win when only norm layers adapt,
            # since the batched backward is reused; vmap wins when every layer needs per-sample grads.
            # A loss with its own parameter terms (bpa's prior) needs torch.func.
            fast = "opacus" if adapt_params == "norm" and not cls.direct_param_terms else "functorch"
            privacy = dataclasses.replace(privacy, backend=fast)
        private = PrivateGradient(model, params, privacy)
    opt = make_optimizer(params.values(), optimizer=optimizer, lr=lr, momentum=momentum)
    return cls(model, opt, params, steps=steps, private=private, clip=clip, **kw)


@METHODS.register("tent")
def _tent(*, model: nn.Module, num_classes: int | None = None, **hp) -> TTAMethod:
    return _gradient_method(Tent, model=model, **hp)


# The factories below pass each method's own settings on to its class, whose signature holds their
# defaults (the one place they are written: method_settings reads them from there).


@METHODS.register("bpa")
def _bpa(*, model: nn.Module, num_classes: int, **hp) -> TTAMethod:
    if hp.get("privacy") is not None and hp["privacy"].private and hp["privacy"].backend == "opacus":
        raise ValueError(
            "private bpa puts the prior inside each sample's loss, which Opacus' layer hooks cannot "
            "see; use privacy.backend=functorch"
        )
    return _gradient_method(BPA, model=model, num_classes=num_classes, **hp)


@METHODS.register("eata")
def _eata(*, model: nn.Module, num_classes: int, source_x: torch.Tensor | None = None, **hp) -> TTAMethod:
    method = _gradient_method(EATA, model=model, num_classes=num_classes, **hp)
    if method.fisher_alpha > 0:
        if source_x is None or len(source_x) == 0:
            raise ValueError(
                "EATA's Fisher regulariser needs source samples (source_x); pass them, "
                "or set fisher_alpha: 0 to run without it"
            )
        method.fisher = fisher_information(model, method.params, source_x[: method.fisher_size])
    return method


@METHODS.register("sar")
def _sar(*, model: nn.Module, num_classes: int, **hp) -> TTAMethod:
    return _gradient_method(SAR, model=model, num_classes=num_classes, **hp)


@METHODS.register("deyo")
def _deyo(*, model: nn.Module, num_classes: int, **hp) -> TTAMethod:
    return _gradient_method(DeYO, model=model, num_classes=num_classes, **hp)


@METHODS.register("come")
def _come(*, model: nn.Module, num_classes: int, **hp) -> TTAMethod:
    return _gradient_method(COME, model=model, num_classes=num_classes, **hp)


# Methods that normalise with test-batch statistics; their models are scored the same way.
USES_BATCH_STATS = frozenset({"bn", "tent", "bpa", "eata", "sar", "deyo", "come"})
# Methods that take gradients, so have a private form; and those that need source samples.
GRADIENT_METHODS = frozenset({"tent", "bpa", "eata", "sar", "deyo", "come"})
NEEDS_SOURCE = frozenset({"eata"})


METHOD_CLASSES: Dict[str, type[TTAMethod]] = {
    "source": Source,
    "bn": BatchNormAdapt,
    "tent": Tent,
    "bpa": BPA,
    "eata": EATA,
    "sar": SAR,
    "deyo": DeYO,
    "come": COME,
}


def method_class(name: str) -> type[TTAMethod]:
    """The class behind a method name: what the engine asks for traits (``uses_per_sample``, ``source_samples``)."""
    METHODS.get(name)  # unknown names fail here, listing the valid ones
    return METHOD_CLASSES[name]


# What the engine hands a method when it builds one, never a configured setting.
_SUPPLIED = frozenset(
    {"self", "cls", "model", "num_classes", "privacy", "source_x", "params", "private", "clip", "fisher"}
)


def method_settings(name: str) -> Dict[str, inspect.Parameter]:
    """The settings ``method.params`` may hold for method ``name``, each with its annotation and default.

    The same names that building the method accepts (:func:`_gradient_method` and the method's
    own arguments), so that a misspelt or foreign setting fails when the config is read, not on
    a worker after the services have started.
    """
    factory = METHODS.get(name)
    fns: List[Callable[..., Any]] = [factory] + (
        [_gradient_method, METHOD_CLASSES[name].__init__] if name in GRADIENT_METHODS else []
    )
    out: Dict[str, inspect.Parameter] = {}
    for fn in fns:
        for p in inspect.signature(fn, eval_str=True).parameters.values():
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in _SUPPLIED:
                out.setdefault(p.name, p)
    return out


def _kind_ok(value, annotation) -> bool:
    """``value`` fits ``annotation`` (float, int, str, bool, or one of them or None); other annotations pass."""
    kinds = set(getattr(annotation, "__args__", (annotation,)))
    if value is None:
        return type(None) in kinds
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int) and (int in kinds or float in kinds):
        return True
    if isinstance(value, float) and float in kinds:
        return True
    if isinstance(value, str) and str in kinds:
        return True
    return not kinds & {float, int, str, bool}


def check_method_settings(name: str, settings: Mapping[str, Any]) -> None:
    """Every key of ``settings`` is a setting of method ``name``, of the kind it takes; else a ValueError
    that lists the valid settings (or names the expected kind) and how to set one."""
    valid = method_settings(name)
    unknown = sorted(set(settings) - set(valid))
    if unknown and not valid:
        raise ValueError(
            f"method {name!r} takes no settings, so method.params must be empty; got {', '.join(map(repr, unknown))}"
        )
    if unknown:
        raise ValueError(
            f"method {name!r} has no setting {', '.join(map(repr, unknown))}; its settings are: "
            f"{', '.join(sorted(valid))} (set one with method.params.<setting>=..., not "
            "+method.params.<setting>=..., which adds a new key and so accepts a misspelling)"
        )
    for key, value in settings.items():
        ann = valid[key].annotation
        if ann is not inspect.Parameter.empty and not _kind_ok(value, ann):
            want = " or ".join(getattr(t, "__name__", str(t)) for t in getattr(ann, "__args__", (ann,)))
            raise ValueError(
                f"method {name!r} setting {key}={value!r} is a {type(value).__name__}; it takes "
                f"{want.replace('NoneType', 'null')}"
            )


def create_method(name: str, model: nn.Module, **hparams) -> TTAMethod:
    """Wrap ``model`` (modified in place) with the named method and its hyper-parameters."""
    return METHODS.create(name, model=model, **hparams)


__all__ = [
    "METHODS",
    "METHOD_CLASSES",
    "method_class",
    "create_method",
    "method_settings",
    "check_method_settings",
    "TTAMethod",
    "GradientMethod",
    "Tent",
    "BPA",
    "EATA",
    "SAR",
    "DeYO",
    "COME",
    "GRADIENT_METHODS",
    "NEEDS_SOURCE",
    "opinion_entropy",
    "shuffle_patches",
    "fisher_information",
    "Source",
    "BatchNormAdapt",
    "softmax_entropy",
    "prior_precision",
    "USES_BATCH_STATS",
    "PRECISION_MODES",
    "configure_norm_adaptation",
    "collect_norm_params",
    "check_norm_params",
]
