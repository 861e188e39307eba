"""What every test-time method shares: adapt-then-predict ``forward`` and a ``reset`` snapshot."""

from __future__ import annotations

import copy
from typing import Iterable, List

import torch
from torch import nn

from fedcore.models.norm import NORM_TYPES


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-sample entropy H(softmax(logits)) in nats, shape (N,)."""
    return -(logits.softmax(1) * logits.log_softmax(1)).sum(1)


def norm_layers(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if isinstance(m, NORM_TYPES)]


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def configure_norm_adaptation(model: nn.Module, *, grad: bool) -> nn.Module:
    """Train mode for norm layers (BatchNorm uses and tracks test-batch statistics).

    Everything else is frozen; the affine parameters of the norm layers get gradients when
    ``grad`` is true. Unlike the tent reference, BatchNorm keeps tracking running statistics:
    the server merges them into the global model, which is evaluated in eval mode.
    """
    model.eval()
    model.requires_grad_(False)
    for m in norm_layers(model):
        m.train()
        if grad:
            for p in (m.weight, m.bias):
                if p is not None:
                    p.requires_grad_(True)
    return model


def collect_norm_params(model: nn.Module) -> tuple[list[nn.Parameter], list[str]]:
    """The affine parameters of every norm layer, and their names."""
    params, names = [], []
    for mname, m in model.named_modules():
        if isinstance(m, NORM_TYPES):
            for pname, p in m.named_parameters(recurse=False):
                params.append(p)
                names.append(f"{mname}.{pname}")
    return params, names


def check_norm_params(model: nn.Module) -> None:
    params, _ = collect_norm_params(model)
    if not params:
        raise ValueError(
            "this method adapts the affine parameters of norm layers, but the model has none; "
            "build it with norm='batch', 'group' or 'layer' and affine parameters"
        )


class TTAMethod(nn.Module):
    """A test-time method wraps a model (and optimizer) it is given.

    ``forward(x)`` adapts on the batch, then returns the logits used for prediction (computed
    in the same pass, before the parameter update: the online predict-then-adapt protocol).
    ``reset()`` restores the model and optimizer as they were handed over.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, steps: int = 1):
        super().__init__()
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.model = model
        self.optimizer = optimizer
        self.steps = steps
        self._model_state = copy.deepcopy(model.state_dict())
        self._opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = None
        for _ in range(self.steps):
            out = self.forward_and_adapt(x)
        return out

    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def reset(self) -> None:
        self.model.load_state_dict(self._model_state, strict=True)
        if self.optimizer is not None and self._opt_state is not None:
            self.optimizer.load_state_dict(self._opt_state)


def make_optimizer(params: Iterable[nn.Parameter], *, optimizer: str, lr: float, momentum: float = 0.9,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    if lr <= 0:
        raise ValueError(f"learning rate must be > 0, got {lr}")
    if optimizer == "sgd":
        return torch.optim.SGD(list(params), lr=lr, momentum=momentum, weight_decay=weight_decay)
    if optimizer == "adam":
        return torch.optim.Adam(list(params), lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {optimizer!r}; valid names are: adam, sgd")
