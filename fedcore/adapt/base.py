"""What every test-time method shares: adapt-then-predict ``forward`` and a ``reset`` snapshot."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, Iterable, List, Mapping, cast

import torch
from torch import nn

from fedcore.models.norm import NORM_TYPES
from fedcore.privacy.dp import has_batchnorm


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-sample entropy H(softmax(logits)) in nats, shape (N,)."""
    return -(logits.softmax(1) * logits.log_softmax(1)).sum(1)


def norm_layers(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if isinstance(m, NORM_TYPES)]


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
        return cast(torch.Tensor, out)  # steps >= 1 (checked in __init__), so the loop ran

    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- traits the engine asks the method for, instead of reading its settings by key
    @classmethod
    def uses_per_sample(cls, params: Mapping[str, Any]) -> int:
        """How many gradient steps each stream sample enters (what a privacy ledger charges)."""
        return int(params.get("steps", 1))

    @classmethod
    def source_samples(cls, params: Mapping[str, Any]) -> int:
        """How many labelled-source images (labels dropped) the method needs; 0 for none."""
        return 0

    def diagnostics(self) -> Dict[str, float]:
        """Scalars worth recording after a client's adaptation (prior precision, resets, clipping)."""
        return {}

    def reset(self) -> None:
        self.model.load_state_dict(self._model_state, strict=True)
        if self.optimizer is not None and self._opt_state is not None:
            self.optimizer.load_state_dict(self._opt_state)


def make_optimizer(
    params: Iterable[nn.Parameter], *, optimizer: str, lr: float, momentum: float = 0.9, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    if lr <= 0:
        raise ValueError(f"learning rate must be > 0, got {lr}")
    if optimizer == "sgd":
        return torch.optim.SGD(list(params), lr=lr, momentum=momentum, weight_decay=weight_decay)
    if optimizer == "adam":
        return torch.optim.Adam(list(params), lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {optimizer!r}; valid names are: adam, sgd")


def collect_params(model: nn.Module, which: str) -> Dict[str, nn.Parameter]:
    """The parameters a method adapts, by name: ``norm`` (affine parameters of the norm layers,
    as Tent) or ``all``. Everything else is frozen."""
    if which == "norm":
        params, names = collect_norm_params(model)
        named = dict(zip(names, params))
    elif which == "all":
        named = dict(model.named_parameters())
    else:
        raise ValueError(f"unknown adapt_params {which!r}; valid names are: all, norm")
    if not named:
        check_norm_params(model)
    for p in named.values():
        p.requires_grad_(True)
    return named


class GradientMethod(TTAMethod):
    """An entropy-style method written as a per-sample loss, so it has a plain and a private form.

    Subclasses define:

    * ``aux(x, logits)``: per-sample, detached quantities computed from the batch without
      gradients (filters, weights, PLPD, prior precisions), a dict of (N, ...) tensors;
    * ``sample_loss(logits, aux, params)``: the differentiable per-sample loss, shape (N,);
    * ``penalty(params)`` (optional): a term that depends on the parameters only (EATA's
      Fisher regulariser), added outside the privacy boundary;
    * ``plain_normaliser(aux, n)``: what the plain form divides the summed loss by (the
      number of samples the filters kept, as the originals do); 0 skips the update.

    Plain form: one forward with gradients, loss = Σ sample_loss / normaliser + penalty.
    Clip-only form (``clip`` given, DP-TTA's ablation): the plain form, except that
    ∇ Σ sample_loss is replaced by Σ_i clip_C(∇ sample_loss_i) (see
    :class:`fedcore.privacy.ClippedGradient`); the normaliser, the filters and the penalty's
    gradient (not clipped) are the plain form's.
    Private form (``private`` given): a forward without gradients for the prediction and
    ``aux``, then the clipped, noised per-sample gradient of ``sample_loss`` divided by the
    batch size, plus the penalty's gradient. Filters there become per-sample 0/1 weights.
    """

    optimizer: torch.optim.Optimizer  # always given (TTAMethod also serves the optimizer-less methods)

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        params: Dict[str, nn.Parameter],
        *,
        steps: int = 1,
        private: Any = None,
        clip: Any = None,
    ):
        super().__init__(model, optimizer, steps=steps)
        if private is not None and clip is not None:
            raise ValueError("a method runs either the private form (private) or the clip-only form (clip), not both")
        self.params = params
        self.private = private  # a fedcore.privacy.PrivateGradient, or None
        self.clip = clip  # a fedcore.privacy.ClippedGradient, or None
        # The clip-only form takes per-sample gradients from hooks (one backward) where they equal
        # the joint pass's (ClippedGradient.by_hooks); on BatchNorm models, one backward per sample.
        self.clip_by_hooks = clip is not None and not has_batchnorm(model) and not self.direct_param_terms
        self.kept = 0  # samples that passed the filters (plain and clip-only forms), summed over batches

    # -- what a subclass defines
    def aux(self, x: torch.Tensor, logits: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {}

    def sample_loss(
        self, logits: torch.Tensor, aux: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def penalty(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        return None

    def plain_normaliser(self, aux: Mapping[str, torch.Tensor], n: int) -> float:
        return float(aux["mask"].sum()) if "mask" in aux else float(n)

    # -- the three forms
    @torch.enable_grad()
    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        if self.private is not None:
            return self._private_step(x)
        # With hooks (clip-only form, no BatchNorm) the forward needs no graph: the hooks take each g_i
        # from their own pass, and a grad-enabled forward here would leave its activations in them.
        with torch.no_grad() if self.clip_by_hooks else contextlib.nullcontext():
            logits = self.model(x)
            aux = self.aux(x, logits.detach())
        denom = self.plain_normaliser(aux, len(x))
        self.kept += int(denom)
        if denom > 0:
            if self.clip_by_hooks:
                self.apply_gradient(self.clip.by_hooks(self.model, self.params, self.sample_loss, x, aux, denom))
            elif self.clip is not None:
                self.apply_gradient(self.clip(self.sample_loss(logits, aux, self.params), self.params, denom))
            else:
                loss = self.sample_loss(logits, aux, self.params).sum() / denom
                pen = self.penalty(self.params)
                if pen is not None:
                    loss = loss + pen
                loss.backward()
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return logits.detach()

    # True when the private form's ``aux`` reads nothing but each sample's own logits: then it
    # runs inside the per-sample pass, which also yields the prediction (one forward, not two).
    aux_in_loss = False
    # True when sample_loss depends on the parameters directly, not only through the logits.
    direct_param_terms = False

    def _private_step(self, x: torch.Tensor) -> torch.Tensor:
        if self.aux_in_loss:

            def loss(logits, _aux, params):
                return self.sample_loss(logits, self.aux(None, logits.detach()), params)

            grads, logits = self.private(loss, x, {})
        else:
            with torch.no_grad():
                logits = self.model(x)
                aux = self.aux(x, logits)
            grads, _ = self.private(self.sample_loss, x, aux)
        self.apply_gradient(grads)
        return logits

    def diagnostics(self) -> Dict[str, float]:
        if self.private is not None:
            return {f"dp_{k}": float(v) for k, v in self.private.stats.items()}
        if self.clip is not None:
            return {f"clip_{k}" if k != "clip_fraction" else k: float(v) for k, v in self.clip.stats.items()}
        return {}

    def apply_gradient(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Set ``p.grad`` to the given gradient plus the penalty's, then take an optimizer step."""
        pen = self.penalty(self.params)
        pen_grads = (
            torch.autograd.grad(pen, list(self.params.values()), allow_unused=True)
            if pen is not None
            else [None] * len(self.params)
        )
        for (k, p), pg in zip(self.params.items(), pen_grads):
            p.grad = grads[k].detach().clone() if pg is None else grads[k].detach() + pg
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
