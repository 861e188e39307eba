"""DPI (dynamic parameter importance, FedPD++ §4.2, Eq. 6–12): how much each parameter matters to a loss.

The importance of a parameter ω to a loss L is ``|∇L(ω) · ω|``. DPI integrates it along the local
optimisation path, ``Σ_t |∇L(ω(t)) · ω(t)| · Δt`` with Δt the learning rate, once for the
closed-set loss and once for the open-set loss. The ``gradient`` ablation keeps only the last
step's ``|∇L · ω|`` (Eq. 7–8). :mod:`fedcore.openset.masks` turns the scores into masks.
"""

from __future__ import annotations

from typing import Dict, Mapping

import torch

from fedcore.registry import check_choice

IMPORTANCE = ("dpi", "gradient", "none")
"""``dpi``: the path integral; ``gradient``: the last step only; ``none``: no scores (plain PROSER)."""

Scores = Dict[str, torch.Tensor]


def empty_scores(params: Mapping[str, torch.Tensor]) -> Dict[str, Scores]:
    """Zero closed- and open-set scores for every parameter, at the start of a round."""
    return {part: {k: torch.zeros_like(p) for k, p in params.items()} for part in ("close", "open")}


def importance_step(
    scores: Dict[str, Scores],
    params: Mapping[str, torch.Tensor],
    *,
    g_close: Mapping[str, torch.Tensor],
    g_open: Mapping[str, torch.Tensor],
    dt: float,
    mode: str,
) -> None:
    """Add one local step to ``scores`` in place: ``|g · ω| · dt`` (``dpi``) or replace by ``|g · ω|`` (``gradient``).

    ``params`` are the weights ω at this step, ``g_close`` and ``g_open`` the two losses' gradients.
    """
    check_choice("importance", mode, IMPORTANCE[:2])
    for k, p in params.items():
        w = p.detach()
        if mode == "dpi":
            scores["close"][k].add_((g_close[k] * w).abs(), alpha=dt)
            scores["open"][k].add_((g_open[k] * w).abs(), alpha=dt)
        else:
            scores["close"][k] = (g_close[k] * w).abs()
            scores["open"][k] = (g_open[k] * w).abs()
