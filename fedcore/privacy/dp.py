"""The private gradient of one test batch: per-sample clipping plus Gaussian noise.

    ḡ_i = g_i / max(1, ‖g_i‖ / C)          Δ = (Σ_i ḡ_i + N(0, σ²C²I)) / |B|

``g_i`` is the gradient of sample i's own loss over all adapted parameters, flattened
together. |B| is the batch size (public), never the number of samples a filter kept.
Per-sample gradients come from torch.func (``vmap(grad(...))``, the default) or Opacus'
GradSampleModule hooks; ``benchmarks/dp_step.py`` compares the two.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Mapping

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedcore.privacy.accountant import check_clip_norm, check_sigma

BACKENDS = ("auto", "functorch", "opacus")
MODES = ("off", "clip", "dp")

Params = Dict[str, torch.Tensor]
# sample_loss(logits, aux, params) -> per-sample losses (N,); aux holds per-sample tensors.
SampleLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Params], torch.Tensor]


@dataclass(frozen=True)
class PrivacySpec:
    """How a client's updates are privatised.

    ``mode``: ``off`` (plain), ``clip`` (per-sample clipping, σ = 0: no privacy, the paper's
    stabilisation finding) or ``dp`` (clipping and noise σ). In ``dp`` mode ``noise_multiplier``
    is the σ already calibrated for the target ε (see :func:`calibrate_sigma`).
    """

    mode: str = "off"
    clip_norm: float = 1.0
    noise_multiplier: float = 0.0
    backend: str = "auto"  # auto: Opacus hooks for norm-only adaptation, torch.func otherwise (benchmarks/dp_step.py)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown privacy mode {self.mode!r}; valid names are: {', '.join(MODES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown per-sample gradient backend {self.backend!r}; "
                             f"valid names are: {', '.join(BACKENDS)}")
        if self.mode != "off":
            check_clip_norm(self.clip_norm)
        check_sigma(self.noise_multiplier)
        if self.mode == "clip" and self.noise_multiplier != 0:
            raise ValueError("clip-only mode adds no noise; set noise_multiplier to 0 or use mode 'dp'")
        if self.mode == "dp" and self.noise_multiplier == 0:
            raise ValueError("mode 'dp' needs a noise multiplier > 0 (calibrate it from epsilon); "
                             "for clipping without noise use mode 'clip'")

    @property
    def private(self) -> bool:
        return self.mode != "off"


def check_private_model(model: nn.Module) -> None:
    """BatchNorm in train mode mixes the samples of a batch: no per-sample sensitivity bound."""
    bns = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if bns:
        raise ValueError(
            f"private adaptation needs per-sample gradients, but the model has BatchNorm ({bns[0]}, ...), which "
            "mixes the samples of a batch in train mode. Use the GroupNorm or LayerNorm variant: "
            "model.norm=group (or model.norm=layer), and pretrain that source model.")


def per_sample_grads_functorch(model: nn.Module, params: Params, sample_loss: SampleLoss, x: torch.Tensor,
                               aux: Mapping[str, torch.Tensor], *, with_logits: bool = False):
    """{name: (B, *shape)} per-sample gradients of ``sample_loss`` over ``params`` via torch.func.

    With ``with_logits`` also the (B, C) logits of that same forward pass.
    """
    frozen = {k: v.detach() for k, v in model.named_parameters() if k not in params}
    frozen.update({k: v for k, v in model.named_buffers()})

    def one(p: Params, xi: torch.Tensor, ai: Dict[str, torch.Tensor]):
        logits = functional_call(model, {**frozen, **p}, (xi.unsqueeze(0),))
        loss = sample_loss(logits, {k: v.unsqueeze(0) for k, v in ai.items()}, p).sum()
        return loss, logits.detach()[0]

    detached = {k: v.detach() for k, v in params.items()}
    grads, logits = vmap(grad(one, has_aux=True), in_dims=(None, 0, 0), randomness="different")(detached, x, dict(aux))
    return (grads, logits) if with_logits else grads


def per_sample_grads_opacus(model: nn.Module, params: Params, sample_loss: SampleLoss, x: torch.Tensor,
                            aux: Mapping[str, torch.Tensor], *, with_logits: bool = False):
    """The same through Opacus' per-layer hooks. The loss may depend on the parameters only
    through the model's output (no direct parameter terms: those are invisible to hooks)."""
    from opacus import GradSampleModule

    gsm = model._fedcore_gsm if hasattr(model, "_fedcore_gsm") else None
    if gsm is None:
        for m in model.modules():  # Opacus' backward hooks forbid in-place ops on hooked outputs
            if isinstance(m, (nn.ReLU, nn.ReLU6, nn.LeakyReLU)):
                m.inplace = False
        model.train()  # hooks record activations only in train mode; no BatchNorm here, so outputs are unchanged
        gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
        object.__setattr__(model, "_fedcore_gsm", gsm)  # hooks stay; not registered as a submodule
    named = dict(model.named_parameters())
    for p in named.values():
        p.grad_sample = None
    logits = gsm(x)
    with warnings.catch_warnings():  # inputs need no grad here; Opacus' full backward hooks say so every call
        warnings.simplefilter("ignore", UserWarning)
        sample_loss(logits, dict(aux), {k: named[k] for k in params}).sum().backward()
    out = {k: named[k].grad_sample.detach().clone() for k in params}
    for p in named.values():
        p.grad = None
        p.grad_sample = None
    return (out, logits.detach()) if with_logits else out


def flatten_per_sample(per_sample: Params) -> torch.Tensor:
    """{name: (B, *shape)} -> (B, D): each sample's gradient over all parameters as one vector."""
    return torch.cat([g.reshape(g.shape[0], -1) for g in per_sample.values()], dim=1)


def privatize(per_sample: Params, *, clip_norm: float, noise_multiplier: float, batch_size: int,
              generator: torch.Generator | None = None) -> tuple[Params, Dict[str, float]]:
    """Clip each sample's joint gradient to ``clip_norm``, sum, add N(0, σ²C²), divide by ``batch_size``.

    Returns the private gradient and two diagnostics computed from the clipped quantities'
    inputs (``clip_fraction``: share of samples clipped; ``grad_norm``: mean per-sample norm).
    The diagnostics are not private; they are for the operator's console only.
    """
    keys = list(per_sample)
    norms = flatten_per_sample(per_sample).norm(dim=1)
    factor = (clip_norm / (norms + 1e-12)).clamp(max=1.0)
    out: Params = {}
    for k in keys:
        g = per_sample[k]
        summed = torch.einsum("b,b...->...", factor, g)
        if noise_multiplier > 0:
            summed = summed + noise_multiplier * clip_norm * torch.randn(
                summed.shape, generator=generator, device=summed.device, dtype=summed.dtype)
        out[k] = summed / batch_size
    stats = {"clip_fraction": float((norms > clip_norm).float().mean()), "grad_norm": float(norms.mean())}
    return out, stats


class PrivateGradient:
    """Computes the private gradient of a batch for one method's per-sample loss."""

    def __init__(self, model: nn.Module, params: Dict[str, nn.Parameter], spec: PrivacySpec):
        if not spec.private:
            raise ValueError("PrivateGradient needs privacy mode 'clip' or 'dp'")
        check_private_model(model)
        if spec.backend == "auto":
            raise ValueError("resolve backend 'auto' before building the private gradient (see adapt._gradient_method)")
        self.model, self.params, self.spec = model, params, spec
        self._fn = per_sample_grads_functorch if spec.backend == "functorch" else per_sample_grads_opacus
        self.stats: Dict[str, float] = {"clip_fraction": 0.0, "grad_norm": 0.0}
        self._calls = 0

    def __call__(self, sample_loss: SampleLoss, x: torch.Tensor, aux: Mapping[str, torch.Tensor]):
        """The private gradient, and the logits of the forward pass that computed it."""
        per_sample, logits = self._fn(self.model, dict(self.params), sample_loss, x, aux, with_logits=True)
        g, stats = privatize(per_sample, clip_norm=self.spec.clip_norm, noise_multiplier=self.spec.noise_multiplier,
                             batch_size=len(x))
        self._calls += 1
        for k, v in stats.items():  # running means over the client's batches
            self.stats[k] += (v - self.stats[k]) / self._calls
        return g, logits
