"""Class-incremental metrics from the accuracy matrix.

acc[i, j] is the accuracy on task j's classes after training task i, a (T, T) matrix that is
finite on and below the diagonal (NaN, or anything: it is ignored, above it: task j is not
learned yet when i < j). Any unit works (fractions or percent); the results share it.

* seen accuracy a_i: the accuracy on all classes seen after task i (:func:`seen_accuracy`);
* average incremental accuracy (1/T) Σ_i a_i (:func:`average_incremental_accuracy`);
* forgetting (Chaudhry et al., ECCV 2018)
  F = (1/(T−1)) Σ_{j<T−1} [max_{i<T−1} acc[i, j] − acc[T−1, j]] (:func:`forgetting`);
* final accuracy a_{T−1} (:func:`final_accuracy`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def _matrix(acc) -> np.ndarray:
    try:
        a = np.asarray(acc, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError("acc must be a (T, T) array of numbers: acc[i, j] = accuracy on task j after task i") from None
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] == 0:
        raise ValueError(
            f"acc must be a non-empty square (T, T) matrix, acc[i, j] = accuracy on task j after "
            f"training task i, got shape {a.shape}"
        )
    lower = np.tril(np.ones(a.shape, dtype=bool))
    bad = lower & ~np.isfinite(a)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise ValueError(
            f"acc[{i}, {j}] is {a[i, j]}; entries on and below the diagonal (j <= i) must be finite "
            "(is the matrix transposed?)"
        )
    return a


def _task_sizes(task_sizes, t: int) -> np.ndarray:
    if task_sizes is None:
        return np.ones(t)
    try:
        s = np.asarray(task_sizes, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"task_sizes must be {t} numbers, got {task_sizes!r}") from None
    if s.shape != (t,) or not np.isfinite(s).all() or (s <= 0).any():
        raise ValueError(f"task_sizes must be {t} finite numbers > 0 (one per task), got {task_sizes!r}")
    return s


def seen_accuracy(*, acc, task_sizes: Sequence[float] | None = None) -> np.ndarray:
    """a_i: the accuracy on all tasks seen after task i, the mean of acc[i, :i+1].

    Parameters
    ----------
    acc:
        (T, T) accuracy matrix.
    task_sizes:
        (T,) optional test-set sizes of the tasks; with them a_i is the size-weighted mean,
        i.e. the accuracy over all seen test samples. Without, the tasks weigh the same.

    Returns
    -------
    np.ndarray
        (T,) float64.
    """
    a = _matrix(acc)
    t = a.shape[0]
    w = _task_sizes(task_sizes, t)
    return np.array([float(a[i, : i + 1] @ w[: i + 1] / w[: i + 1].sum()) for i in range(t)])


def average_incremental_accuracy(*, acc_seen: Sequence[float]) -> float:
    """(1/T) Σ_i a_i, the mean over tasks of the accuracy on all classes seen so far.

    Parameters
    ----------
    acc_seen:
        (T,) a_i, e.g. from :func:`seen_accuracy`.
    """
    try:
        a = np.asarray(acc_seen, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"acc_seen must be a 1-D sequence of numbers, one per task, got {acc_seen!r}") from None
    if a.ndim != 1 or a.size == 0:
        raise ValueError(
            f"acc_seen must be a non-empty 1-D vector, one accuracy per task, got shape {a.shape}; "
            "for the (T, T) matrix use seen_accuracy(acc=...) first"
        )
    if not np.isfinite(a).all():
        raise ValueError("acc_seen has non-finite values; every task's accuracy must be a number")
    return float(a.mean())


def forgetting(*, acc) -> float:
    """Average forgetting after the last task (Chaudhry et al.).

    F = (1/(T−1)) Σ_{j<T−1} [max_{j<=i<T−1} acc[i, j] − acc[T−1, j]]: how far each earlier task
    fell from its best accuracy. Negative values mean backward transfer. With T = 1 there is no
    earlier task and F is NaN (undefined, not 0).

    Parameters
    ----------
    acc:
        (T, T) accuracy matrix.
    """
    a = _matrix(acc)
    t = a.shape[0]
    if t == 1:
        return float("nan")
    drops = [max(a[i, j] for i in range(j, t - 1)) - a[t - 1, j] for j in range(t - 1)]
    return float(np.mean(drops))


def final_accuracy(*, acc, task_sizes: Sequence[float] | None = None) -> float:
    """a_{T−1}: the accuracy on all tasks after the last one (the mean of the last row).

    Parameters
    ----------
    acc:
        (T, T) accuracy matrix.
    task_sizes:
        (T,) optional test-set sizes, as in :func:`seen_accuracy`.
    """
    return float(seen_accuracy(acc=acc, task_sizes=task_sizes)[-1])


__all__ = ["seen_accuracy", "average_incremental_accuracy", "forgetting", "final_accuracy"]
