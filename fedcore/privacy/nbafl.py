"""NbAFL's uplink noise (Wei et al., "Federated Learning with Differential Privacy: Algorithms and
Performance Analysis", IEEE TIFS 2020): PP-FCIL's second privacy baseline.

A client trains without noise, clips what it sends to norm C, and adds Gaussian noise of std

    σ_u = c · L · ΔS / ε,   ΔS = 2C / m,   c = sqrt(2 ln(1.25 / δ_e))

once per upload, where L is the number of uploads the client will make (its exposures), m its number
of training samples, and ε its budget for the whole run. Each upload is then the classical Gaussian
mechanism (Dwork & Roth, Theorem A.1) at ε_e = ε / L, and L uploads compose, by basic composition,
to (L·ε_e, L·δ_e) = (ε, L·δ_e).

Two readings are settled here:

* **δ per upload.** NbAFL's theorem states (ε, δ) for the whole run with δ in every upload's c; basic
  composition gives L·δ. We set δ_e = δ / L, so the run is (ε, δ)-DP like the other baselines at the
  same (ε, δ). It makes c a little larger (5.28 against 4.84 for L = 9, δ = 1e-5).
* **ε_e < 1.** The classical Gaussian mechanism's calibration holds only for ε_e < 1. A run with
  ε / L >= 1 is refused (:func:`nbafl_std`) rather than given a σ that does not carry its promise.

ΔS = 2C/m is NbAFL's sensitivity: it assumes the local model is an average of per-sample terms each
bounded by C, so one changed sample moves it by at most 2C/m. For a network trained by SGD that is
NbAFL's assumption, not a worst-case bound (the worst case of a vector clipped to C is 2C); we use
it as the paper does and say so in docs/systems/ppfcil.md. The noise is added to every coordinate, so its
norm grows as √d while what it protects is at most C: noise / signal ≈ 2cL·√d / (m·ε), whatever C is.

The server's downlink noise (NbAFL's Theorem 2: needed only when the rounds T exceed L·√N) is not
added: with participation F the uploads are L ≈ F·T, so it is needed only when F·√N < 1.
:func:`downlink_needed` says when, and the trainer refuses such a run.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple, cast

import torch


def planned_uploads(rounds: int, participation: float) -> int:
    """L = ⌈rounds·F⌉: the uploads a client plans for (classic DP-SGD plans its participations the same way)."""
    return max(1, math.ceil(int(rounds) * float(participation)))


def exposure_epsilon(epsilon: float, exposures: int) -> float:
    """ε_e = ε / L, the budget of one upload; refused where the classical Gaussian calibration does not hold."""
    if exposures < 1:
        raise ValueError(f"NbAFL needs at least one planned upload, got {exposures}")
    eps_e = float(epsilon) / int(exposures)
    if not eps_e < 1.0:
        raise ValueError(
            f"NbAFL's Gaussian calibration (c = sqrt(2 ln(1.25/δ))) holds only for ε < 1 per upload, but ε_total "
            f"{epsilon:g} over L = {exposures} uploads is {eps_e:.3g} each. Lower epsilon below {exposures:g}, or "
            f"plan more uploads (more rounds or a higher participation)"
        )
    return eps_e


def nbafl_std(*, clip_norm: float, num_samples: int, exposures: int, epsilon: float, delta: float) -> float:
    """σ_u = c·L·(2C/m)/ε with c = sqrt(2 ln(1.25·L/δ)): the noise std per coordinate of one upload."""
    if num_samples < 1:
        raise ValueError(f"NbAFL's sensitivity 2C/m needs m >= 1 training samples, got {num_samples}")
    eps_e = exposure_epsilon(epsilon, exposures)
    c = math.sqrt(2.0 * math.log(1.25 * exposures / delta))
    return c * (2.0 * clip_norm / num_samples) / eps_e


def downlink_needed(*, rounds: int, exposures: int, clients: int) -> bool:
    """NbAFL's Theorem 2: the server must add noise too when T > L·√N."""
    return rounds > exposures * math.sqrt(clients)


@torch.no_grad()
def clip_and_noise(
    update: Dict[str, torch.Tensor],
    *,
    clip_norm: float,
    std: float,
    generator: torch.Generator | None = None,
    source: str = "seeded",
) -> Tuple[Dict[str, torch.Tensor], float]:
    """Scale ``update`` jointly to norm at most C, add N(0, std²) to every coordinate; returns the noised
    update and the norm before clipping. ``source="seeded"`` draws the noise from ``generator`` in the dict's
    key order; ``"secure"`` from OS entropy (:func:`fedcore.privacy.dp.gaussian_noise`)."""
    from fedcore.privacy.dp import check_noise_source, gaussian_noise

    check_noise_source(source)
    norm = (
        float(torch.sqrt(cast(torch.Tensor, sum((u.double() ** 2).sum() for u in update.values())))) if update else 0.0
    )
    scale = min(1.0, clip_norm / (norm + 1e-12))
    if source == "seeded":
        return {
            k: u * scale + torch.randn(u.shape, generator=generator).to(u.device, u.dtype) * std
            for k, u in update.items()
        }, norm
    return {
        k: u * scale + gaussian_noise(u.shape, std=std, source="secure", device=u.device, dtype=u.dtype)
        for k, u in update.items()
    }, norm


__all__ = ["clip_and_noise", "downlink_needed", "exposure_epsilon", "nbafl_std", "planned_uploads"]
