"""Open-set recognition metrics: AUROC, OSCR, and the unknown scores of MSP and PROSER.

One convention holds in every function here: a *score* is an **unknown score**, higher means
more likely unknown. A scorer whose natural output is a confidence (the maximum softmax
probability) is negated to fit it.

Ties are counted half everywhere, so the two curve metrics agree: with every known sample
correctly classified, :func:`oscr` equals :func:`auroc` exactly, ties included.
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import torch


def as_numpy(a: Any) -> np.ndarray:
    """``a`` (a tensor, array or list) as a NumPy array on the CPU; half precision is widened to float64."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        return (a.double() if a.dtype in (torch.float16, torch.bfloat16) else a).numpy()
    return np.asarray(a)


def _scores(a: Any, name: str) -> np.ndarray:
    """A 1-D, non-empty, finite float64 array, or a ValueError that names ``name``."""
    s = as_numpy(a)
    if s.ndim != 1:
        raise ValueError(
            f"{name} must be 1-D (one score per sample), got shape {s.shape}; flatten it or pass one score per sample"
        )
    if s.size == 0:
        raise ValueError(f"{name} is empty; the metric needs at least one sample on each side")
    if not np.issubdtype(s.dtype, np.number) or np.issubdtype(s.dtype, np.complexfloating):
        raise ValueError(f"{name} must hold real numbers, got dtype {s.dtype}")
    s = s.astype(np.float64)
    bad = int((~np.isfinite(s)).sum())
    if bad:
        raise ValueError(
            f"{name} has {bad} non-finite value(s) (NaN or inf); the model or scorer diverged: "
            "fix it, or drop those samples knowingly before scoring"
        )
    return s


def check_logits(logits: Any, name: str = "logits", *, min_classes: int = 1) -> np.ndarray:
    """``logits`` as a 2-D (N, C) NumPy array with C >= ``min_classes``; anything else is a ValueError naming
    ``name``."""
    z = as_numpy(logits)
    if z.ndim != 2 or z.shape[1] < min_classes:
        raise ValueError(f"{name} must be 2-D (N, C) with C >= {min_classes}, got shape {z.shape}")
    z = z.astype(np.float64)
    if not np.isfinite(z).all():
        raise ValueError(f"{name} has non-finite values (NaN or inf); the model diverged: fix it before scoring")
    return z


def auroc(score_known: Any, score_unknown: Any) -> float:
    """Area under the ROC curve of separating unknown (positive) from known (negative) samples.

    Equal to ``sklearn.metrics.roc_auc_score`` with label 1 for unknown samples, computed from
    average ranks (the Mann-Whitney U statistic), so a tie between a known and an unknown score
    counts half.

    Parameters
    ----------
    score_known : array-like, shape (n_known,)
        Unknown scores of the known-class test samples (higher = more likely unknown).
    score_unknown : array-like, shape (n_unknown,)
        Unknown scores of the unknown-class test samples.

    Returns
    -------
    float
        ``P(s_u > s_k) + 0.5 * P(s_u == s_k)`` over all known/unknown pairs, in [0, 1]; 1.0 when
        every unknown scores above every known, 0.5 for a random scorer.

    Raises
    ------
    ValueError
        If either array is empty, not 1-D, or holds a non-finite value.
    """
    sk = _scores(score_known, "score_known")
    su = _scores(score_unknown, "score_unknown")
    from scipy.stats import rankdata  # here, not at import: scipy.stats costs 1.5 s to import, on every Ray worker

    ranks = rankdata(np.concatenate([sk, su]), method="average")
    nk, nu = len(sk), len(su)
    u = ranks[nk:].sum() - nu * (nu + 1) / 2.0
    return float(u / (nk * nu))


def oscr(score_known: Any, correct: Any, score_unknown: Any) -> float:
    """Open-Set Classification Rate (Dhamija et al., 2018): area under CCR against FPR.

    A sample is **accepted as known when its score <= θ**. θ sweeps every distinct score (of
    either side) from below, starting below the smallest one (nothing accepted):

    - ``CCR(θ)``: fraction of known samples that are accepted *and* correctly classified;
    - ``FPR(θ)``: fraction of unknown samples accepted.

    A known and an unknown sample with the same score are accepted at the same θ, so the curve
    moves diagonally between them and the trapezoid counts the pair half, as :func:`auroc` does;
    the curve is then a function of the scores alone (not of their order in the arrays). It runs
    from (0, 0) to (1, closed-set accuracy); the area is taken with the trapezoid rule, which
    equals ``mean over (known k, unknown u) of correct_k * (1[s_u > s_k] + 0.5 * 1[s_u == s_k])``.

    Parameters
    ----------
    score_known : array-like, shape (n_known,)
        Unknown scores of the known-class test samples.
    correct : array-like of bool, shape (n_known,)
        Whether each known sample's closed-set prediction is right (bool, or 0/1).
    score_unknown : array-like, shape (n_unknown,)
        Unknown scores of the unknown-class test samples.

    Returns
    -------
    float
        OSCR in [0, closed-set accuracy]: 1.0 with perfect separation and every known sample
        correct, 0.0 when every known sample is misclassified. With every known sample correct it
        equals :func:`auroc`.

    Raises
    ------
    ValueError
        If an array is empty or non-finite, or ``correct`` is not boolean or its length differs.
    """
    sk = _scores(score_known, "score_known")
    su = _scores(score_unknown, "score_unknown")
    ok = as_numpy(correct)
    if ok.shape != sk.shape:
        raise ValueError(f"correct must have one entry per known sample, shape {sk.shape}, got {ok.shape}")
    if ok.dtype != np.bool_:
        if not np.issubdtype(ok.dtype, np.number) or not np.isin(ok, (0, 1)).all():
            raise ValueError("correct must be boolean (or 0/1): pass pred == y for the known samples")
        ok = ok.astype(bool)
    thetas = np.unique(np.concatenate([sk, su]))  # sorted distinct thresholds
    sorted_correct = np.sort(sk[ok])
    sorted_unknown = np.sort(su)
    # side="right": a score equal to θ is accepted (score <= θ).
    ccr = np.searchsorted(sorted_correct, thetas, side="right") / len(sk)
    fpr = np.searchsorted(sorted_unknown, thetas, side="right") / len(su)
    ccr = np.concatenate([[0.0], ccr])
    fpr = np.concatenate([[0.0], fpr])
    return float(np.sum(np.diff(fpr) * (ccr[1:] + ccr[:-1]) / 2.0))


def msp_score(logits: Any) -> np.ndarray:
    """Maximum-softmax-probability unknown score: ``-max_c softmax(logits)_c``.

    Parameters
    ----------
    logits : numpy.ndarray or torch.Tensor, shape (N, C)
        Closed-set logits.

    Returns
    -------
    numpy.ndarray
        float64 (N,), in [-1, -1/C]; higher = less confident = more likely unknown.
    """
    z = check_logits(logits)
    z = z - z.max(axis=1, keepdims=True)  # the max softmax is then 1 / sum(exp(z)), overflow-free
    return -1.0 / np.exp(z).sum(axis=1)


def proser_score(logits: Any) -> np.ndarray:
    """PROSER unknown score: the dummy logit minus the largest known logit.

    For a PROSER model whose **last** logit is the dummy (unknown) class, the score is
    ``logits[:, -1] - logits[:, :-1].max(1)``.

    PROSER's official evaluation calibrates with a softmax at temperature ``T = 1024`` and scores
    ``p_dummy - max p_known``. That difference is ``(exp(z_d / T) - exp(z_m / T)) / Z`` with ``z_m``
    the largest known logit: it has the sign of ``z_d - z_m``, and ``T * C * (p_dummy - max
    p_known) -> z_d - z_m`` as ``T -> ∞``. So the logit difference is the large-temperature limit
    of the official score and ranks samples the same way in that limit (at ``T = 1024`` up to
    second-order terms in ``1/T``); AUROC and OSCR use only the ranking.

    Parameters
    ----------
    logits : numpy.ndarray or torch.Tensor, shape (N, K + 1)
        K known-class logits followed by the dummy logit.

    Returns
    -------
    numpy.ndarray
        float64 (N,); higher = more likely unknown.

    See Also
    --------
    proser_predict : the closed-set label of a PROSER model (argmax over the known logits only).
    """
    z = check_logits(logits, min_classes=2)
    return z[:, -1] - z[:, :-1].max(axis=1)


def proser_predict(logits: Any) -> np.ndarray:
    """Closed-set label of a PROSER model: argmax over the known logits ``logits[:, :-1]``.

    Returns
    -------
    numpy.ndarray
        int64 (N,) in ``0..K-1``; the dummy class is never predicted.
    """
    z = check_logits(logits, min_classes=2)
    return z[:, :-1].argmax(axis=1).astype(np.int64)


def open_set_metrics(pred: Any, y: Any, score_known: Any, score_unknown: Any) -> Dict[str, float]:
    """Closed-set accuracy, AUROC and OSCR of one model on one known / unknown test pair.

    Parameters
    ----------
    pred, y : array-like of int, shape (n_known,)
        Closed-set predictions and true labels of the known-class test samples.
    score_known : array-like, shape (n_known,)
        Unknown scores of the same known-class samples.
    score_unknown : array-like, shape (n_unknown,)
        Unknown scores of the unknown-class test samples.

    Returns
    -------
    dict
        ``{"closed_acc": float, "auroc": float, "oscr": float}``.
    """
    p, t = as_numpy(pred), as_numpy(y)
    n = _scores(score_known, "score_known").shape
    if p.shape != n or t.shape != n:
        raise ValueError(
            f"pred, y and score_known must describe the same known samples: shapes {p.shape}, {t.shape}, {n}"
        )
    correct = p == t
    return {
        "closed_acc": float(correct.mean()),
        "auroc": auroc(score_known, score_unknown),
        "oscr": oscr(score_known, correct, score_unknown),
    }


__all__ = ["auroc", "oscr", "msp_score", "proser_score", "proser_predict", "open_set_metrics"]
