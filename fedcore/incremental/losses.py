"""PP-FCIL's local losses, one value per sample: balanced softmax (L_C), distillation on the old
classes (L_D), the compression loss's feature term (L_M); and the supervised contrastive loss (L_S),
which couples the samples of a batch and so has one value per batch.

Logits always span every class of the schedule; ``seen`` (a bool mask over them) keeps the
classes seen so far, so the one classifier grows with the tasks without changing shape.
Per-sample values let the private trainer clip each sample's gradient (torch.func).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

NEG = -1e9  # a logit that softmax turns into 0, finite so that 0 · NEG stays 0 in gradients


def masked(logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Logits with the classes not seen yet pushed to ``NEG``."""
    return logits.masked_fill(~seen.to(logits.device), NEG)


def log_prior(counts: torch.Tensor) -> torch.Tensor:
    """log n_c per class, with ``NEG`` for a class with no samples (it drops out of the softmax)."""
    prior = torch.log(counts.double().clamp_min(0)).float()
    return torch.where(torch.isfinite(prior), prior, torch.full_like(prior, NEG))


def classification(
    logits: torch.Tensor, y: torch.Tensor, *, seen: torch.Tensor, prior: torch.Tensor | None = None
) -> torch.Tensor:
    """(B,) cross-entropy over the seen classes; with ``prior`` = :func:`log_prior` of the client's class
    counts it is the balanced softmax of Ren et al. 2020, softmax_b(z)_i = n_i e^{z_i} / Σ_j n_j e^{z_j}
    (PP-FCIL's L_C). A seen class with no local samples drops out of the denominator: the client
    has no evidence about it either way. Without ``prior``: plain cross-entropy (the −L_C ablation).
    """
    z = masked(logits, seen)
    if prior is not None:
        z = z + prior.to(z.device)
    return F.cross_entropy(z, y, reduction="none")


def distillation(
    student: torch.Tensor, teacher: torch.Tensor, *, old: torch.Tensor, temperature: float
) -> torch.Tensor:
    """(B,) τ² · KL(p_teacher ‖ p_student) over the old classes only, both softened by τ (Hinton et al.)."""
    old = old.to(student.device)
    s = F.log_softmax(student[:, old] / temperature, 1)
    t = F.log_softmax(teacher[:, old] / temperature, 1)
    return temperature**2 * (t.exp() * (t - s)).sum(1)


def feature_match(f_teacher: torch.Tensor, f_student: torch.Tensor) -> torch.Tensor:
    """(B,) ‖F_mix − F_single‖² / d: L_M's feature term, divided by the width d so λ₀ does not depend on the
    backbone."""
    return ((f_teacher.detach() - f_student) ** 2).mean(1)


def supcon(z: torch.Tensor, y: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """Supervised contrastive loss (Khosla et al. 2020, L_out) over every view in the batch.

    z: (M, d) projections (normalised here), y: (M,) labels; each anchor's positives are the
    other views with its label. Anchors without a positive are left out.
    """
    z = F.normalize(z, dim=1)
    sim = z @ z.t() / temperature
    eye = torch.eye(len(z), dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(eye, NEG)
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    pos = (y[:, None] == y[None, :]) & ~eye
    n_pos = pos.sum(1)
    keep = n_pos > 0
    if not bool(keep.any()):
        return z.sum() * 0.0
    mean_log_prob = (log_prob * pos).sum(1)[keep] / n_pos[keep]
    return -mean_log_prob.mean()
