"""The gate statistic as a client reports it: σ_k, privatised in ``dp`` mode.

σ_k is the adapted model's mean prediction entropy over the client's n stream samples; the
server's UGSA gate weights the client's model by it. It is a second pass over every sample,
so in ``dp`` mode it is released through the Gaussian mechanism: each sample's entropy lies in
[0, ln C], so changing one sample moves the mean by at most ln C / n (change-one sensitivity),
and noise of std z·ln C / n makes the release μ-GDP with μ = 1/z. (``dp`` mode refuses
BatchNorm models, so each sample's entropy depends on that sample alone, even where σ_k is
computed batch by batch with batch statistics.) The released value is
clamped to [0, ln C] (post-processing). The ledger charges it with every arrival
(:class:`~fedcore.privacy.Ledger`), and σ is calibrated for the rest of the budget.
"""

from __future__ import annotations

import math

import torch

from fedcore.privacy.accountant import check_gate_noise
from fedcore.privacy.dp import gaussian_noise
from fedcore.privacy.ledger import PrivacyConfig


def gate_noise_std(*, num_classes: int, n: int, noise_multiplier: float) -> float:
    """The std z·ln C / n of the noise on a mean entropy over ``n`` samples of ``num_classes`` classes."""
    if n < 1 or num_classes < 2:
        raise ValueError(f"the gate statistic needs n >= 1 samples and num_classes >= 2, got {n}, {num_classes}")
    return check_gate_noise(noise_multiplier) * math.log(num_classes) / n


def privatize_gate(sigma: float, cfg: PrivacyConfig, *, num_classes: int, n: int) -> float:
    """σ_k as released: unchanged unless ``cfg`` is ``dp``; there σ_k + N(0, (z·ln C / n)²), clamped
    to [0, ln C], with the noise from ``cfg.noise_source``."""
    if not cfg.accounted:
        return sigma
    std = gate_noise_std(num_classes=num_classes, n=n, noise_multiplier=cfg.gate_noise_multiplier)
    noisy = sigma + float(gaussian_noise((), std=std, source=cfg.noise_source, dtype=torch.float64))
    return min(max(noisy, 0.0), math.log(num_classes))
