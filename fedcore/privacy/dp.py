"""Per-sample clipping for test-time adaptation, with and without Gaussian noise.

Two things live here.

**The private gradient** of one test batch (modes ``dp`` and ``dp0``):

    ḡ_i = g_i / max(1, ‖g_i‖ / C)          Δ = (Σ_i ḡ_i + N(0, σ²C²I)) / |B|

``g_i`` is the gradient of sample i's own loss over all adapted parameters, flattened
together. |B| is the batch size (public), never the number of samples a filter kept.
Per-sample gradients come from torch.func (``vmap(grad(...))``, the default) or Opacus'
GradSampleModule hooks; ``benchmarks/dp_step.py`` compares the two. ``dp0`` is this private
form at σ = 0: no guarantee, and not the paper's clip-only ablation (below).

**The paper's clip-only form** (mode ``clip``, :class:`ClippedGradient`): each method's plain
update, filters and normaliser unchanged, with the gradient of the summed per-sample loss
replaced by the sum of the per-sample gradients, each clipped to C.

The noise comes from a source chosen by name (:data:`NOISE_SOURCES`, :func:`gaussian_noise`):
``secure`` draws from the operating system's entropy pool, so nobody can regenerate it from
the run's logged seed; ``seeded`` draws from torch's generator, for reproducible research runs.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, cast

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedcore.privacy.accountant import check_clip_norm, check_sigma

BACKENDS = ("auto", "functorch", "opacus")
# off: plain; clip: the paper's clip-only form; dp0: the private form at sigma = 0; dp: the private form.
MODES = ("off", "clip", "dp0", "dp")
PRIVATE_MODES = ("dp0", "dp")  # the modes that run the private form (PrivateGradient)
NOISE_SOURCES = ("secure", "seeded")

Params = Dict[str, torch.Tensor]
# sample_loss(logits, aux, params) -> per-sample losses (N,); aux holds per-sample tensors.
SampleLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Params], torch.Tensor]


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(
            f"unknown privacy mode {mode!r}; valid names are: {', '.join(MODES)} "
            "(clip: the paper's clip-only form; dp0: the private form at sigma = 0)"
        )
    return mode


def check_noise_source(source: str) -> str:
    if source not in NOISE_SOURCES:
        raise ValueError(
            f"unknown privacy noise_source {source!r}; valid names are: {', '.join(NOISE_SOURCES)} "
            "(secure: OS entropy, for any run whose guarantee matters; seeded: torch's generator, "
            "reproducible from the run's seed, for research grids)"
        )
    return source


@dataclass(frozen=True)
class PrivacySpec:
    """How a client's updates are privatised.

    ``mode``: ``off`` (plain); ``clip`` (the paper's clip-only ablation: each method's plain form
    with per-sample clipping, no noise, no privacy); ``dp0`` (the private form below at σ = 0:
    no privacy either); ``dp`` (the private form: clipping and noise σ). In ``dp`` mode
    ``noise_multiplier`` is the σ already calibrated for the target ε (see :func:`calibrate_sigma`),
    and ``noise_source`` says where the noise comes from (:func:`gaussian_noise`).
    """

    mode: str = "off"
    clip_norm: float = 1.0
    noise_multiplier: float = 0.0
    backend: str = "auto"  # auto: Opacus hooks for norm-only adaptation, torch.func otherwise (benchmarks/dp_step.py)
    noise_source: str = "secure"

    def __post_init__(self) -> None:
        check_mode(self.mode)
        check_noise_source(self.noise_source)
        if self.backend not in BACKENDS:
            raise ValueError(
                f"unknown per-sample gradient backend {self.backend!r}; valid names are: {', '.join(BACKENDS)}"
            )
        if self.mode != "off":
            check_clip_norm(self.clip_norm)
        check_sigma(self.noise_multiplier)
        if self.mode in ("clip", "dp0") and self.noise_multiplier != 0:
            raise ValueError(f"mode {self.mode!r} adds no noise; set noise_multiplier to 0 or use mode 'dp'")
        if self.mode == "dp" and self.noise_multiplier == 0:
            raise ValueError(
                "mode 'dp' needs a noise multiplier > 0 (calibrate it from epsilon); for clipping "
                "without noise use mode 'clip' (the paper's clip-only form) or 'dp0' (the private "
                "form at sigma = 0)"
            )

    @property
    def private(self) -> bool:
        """True for the private form (``dp0``, ``dp``)."""
        return self.mode in PRIVATE_MODES

    @property
    def clip_only(self) -> bool:
        """True for the paper's clip-only form (``clip``)."""
        return self.mode == "clip"


def _secure_standard_normal(n: int) -> torch.Tensor:
    """``n`` float64 N(0, 1) draws from OS entropy: 2×53-bit uniforms per pair, Box–Muller.

    Each output is the sum of four such draws over 2 (still N(0, 1)), Opacus' ``secure_mode``
    remedy against attacks on the floating-point gaps of a single Box–Muller draw (Mironov 2012;
    Holohan & Braghin 2021, section 5.1).
    """
    pairs = 2 * n  # four draws per output, two per Box–Muller pair
    words = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs)
    u1 = ((words[0] >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]: log is finite
    u2 = (words[1] >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
    r = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)])[: 4 * n]
    return torch.from_numpy(z.reshape(4, n).sum(0) / 2.0)


def gaussian_noise(
    shape, *, std: float, source: str, device=None, dtype=torch.float32, generator: torch.Generator | None = None
) -> torch.Tensor:
    """N(0, std²) of the given shape from the named source (:data:`NOISE_SOURCES`).

    ``seeded``: ``torch.randn`` on ``generator`` (default: torch's global generator, which
    the engine seeds per arrival), so a run is reproducible bit for bit, and anyone who reads
    its seed can regenerate the noise and subtract it: no guarantee. ``secure``: drawn from
    ``os.urandom`` in float64 (:func:`_secure_standard_normal`), then cast; it cannot be
    regenerated. We do not use a torch generator seeded from OS entropy: its stream is
    Mersenne Twister (CPU) or Philox (CUDA), not a cryptographic generator, and its 64-bit
    seed bounds the entropy of every draw it makes. torchcsprng, which Opacus' secure mode
    needs, has no build for torch 2.x on pip.
    """
    check_noise_source(source)
    shape = tuple(shape)
    if source == "seeded":
        return std * torch.randn(shape, generator=generator, device=device, dtype=dtype)
    n = math.prod(shape)
    return (std * _secure_standard_normal(n)).reshape(shape).to(device=device, dtype=dtype)


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def check_private_model(model: nn.Module) -> None:
    """BatchNorm in train mode mixes the samples of a batch: no per-sample sensitivity bound.

    The private form (``dp``, ``dp0``) refuses it; the clip-only form does not need the bound
    (see :class:`ClippedGradient`).
    """
    bns = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if bns:
        raise ValueError(
            f"private adaptation needs per-sample gradients, but the model has BatchNorm ({bns[0]}, ...), which "
            "mixes the samples of a batch in train mode. Use the GroupNorm or LayerNorm variant: "
            "model.norm=group (or model.norm=layer), and pretrain that source model."
        )


def per_sample_grads_functorch(
    model: nn.Module,
    params: Params,
    sample_loss: SampleLoss,
    x: torch.Tensor,
    aux: Mapping[str, torch.Tensor],
    *,
    with_logits: bool = False,
):
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


def per_sample_grads_opacus(
    model: nn.Module,
    params: Params,
    sample_loss: SampleLoss,
    x: torch.Tensor,
    aux: Mapping[str, torch.Tensor],
    *,
    with_logits: bool = False,
):
    """The same through Opacus' per-layer hooks. The loss may depend on the parameters only
    through the model's output (no direct parameter terms: those are invisible to hooks)."""
    from opacus import GradSampleModule

    gsm = cast(Optional[GradSampleModule], model._fedcore_gsm) if hasattr(model, "_fedcore_gsm") else None
    if gsm is None:
        for m in model.modules():  # Opacus' backward hooks forbid in-place ops on hooked outputs
            if isinstance(m, (nn.ReLU, nn.ReLU6, nn.LeakyReLU)):
                m.inplace = False
        model.train()  # hooks record activations only in train mode; no BatchNorm here, so outputs are unchanged
        gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
        object.__setattr__(model, "_fedcore_gsm", gsm)  # hooks stay; not registered as a submodule
    named = dict(model.named_parameters())
    for p in named.values():
        p.grad_sample = None  # type: ignore[attr-defined]  # Opacus' runtime attribute; torch's Parameter stub lacks it
    logits = gsm(x)
    with warnings.catch_warnings():  # inputs need no grad here; Opacus' full backward hooks say so every call
        warnings.simplefilter("ignore", UserWarning)
        sample_loss(logits, dict(aux), {k: named[k] for k in params}).sum().backward()
    out = {
        k: named[k].grad_sample.detach().clone()  # type: ignore[attr-defined]  # Opacus' runtime attribute
        for k in params
    }
    for p in named.values():
        p.grad = None
        p.grad_sample = None  # type: ignore[attr-defined]  # Opacus' runtime attribute; torch's Parameter stub lacks it
    return (out, logits.detach()) if with_logits else out


def flatten_per_sample(per_sample: Params) -> torch.Tensor:
    """{name: (B, *shape)} -> (B, D): each sample's gradient over all parameters as one vector."""
    return torch.cat([g.reshape(g.shape[0], -1) for g in per_sample.values()], dim=1)


def privatize(
    per_sample: Params,
    *,
    clip_norm: float,
    noise_multiplier: float,
    batch_size: float,
    noise_source: str = "secure",
    generator: torch.Generator | None = None,
) -> tuple[Params, Dict[str, float]]:
    """Clip each sample's joint gradient to ``clip_norm``, sum, add N(0, σ²C²), divide by ``batch_size``.

    The noise comes from ``noise_source`` (:func:`gaussian_noise`; ``generator`` only for
    ``seeded``). Returns the gradient and two diagnostics (``clip_fraction``: share of samples
    clipped; ``grad_norm``: mean per-sample norm), over the samples whose gradient is not
    zero (a sample a filter dropped has none). They are not private; they are for the
    operator's console only.
    """
    keys = list(per_sample)
    norms = flatten_per_sample(per_sample).norm(dim=1)
    factor = (clip_norm / (norms + 1e-12)).clamp(max=1.0)
    out: Params = {}
    for k in keys:
        g = per_sample[k]
        summed = torch.einsum("b,b...->...", factor, g)
        if noise_multiplier > 0:
            summed = summed + gaussian_noise(
                summed.shape,
                std=noise_multiplier * clip_norm,
                source=noise_source,
                generator=generator,
                device=summed.device,
                dtype=summed.dtype,
            )
        out[k] = summed / batch_size
    live = norms[norms > 0]
    stats = {
        "clip_fraction": float((live > clip_norm).float().mean()) if len(live) else 0.0,
        "grad_norm": float(live.mean()) if len(live) else 0.0,
    }
    return out, stats


class _RunningStats:
    """Running means of the per-batch diagnostics over a client's batches."""

    def __init__(self) -> None:
        self.stats: Dict[str, float] = {"clip_fraction": 0.0, "grad_norm": 0.0}
        self._calls = 0

    def _add(self, stats: Mapping[str, float]) -> None:
        self._calls += 1
        for k, v in stats.items():
            self.stats[k] += (v - self.stats[k]) / self._calls


def per_sample_grads_joint(losses: torch.Tensor, params: Mapping[str, torch.Tensor]) -> Params:
    """{name: (N, *shape)}: the gradient of each entry of ``losses`` (N,), from the one forward
    pass that computed them all (the graph is kept for the caller's other uses).

    One backward per sample. Autograd's batched backward (``is_grads_batched``, vmap over the
    graph) computes the same and was about three times slower on the CNNs here (64 samples, CPU).
    """
    names = list(params)
    rows = [
        torch.autograd.grad(losses[i], [params[k] for k in names], allow_unused=True, retain_graph=True)
        for i in range(len(losses))
    ]
    return {
        k: torch.stack([torch.zeros_like(params[k]) if r[j] is None else r[j] for r in rows])
        for j, k in enumerate(names)
    }


class ClippedGradient(_RunningStats):
    """The paper's clip-only form: Σ_i clip_C(∇ℓ_i) / normaliser in place of ∇(Σ_i ℓ_i) / normaliser.

    DP-TTA's ablation keeps each method exactly as published (its filters, its normaliser,
    SAR's two gradient evaluations and recovery, EATA's Fisher term) and only clips each
    sample's gradient; no noise, so no privacy. The method calls this with the per-sample
    losses of its ordinary forward pass and its own normaliser.

    **What "per-sample gradient" means here**, and why BatchNorm models are allowed: g_i is
    the gradient of sample i's loss ℓ_i through the joint forward pass of the whole batch
    (:func:`per_sample_grads_joint`; :meth:`by_hooks` where that is the same). So Σ_i g_i is the
    plain batch gradient exactly, on any model, and with C = ∞ this form *is* the plain form.
    Under train-mode BatchNorm, g_i also carries sample i's pull on the batch statistics that
    the other samples are normalised with; clipping then bounds how hard each loss term pulls,
    which is what the ablation is about (stabilisation), while it bounds no sensitivity, which
    it never claims. The per-sample alternative of torch.func or Opacus (one forward per
    sample, or per-layer hooks) would be wrong on BatchNorm: a batch of one has other
    statistics than the batch the method predicts with, so Σ_i g_i would not be the plain
    gradient. On GroupNorm or LayerNorm models both definitions agree.
    """

    def __init__(self, *, clip_norm: float):
        super().__init__()
        self.clip_norm = check_clip_norm(clip_norm)

    def __call__(self, losses: torch.Tensor, params: Mapping[str, torch.Tensor], normaliser: float) -> Params:
        """Σ_i clip(∇ losses_i) / ``normaliser``, by parameter name; ``losses`` (N,) still has its graph."""
        return self._clip_sum(per_sample_grads_joint(losses, params), normaliser)

    def by_hooks(
        self,
        model: nn.Module,
        params: Mapping[str, torch.Tensor],
        sample_loss: SampleLoss,
        x: torch.Tensor,
        aux: Mapping[str, torch.Tensor],
        normaliser: float,
    ) -> Params:
        """The same gradient, with g_i from Opacus' per-layer hooks over one forward and backward of ``x``.

        Only where no layer mixes the samples of a batch (no BatchNorm: :func:`has_batchnorm`) and
        ``sample_loss`` reaches the parameters only through the model's output. There sample i's loss
        depends on sample i's activations alone, so these g_i equal the joint pass's (a test checks
        each method), at the cost of one backward instead of one per sample: measured on the GroupNorm
        CNN, a Tent step on 64 samples took 0.05 s against the joint pass's 0.84 s. The caller's own forward
        must run without gradients, or the hooks would keep its activations.
        """
        return self._clip_sum(per_sample_grads_opacus(model, dict(params), sample_loss, x, aux), normaliser)

    def _clip_sum(self, per_sample: Params, normaliser: float) -> Params:
        g, stats = privatize(per_sample, clip_norm=self.clip_norm, noise_multiplier=0.0, batch_size=normaliser)
        self._add(stats)
        return g


class PrivateGradient(_RunningStats):
    """Computes the private gradient of a batch for one method's per-sample loss."""

    def __init__(self, model: nn.Module, params: Dict[str, nn.Parameter], spec: PrivacySpec):
        if not spec.private:
            raise ValueError("PrivateGradient needs privacy mode 'dp' or 'dp0'")
        check_private_model(model)
        if spec.backend == "auto":
            raise ValueError("resolve backend 'auto' before building the private gradient (see adapt._gradient_method)")
        super().__init__()
        self.model, self.params, self.spec = model, params, spec
        self._fn = per_sample_grads_functorch if spec.backend == "functorch" else per_sample_grads_opacus

    def __call__(self, sample_loss: SampleLoss, x: torch.Tensor, aux: Mapping[str, torch.Tensor]):
        """The private gradient, and the logits of the forward pass that computed it."""
        per_sample, logits = self._fn(self.model, dict(self.params), sample_loss, x, aux, with_logits=True)
        g, stats = privatize(
            per_sample,
            clip_norm=self.spec.clip_norm,
            noise_multiplier=self.spec.noise_multiplier,
            batch_size=len(x),
            noise_source=self.spec.noise_source,
        )
        self._add(stats)
        return g, logits
