"""PP-FCIL's server rules as pure numpy functions: multi-factor aggregation weights and
Mahalanobis client selection.

Aggregation weights (one task t, one round; k runs over the clients selected this round):

    ω = Σ_k [a·γ_k + b·(|D_k^t| / |D_t|)·T_k + c·A_k + d·R_k] · ω_k,   (a, b, c, d) = (0.3, 0.5, 0.1, 0.1)

with the bracket normalised to sum 1 over the selected clients, and

* γ_k = tanh(θ_k + α), θ_k = |D_k^t| / Σ_{s≤t} |D_k^s|   (:func:`data_balance`);
* T_k = (e/2)^{−(t − t_k)}, t_k the client's previous round   (:func:`freshness`);
* A_k = β_k / Σ_j β_j, β the clients' accuracies   (:func:`relative_accuracy`);
* R_k = (r_k / r + 1) / 2, r_k the client's participation count   (:func:`participation_factor`).

Client selection: every client reports v_k = [accuracy, loss, Cohen's κ]; its score is its
summed Mahalanobis distance to the others, SD_k = Σ_{j≠k} MD(k, j)
(:func:`mahalanobis_scores`), and the m most outlying clients are picked, after a fairness
floor that forces in every client that has waited ``max_wait`` rounds (:func:`select_clients`).
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import numpy as np

from fedcore.evaluate.metrics import cohen_kappa

DEFAULT_COEFFS: Tuple[float, float, float, float] = (0.3, 0.5, 0.1, 0.1)

SELECTION_REASONS = ("forced", "score", "unseen")


# ---------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------


def _vector(name: str, value, *, nonnegative: bool = True) -> np.ndarray:
    """``value`` as a non-empty, finite, 1-D float64 array (>= 0 when ``nonnegative``)."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a 1-D sequence of numbers, got {value!r}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one entry per client), got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty; pass one entry per client")
    bad = ~np.isfinite(arr)
    if bad.any():
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s) at {np.flatnonzero(bad).tolist()}; "
            "every entry must be a finite number"
        )
    if nonnegative and (arr < 0).any():
        raise ValueError(f"{name} must be >= 0, got negative values at {np.flatnonzero(arr < 0).tolist()}")
    return arr


def _same_length(**arrays: np.ndarray) -> None:
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"{', '.join(lengths)} must have one entry per client each, got lengths "
            f"{', '.join(f'{n}={k}' for n, k in lengths.items())}"
        )


def _int(name: str, value, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


# ---------------------------------------------------------------------------------------------
# the four factors and their combination
# ---------------------------------------------------------------------------------------------


def data_balance(
    *, new_examples: Sequence[float] | np.ndarray, total_examples: Sequence[float] | np.ndarray, alpha: float = 0.0
) -> np.ndarray:
    """γ_k = tanh(θ_k + α): how much of a client's data is new in this task.

    θ_k = |D_k^t| / Σ_{s≤t} |D_k^s| is the share of the client's cumulative data that arrived
    with the current task t. It is 1 in the client's first task and decays as its data
    accumulates, so clients with much new data weigh more.

    Parameters
    ----------
    new_examples:
        (K,) |D_k^t|, the client's example count of the current task.
    total_examples:
        (K,) Σ_{s≤t} |D_k^s|, its cumulative count over all tasks so far, the current one
        included (so ``new_examples <= total_examples``), and > 0.
    alpha:
        α >= 0, a shift that keeps γ away from 0 for clients with little new data.

    Returns
    -------
    np.ndarray
        (K,) float64 γ in [tanh(α), tanh(1 + α)].
    """
    new = _vector("new_examples", new_examples)
    total = _vector("total_examples", total_examples)
    _same_length(new_examples=new, total_examples=total)
    if not math.isfinite(alpha) or alpha < 0:
        raise ValueError(
            f"alpha must be a finite number >= 0 (a negative shift can make γ and the weight negative), got {alpha}"
        )
    if (total <= 0).any():
        raise ValueError(
            f"total_examples must be > 0 for every client, got 0 at "
            f"{np.flatnonzero(total <= 0).tolist()}; leave clients without any data out of the "
            "aggregation"
        )
    over = new > total
    if over.any():
        raise ValueError(
            f"new_examples exceeds total_examples at {np.flatnonzero(over).tolist()}; total_examples "
            "is the cumulative count over all tasks so far and must include the new examples"
        )
    return np.tanh(new / total + alpha)


def freshness(*, round_index: int, last_round: Sequence[int | None]) -> np.ndarray:
    """T_k = (e/2)^{−(t − t_k)}: recent participants weigh more.

    Parameters
    ----------
    round_index:
        t >= 0, the current round.
    last_round:
        (K,) t_k, the round in which each client last took part before this one; ``-1`` or
        ``None`` for a client that never did, which is treated as t_k = t − 1 (fully fresh:
        its model carries no stale update).

    Returns
    -------
    np.ndarray
        (K,) float64 T in (0, 2/e].
    """
    t = _int("round_index", round_index, minimum=0)
    try:
        entries = list(last_round)
    except TypeError:
        raise ValueError(f"last_round must be a sequence with one round per client, got {last_round!r}") from None
    if not entries:
        raise ValueError("last_round is empty; pass one round per client")
    rounds = []
    for k, v in enumerate(entries):
        if v is None:
            rounds.append(t - 1)
            continue
        try:
            whole = not isinstance(v, (bool, np.bool_)) and float(v).is_integer()
        except (TypeError, ValueError):
            whole = False
        if not whole:
            raise ValueError(f"last_round[{k}] must be an integer round, -1 or None, got {v!r}")
        v = int(v)
        if v < -1:
            raise ValueError(f"last_round[{k}] is {v}; use -1 or None for a client that never took part")
        if v >= t:
            raise ValueError(
                f"last_round[{k}] is {v} but the current round is {t}; pass the round the client last "
                "took part in before this one"
            )
        rounds.append(t - 1 if v == -1 else v)
    lag = t - np.asarray(rounds, dtype=np.float64)
    return np.power(math.e / 2.0, -lag)


def relative_accuracy(*, accuracy: Sequence[float]) -> np.ndarray:
    """A_k = β_k / Σ_j β_j over the selected clients; uniform 1/K when every β is 0.

    Parameters
    ----------
    accuracy:
        (K,) β >= 0, each selected client's accuracy (any unit: only ratios matter).

    Returns
    -------
    np.ndarray
        (K,) float64, summing to 1.
    """
    beta = _vector("accuracy", accuracy)
    total = beta.sum()
    return np.full_like(beta, 1.0 / beta.size) if total == 0 else beta / total


def participation_factor(*, counts: Sequence[int] | np.ndarray, selected: Sequence[int] | None = None) -> np.ndarray:
    """R_k = (r_k / r + 1) / 2 with r = Σ_k r_k over all clients.

    Parameters
    ----------
    counts:
        (N,) r_k >= 0, how many rounds each of the N clients has taken part in, the current
        round included (so the total r is > 0).
    selected:
        Optional ids into ``counts``; when given only their factors are returned, in that order.

    Returns
    -------
    np.ndarray
        (N,) float64 R in [1/2, 1] — or (len(selected),) when ``selected`` is given.
    """
    r = _vector("counts", counts)
    total = r.sum()
    if total == 0:
        raise ValueError("counts are all 0; they must include the current round, so the selected clients count >= 1")
    out = (r / total + 1.0) / 2.0
    if selected is None:
        return out
    ids = np.asarray(selected)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"selected must be a 1-D sequence of client ids, got {selected!r}")
    if ids.size and (ids.min() < 0 or ids.max() >= r.size):
        raise ValueError(f"selected ids must be in [0, {r.size}) (one count per client), got {ids.tolist()}")
    return out[ids]


def multifactor_weights(
    *,
    gamma: Sequence[float] | np.ndarray,
    data_share: Sequence[float] | np.ndarray,
    fresh: Sequence[float] | np.ndarray,
    accuracy: Sequence[float] | np.ndarray,
    participation: Sequence[float] | np.ndarray,
    coeffs: Sequence[float] = DEFAULT_COEFFS,
) -> np.ndarray:
    """The aggregation weights a·γ_k + b·s_k·T_k + c·A_k + d·R_k, normalised to sum 1.

    The paper fixes a + b + c + d = 1; because the result is normalised, only the ratios of
    the coefficients matter here, and any non-negative ``coeffs`` with a positive sum are
    accepted. When every client's combined score is 0 (e.g. ``coeffs=(1, 0, 0, 0)`` and all
    γ = 0), the weights are uniform.

    Parameters
    ----------
    gamma:
        (K,) γ from :func:`data_balance`.
    data_share:
        (K,) s_k = |D_k^t| / |D_t|, the client's share of the selected clients' new data.
    fresh:
        (K,) T from :func:`freshness`.
    accuracy:
        (K,) A from :func:`relative_accuracy`.
    participation:
        (K,) R from :func:`participation_factor`.
    coeffs:
        (a, b, c, d), each >= 0, not all 0.

    Returns
    -------
    np.ndarray
        (K,) float64 weights >= 0 summing to 1, in the clients' order.
    """
    factors = {
        name: _vector(name, value)
        for name, value in (
            ("gamma", gamma),
            ("data_share", data_share),
            ("fresh", fresh),
            ("accuracy", accuracy),
            ("participation", participation),
        )
    }
    _same_length(**factors)
    try:
        abcd = np.asarray(coeffs, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"coeffs must be four numbers (a, b, c, d), got {coeffs!r}") from None
    if abcd.shape != (4,):
        raise ValueError(f"coeffs must be four numbers (a, b, c, d), got {coeffs!r}")
    if not np.isfinite(abcd).all() or (abcd < 0).any():
        raise ValueError(f"coeffs must be finite and >= 0, got {tuple(abcd.tolist())}")
    if abcd.sum() == 0:
        raise ValueError("coeffs are all 0; give at least one factor a positive weight, e.g. (0.3, 0.5, 0.1, 0.1)")
    a, b, c, d = abcd
    score = (
        a * factors["gamma"]
        + b * factors["data_share"] * factors["fresh"]
        + c * factors["accuracy"]
        + d * factors["participation"]
    )
    total = score.sum()
    return np.full_like(score, 1.0 / score.size) if total == 0 else score / total


# ---------------------------------------------------------------------------------------------
# Mahalanobis client selection
# ---------------------------------------------------------------------------------------------


def mahalanobis_scores(*, vectors) -> np.ndarray:
    """SD_i = Σ_{j≠i} MD(i, j): each client's summed Mahalanobis distance to the others.

    MD(i, j) = sqrt((v_i − v_j)ᵀ S⁺ (v_i − v_j)), with S the sample covariance (ddof = 1) of
    the clients' vectors and S⁺ its Moore–Penrose pseudo-inverse (:func:`numpy.linalg.pinv`).
    With fewer clients than dimensions, or a metric that is the same for every client, S is
    singular; the pseudo-inverse then ignores the directions in which the clients do not
    spread (differences between clients have no component there). With K <= D + 1 clients in
    general position every MD is sqrt(2(K − 1)) — the points form a regular simplex in the
    metric — so all scores tie and the selection falls to its tie-break: the scores only
    separate clients once more than D + 1 (four, for the paper's three metrics) have vectors.
    The columns are scaled to
    unit standard deviation first: the distance does not change (Mahalanobis distances are
    invariant to rescaling a metric), but the pseudo-inverse's cut-off no longer depends on
    the metrics' units.

    Parameters
    ----------
    vectors:
        (K, D) one row per client; the paper's D = 3 columns are [accuracy, loss, κ]. A row
        of NaN marks a client with no vector yet; its score is +inf (the server knows
        nothing about it, so it is picked first) and it is left out of S and of the others'
        sums. Other rows must be finite.

    Returns
    -------
    np.ndarray
        (K,) float64 scores >= 0 (+inf for the NaN rows); 0 for every client when fewer
        than two have a vector.
    """
    try:
        v = np.asarray(vectors, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError("vectors must be a (K, D) array of numbers, one row per client") from None
    if v.ndim != 2 or v.shape[0] == 0 or v.shape[1] == 0:
        raise ValueError(f"vectors must be a non-empty (K, D) array, one row per client, got shape {v.shape}")
    nan = np.isnan(v)
    unseen = nan.all(axis=1)
    partial = nan.any(axis=1) & ~unseen
    if partial.any():
        raise ValueError(
            f"rows {np.flatnonzero(partial).tolist()} are partly NaN; a row is either all NaN (no vector "
            "yet) or all finite"
        )
    if np.isinf(v).any():
        raise ValueError("vectors has infinite values; every metric must be finite (or the whole row NaN)")
    scores = np.full(v.shape[0], np.inf)
    seen = np.flatnonzero(~unseen)
    if seen.size < 2:
        scores[seen] = 0.0
        return scores
    x = v[seen]
    std = x.std(axis=0, ddof=1)
    x = x / np.where(std > 0, std, 1.0)
    s_pinv = np.linalg.pinv(np.cov(x, rowvar=False, ddof=1).reshape(x.shape[1], x.shape[1]), hermitian=True)
    diff = x[:, None, :] - x[None, :, :]
    md2 = np.einsum("ijd,de,ije->ij", diff, s_pinv, diff)
    scores[seen] = np.sqrt(np.clip(md2, 0.0, None)).sum(axis=1)
    return scores


def select_clients(
    *, scores: Sequence[float] | np.ndarray, m: int, waited: Sequence[int] | np.ndarray, max_wait: int | None
) -> Tuple[List[int], Dict[int, str]]:
    """Pick m clients: the fairness floor first, then the highest scores.

    1. Every client with ``waited >= max_wait`` is forced in, the longest-waiting first (ties
       by lower id); when more than m are due, the m longest-waiting are taken. This floor
       bounds how long a client with a low score can be left out — the rich-get-richer risk
       of picking by score alone.
    2. The remaining slots go to the highest scores (ties by lower id); a +inf score is a
       client with no metrics yet (:func:`mahalanobis_scores`), so unseen clients come first.

    With fixed scores and ``waited`` kept as below, every client is picked at least once in
    every window of ``max_wait + ceil(K / m)`` consecutive rounds.

    Parameters
    ----------
    scores:
        (K,) selection scores, +inf allowed, NaN not.
    m:
        How many clients to pick, 1 <= m <= K.
    waited:
        (K,) rounds each client has sat out since it was last selected (or since the start):
        after every round the caller adds 1 for every client and sets the picked ones to 0.
    max_wait:
        The floor, >= 1; ``None`` disables it (selection by score only).

    Returns
    -------
    tuple[list[int], dict[int, str]]
        The picked ids, sorted, and why each was picked: ``"forced"``, ``"score"`` or
        ``"unseen"`` (picked by score with a +inf score).
    """
    try:
        s = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"scores must be a 1-D sequence of numbers, got {scores!r}") from None
    if s.ndim != 1 or s.size == 0:
        raise ValueError(f"scores must be a non-empty 1-D array, one per client, got shape {s.shape}")
    if np.isnan(s).any():
        raise ValueError(
            f"scores has NaN at {np.flatnonzero(np.isnan(s)).tolist()}; use +inf for a client with no metrics yet"
        )
    w = _vector("waited", waited)
    if not np.all(w == np.round(w)):
        raise ValueError(f"waited must hold whole numbers of rounds, got {w.tolist()}")
    _same_length(scores=s, waited=w)
    k_total = s.size
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 1 <= m <= k_total:
        raise ValueError(f"cannot select m={m!r} clients out of K={k_total}; use an integer 1 <= m <= {k_total}")
    if max_wait is not None:
        max_wait = _int("max_wait", max_wait, minimum=1)

    reasons: Dict[int, str] = {}
    if max_wait is not None:
        due = [k for k in range(k_total) if w[k] >= max_wait]
        due.sort(key=lambda k: (-w[k], k))
        for k in due[:m]:
            reasons[k] = "forced"
    rest = sorted((k for k in range(k_total) if k not in reasons), key=lambda k: (-s[k], k))
    for k in rest[: m - len(reasons)]:
        reasons[k] = "unseen" if s[k] == np.inf else "score"
    picked = sorted(reasons)
    return picked, {k: reasons[k] for k in picked}


__all__ = [
    "DEFAULT_COEFFS",
    "SELECTION_REASONS",
    "data_balance",
    "freshness",
    "relative_accuracy",
    "participation_factor",
    "multifactor_weights",
    "cohen_kappa",
    "mahalanobis_scores",
    "select_clients",
]
