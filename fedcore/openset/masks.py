"""FedPD++'s local parameter disentanglement: importance scores, soft masks and the three parts (§4.2, §4.3).

* **Importance** of a parameter to a loss is ``|∇L(ω) · ω|`` (Eq. 6–8). DPI integrates it along
  the local optimisation path, ``Σ_t |∇L(ω(t)) · ω(t)| · Δt`` (Eq. 12), once for the closed-set
  loss and once for the open-set loss; the plain-gradient ablation keeps only the last step.
* **Scores to [0, 1].** The paper thresholds scores at δ = 0.5 … 0.8 and, below the threshold,
  uses "the score" itself as the soft mask value (Eq. 13), so scores must live in [0, 1]; it also
  says the hard mask keeps a *ratio* 0.5 of the parameters. Both hold if a score is its
  quantile within its tensor (``norm="rank"``): δ = 0.5 keeps the top half, exactly the paper's
  ratio. ``norm="max"`` (score / max of the tensor) is the other reading, kept switchable.
* **Masks.** Hard: ``1[q > 0.5]``. Soft (ASM, Eq. 13): 1 above ``δ_soft``, else ``q``, with
  ``δ_soft = δ_0 + (t / T)(δ_T − δ_0)`` rising from 0.5 to 0.8 over the rounds.
* **Parts** (Eq. 14–16): ``share = M_open ⊙ M_close``, ``close = M_close − share``,
  ``open = M_open − share``; we add ``rest = 1 − (close + open + share)``, the parameters
  neither subnetwork claims, so that the parts sum to 1 and averaging them loses no weight.
"""

from __future__ import annotations

from typing import Dict, Mapping

import torch

from fedcore.registry import check_choice

Scores = Dict[str, torch.Tensor]

MASK_MODES = ("soft", "hard")
SCORE_NORMS = ("rank", "max")
PART_MODES = ("three", "two", "none")


def normalise(score: torch.Tensor, *, norm: str = "rank") -> torch.Tensor:
    """Scores of one tensor mapped to [0, 1]: their quantile (ties share the mean rank), or score / max."""
    check_choice("score norm", norm, SCORE_NORMS)
    flat = score.detach().flatten().double()
    n = flat.numel()
    if norm == "max":
        top = float(flat.max()) if n else 0.0
        return (score.double() / top).float() if top > 0 else torch.zeros_like(score, dtype=torch.float32)
    if n == 1:
        return torch.full_like(score, 0.5, dtype=torch.float32)
    order = torch.argsort(flat, stable=True)
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = torch.arange(n, dtype=torch.float64)
    # ties share their mean rank, so parameters that never moved (score 0) are not split arbitrarily
    uniq, inverse = torch.unique(flat, return_inverse=True)
    if len(uniq) < n:
        sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, ranks)
        counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, torch.ones(n, dtype=torch.float64))
        ranks = (sums / counts)[inverse]
    return (ranks / (n - 1)).reshape(score.shape).float()


def delta_soft(round_index: int, rounds: int, *, delta0: float = 0.5, delta_end: float = 0.8) -> float:
    """ASM's threshold at round ``round_index`` (0-based) of ``rounds``: δ_0 in the first round, δ_T in the last."""
    if rounds < 1:
        raise ValueError(f"the mask schedule needs rounds >= 1, got {rounds}")
    frac = 1.0 if rounds == 1 else min(max(round_index, 0), rounds - 1) / (rounds - 1)
    return delta0 + frac * (delta_end - delta0)


def make_mask(q: torch.Tensor, *, mode: str, delta: float) -> torch.Tensor:
    """A mask from normalised scores ``q``: hard ``1[q > 0.5]``; soft 1 above ``delta``, else ``q``."""
    if mode == "hard":
        return (q > 0.5).float()
    if mode == "soft":
        return torch.where(q > delta, torch.ones_like(q), q)
    raise ValueError(f"unknown mask mode {mode!r}; use one of {', '.join(MASK_MODES)}")


def masks_from_scores(
    scores: Mapping[str, torch.Tensor], *, mode: str, delta: float, norm: str = "rank"
) -> Dict[str, torch.Tensor]:
    return {k: make_mask(normalise(v, norm=norm), mode=mode, delta=delta) for k, v in scores.items()}


def split_parts(
    m_close: Mapping[str, torch.Tensor], m_open: Mapping[str, torch.Tensor], *, mode: str = "three"
) -> Dict[str, Dict[str, torch.Tensor]]:
    """The parts each model is cut into before alignment, as masks keyed like the parameters.

    ``three`` (FedPD++): close-specific, open-specific, shared, and the rest; they sum to 1.
    ``two`` (the paper's "two subnetworks" ablation): M_close, M_open and the rest; the shared
    parameters count twice, which the mask-weighted average of :func:`fedcore.openset.gdca.fuse` divides out.
    ``none``: the whole model as one part.
    """
    check_choice("parts", mode, PART_MODES)
    if mode == "none":
        return {"whole": {k: torch.ones_like(v) for k, v in m_close.items()}}
    if set(m_close) != set(m_open):
        raise ValueError(
            "the closed-set and open-set masks cover different parameters; both must mask every parameter of the model"
        )
    share = {k: m_close[k] * m_open[k] for k in m_close}
    rest = {k: (1 - m_close[k]) * (1 - m_open[k]) for k in m_close}
    if mode == "two":
        return {"close": dict(m_close), "open": dict(m_open), "rest": rest}
    return {
        "close": {k: m_close[k] - share[k] for k in m_close},
        "open": {k: m_open[k] - share[k] for k in m_open},
        "share": share,
        "rest": rest,
    }
