"""Evaluation metrics for sequential arrivals."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from fedcore.tensors import batches, to_tensor


@contextmanager
def batch_statistics(model: nn.Module, enabled: bool = True) -> Iterator[nn.Module]:
    """Eval mode, except that BatchNorm layers normalise with each batch's own statistics.

    This is how the test-time methods that use batch statistics (BN, Tent, BPA, ...) predict.
    The running statistics are left as they were; the layers' modes are restored on exit.
    With ``enabled=False`` this is plain eval mode.
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    saved = []
    if enabled:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                saved.append((m, m.momentum))
                m.train()
                m.momentum = 0.0  # normalise with batch statistics, leave the running ones unchanged
    try:
        yield model
    finally:
        for m, momentum in saved:
            m.momentum = momentum
        for m, training in modes:
            m.training = training


@torch.no_grad()
def predict(
    model: nn.Module,
    x: np.ndarray,
    *,
    batch_size: int = 512,
    device: torch.device | str = "cpu",
    batch_stats: bool = False,
) -> np.ndarray:
    """Class predictions of ``model``, shape (N,).

    Eval mode, except that with ``batch_stats`` BatchNorm layers normalise with the statistics
    of each evaluation batch of ``batch_size`` (the transductive test-time protocol of BN/Tent:
    score with the batch size the stream adapts with). Those batches are drawn in one fixed
    random order, so a set stored sorted by class is not scored in single-class batches; the
    predictions come back in ``x``'s order. The model's running statistics are left as they were.
    """
    order = np.random.default_rng(0).permutation(len(x)) if batch_stats else np.arange(len(x))
    out = []
    with batch_statistics(model, batch_stats):
        for sl in batches(len(x), batch_size):
            out.append(model(to_tensor(x[order[sl]], device=device)).argmax(1).cpu())
    model.eval()
    if not out:
        return np.zeros(0, dtype=np.int64)
    pred = np.empty(len(x), dtype=np.int64)
    pred[order] = torch.cat(out).numpy()
    return pred


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray, **kw) -> float:
    if len(y) == 0:
        raise ValueError("accuracy of an empty set is undefined")
    return float((predict(model, x, **kw) == np.asarray(y)).mean())


def forgetting(acc_matrix: np.ndarray, last_visit: Sequence[int]) -> float:
    """Mean drop on earlier domains between their last visit and the end.

    Parameters
    ----------
    acc_matrix:
        (A, K) accuracy of the global model after arrival a on domain j's hold-out.
    last_visit:
        For each domain j, the arrival index of its last visit.

    Returns
    -------
    float
        mean over j whose last visit is not the final arrival of
        ``acc[last_visit[j], j] - acc[-1, j]`` (positive = forgotten); 0.0 with one domain.
    """
    final = acc_matrix.shape[0] - 1
    drops = [acc_matrix[a, j] - acc_matrix[final, j] for j, a in enumerate(last_visit) if a != final]
    return float(np.mean(drops)) if drops else 0.0


def _labels(name: str, value, num_classes: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integer class labels, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= num_classes):
        raise ValueError(f"{name} has labels outside [0, {num_classes}); raise num_classes or fix the labels")
    return arr.astype(np.int64)


def cohen_kappa(*, y_true: Sequence[int] | np.ndarray, y_pred: Sequence[int] | np.ndarray, num_classes: int) -> float:
    """Cohen's κ = (p_o − p_e) / (1 − p_e) of predictions against labels.

    p_o is the observed agreement (the accuracy) and p_e = Σ_c P(true = c)·P(pred = c) the
    agreement expected by chance. When p_e = 1 (labels and predictions are one and the same
    single class) κ is 0/0; it is defined as 0 here.

    Parameters
    ----------
    y_true, y_pred:
        (n,) integer labels in [0, num_classes), n >= 1.
    num_classes:
        The number of classes, >= 1.

    Returns
    -------
    float
        κ in [−1, 1].
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)):
        raise ValueError(f"num_classes must be an integer, got {num_classes!r}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    c = int(num_classes)
    yt, yp = _labels("y_true", y_true, c), _labels("y_pred", y_pred, c)
    if yt.size != yp.size:
        raise ValueError(f"y_true and y_pred must have the same length, got {yt.size} and {yp.size}")
    if yt.size == 0:
        raise ValueError("y_true and y_pred are empty; κ needs at least one prediction")
    n = float(yt.size)
    confusion = np.bincount(yt * c + yp, minlength=c * c).reshape(c, c).astype(np.float64)
    p_o = np.trace(confusion) / n
    p_e = float(confusion.sum(axis=1) @ confusion.sum(axis=0)) / (n * n)
    if p_e >= 1.0:
        return 0.0
    return float((p_o - p_e) / (1.0 - p_e))
