"""An empirical check of the privacy guarantee: a canary membership test.

The game, repeated ``trials`` times for each side: a client adapts once on a stream of
``stream_size`` samples, one private step over the whole stream (each sample used once,
so the accountant charges μ = 2/σ). On the IN side the stream holds the canary, a marked
sample (an image with a bright square stamped in its corner, see :func:`choose_canary`); on the OUT side that slot
holds an ordinary sample instead (change-one neighbours). The attacker sees the adapted
parameters θ′ and the received θ, and scores s = −⟨θ′ − θ, ḡ_c⟩, where ḡ_c is the canary's
clipped gradient at θ: the white-box test that is optimal for a single noisy step.

From the scores we take, for every threshold, Clopper–Pearson upper bounds (confidence
``confidence``) on the false-positive and false-negative rates, and the largest

    ε_lb = max( ln((1 − δ − FPR) / FNR),  ln((1 − δ − FNR) / FPR) )

that any (ε, δ)-DP mechanism must satisfy. A valid accountant always reports ε ≥ ε_lb.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, cast

import numpy as np
import torch
from scipy.stats import beta
from torch import nn

from fedcore.privacy.accountant import gdp_epsilon, mu_from_sigma
from fedcore.privacy.dp import PrivacySpec, flatten_per_sample, per_sample_grads_functorch


def stamp_canary(x: torch.Tensor, size: int = 4, value: float = 1.0) -> torch.Tensor:
    """The marked sample: ``x`` (C, H, W) with a ``size``-pixel square of ``value`` in its top-left corner."""
    c = x.clone()
    c[:, :size, :size] = value
    return c


def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """One-sided upper confidence bound on a rate from k successes in n trials."""
    return 1.0 if k >= n else float(beta.ppf(1 - alpha, k + 1, n - k))


def epsilon_lower_bound(
    scores_in: np.ndarray, scores_out: np.ndarray, *, delta: float, confidence: float = 0.95
) -> float:
    """The largest ε that the threshold tests on these scores certify (0 if none)."""
    alpha = (1 - confidence) / 2  # two rates bounded at once
    n_in, n_out = len(scores_in), len(scores_out)
    best = 0.0
    for t in np.unique(np.concatenate([scores_in, scores_out])):
        fnr = clopper_pearson_upper(int((scores_in < t).sum()), n_in, alpha)
        fpr = clopper_pearson_upper(int((scores_out >= t).sum()), n_out, alpha)
        for num, den in ((1 - delta - fpr, fnr), (1 - delta - fnr, fpr)):
            if num > 0 and den > 0:
                best = max(best, math.log(num / den))
    return best


@dataclass
class AuditResult:
    epsilon_lower: float  # empirical lower bound on ε (at the given δ and confidence)
    epsilon_accountant: float  # what the accountant charges for one use of each sample
    sigma: float
    delta: float
    trials: int
    auc: float  # how well the scores separate IN from OUT (0.5 = not at all)
    scores_in: List[float] = field(repr=False, default_factory=list)
    scores_out: List[float] = field(repr=False, default_factory=list)


def choose_canary(method, pool: torch.Tensor, candidates: int = 16) -> torch.Tensor:
    """The marked sample whose gradient is least like the pool's: the auditor picks the canary
    that is easiest to see. Candidates: the first images of the pool with a bright square
    (half the image side) stamped in a corner, and an all-bright image."""
    h = pool.shape[-1]
    cands = torch.stack([stamp_canary(x, size=h // 2) for x in pool[:candidates]] + [torch.ones_like(pool[0])])
    g = per_sample_grads_functorch(method.model, dict(method.params), method.sample_loss, cands, {})
    gc = flatten_per_sample(g)
    ref = per_sample_grads_functorch(method.model, dict(method.params), method.sample_loss, pool[-64:], {})
    mean = flatten_per_sample(ref).mean(0)
    cos = (gc @ mean) / (gc.norm(dim=1) * mean.norm() + 1e-12)
    return cands[int(cos.argmin())]


def canary_audit(
    build: Callable[[], nn.Module],
    pool: torch.Tensor,
    *,
    spec: PrivacySpec,
    delta: float,
    num_classes: int,
    method: str = "tent",
    lr: float = 0.1,
    stream_size: int = 8,
    trials: int = 200,
    seed: int = 0,
    confidence: float = 0.95,
    progress: bool = False,
) -> AuditResult:
    """Run the canary game for one privacy setting (``spec``; mode ``dp0`` is the private step at σ = 0).

    ``build`` returns the received global model; ``pool`` holds ordinary samples (N, C, H, W)
    from which streams are drawn. The bound is tightest when every sample is clipped (a
    clip norm below the per-sample gradient norms), since the guarantee does not depend on C.
    The method is created once and reset between trials: each trial is one real private step.
    """
    from fedcore.adapt import GradientMethod, create_method

    if len(pool) < stream_size + 64:
        raise ValueError(f"the audit needs at least {stream_size + 64} pool samples, got {len(pool)}")
    gen = torch.Generator().manual_seed(seed)
    m = cast(GradientMethod, create_method(method, build(), lr=lr, num_classes=num_classes, privacy=spec))
    canary = choose_canary(m, pool)
    # The canary's clipped gradient at the received model: the attacker's direction.
    g = per_sample_grads_functorch(m.model, dict(m.params), m.sample_loss, canary.unsqueeze(0), {})
    norm = float(flatten_per_sample(g).norm())
    direction = {k: v[0] * min(1.0, spec.clip_norm / (norm + 1e-12)) for k, v in g.items()}
    before = {k: p.detach().clone() for k, p in m.params.items()}

    def one(with_canary: bool) -> float:
        idx = torch.randperm(len(pool), generator=gen)[:stream_size]
        x = pool[idx].clone()
        if with_canary:
            x[0] = canary
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        m.reset()
        m(x)
        return -float(sum(((m.params[k].detach() - before[k]) * direction[k]).sum() for k in before))

    steps = range(trials)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=f"canary audit sigma={spec.noise_multiplier:g}", unit="pair")
    s_in, s_out = [], []
    for _ in steps:
        s_in.append(one(True))
        s_out.append(one(False))
    a_in, a_out = np.asarray(s_in), np.asarray(s_out)
    auc = float((a_in[:, None] > a_out[None, :]).mean() + 0.5 * (a_in[:, None] == a_out[None, :]).mean())
    sigma = spec.noise_multiplier
    return AuditResult(
        epsilon_lower=epsilon_lower_bound(a_in, a_out, delta=delta, confidence=confidence),
        epsilon_accountant=gdp_epsilon(mu_from_sigma(sigma), delta),
        sigma=sigma,
        delta=delta,
        trials=trials,
        auc=auc,
        scores_in=s_in,
        scores_out=s_out,
    )
