"""Scoring a class-incremental model after a round: accuracy on every class seen so far, and per task.

The model is asked only about the classes it has been taught: logits of classes not seen yet
are masked. After a compression round the model in use is the compressed one (the network's
``phase`` buffer); the numbers are therefore those of the model that carries into the next task.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np
import torch

from fedcore.incremental.losses import masked
from fedcore.tensors import batches, resolve_device, to_tensor


@torch.no_grad()
def incremental_evaluate(
    state: Dict[str, torch.Tensor],
    *,
    spec,
    test: Tuple[np.ndarray, np.ndarray],
    task_classes: Sequence[Sequence[int]],
    device: str = "cpu",
) -> Dict[str, float]:
    """``acc.seen`` (= ``avg_acc``: accuracy over every seen class's test samples), ``acc.task<j>`` for each
    task so far, ``worst_acc`` (the lowest of those) and ``model_task`` (the task the weights hold: behind the
    schedule only when no client could train a whole task).
    """
    dev = resolve_device(device)
    model = spec.build().to(dev)
    model.load_state_dict(state)
    model.eval()
    task = int(state["task"])
    seen = [c for t in task_classes[: task + 1] for c in t]
    x, y = test
    keep = np.isin(y, seen)
    xs, ys = x[keep], y[keep]
    mask = torch.zeros(model.fc.out_features, dtype=torch.bool)
    mask[seen] = True
    preds: List[np.ndarray] = []
    xt = to_tensor(xs, device=dev)
    for sl in batches(len(xt), 512):
        preds.append(masked(model(xt[sl]), mask).argmax(1).cpu().numpy())
    pred = np.concatenate(preds) if preds else np.zeros(0, dtype=np.int64)
    out: Dict[str, float] = {
        "model_task": float(task),
        "acc.seen": float(np.mean(pred == ys)) if len(ys) else float("nan"),
    }
    for j, classes in enumerate(task_classes[: task + 1]):
        sel = np.isin(ys, list(classes))
        out[f"acc.task{j}"] = float(np.mean(pred[sel] == ys[sel])) if sel.any() else float("nan")
    out["avg_acc"] = out["acc.seen"]
    out["worst_acc"] = float(min(out[f"acc.task{j}"] for j in range(task + 1)))
    return out


def task_end_metrics(records: Sequence[Mapping[str, Any]]) -> Dict[str, object]:
    """The class-incremental summary of a run's round records (those with a ``task`` key).

    Each task is scored at its last round (after its compression, if any): row t of the accuracy
    matrix is ``acc.task<j>`` then, and a_t is ``acc.seen``. Returns ``avg_inc_acc`` (the mean of
    a_t over tasks: average incremental accuracy), ``final_acc`` (a_{T−1}), ``forgetting``
    (Chaudhry et al.; NaN with one task), ``acc_seen`` and ``acc_matrix`` (lists, for reports).
    A run stopped before its last task is summarised over the tasks it finished; records not scored by
    :func:`incremental_evaluate` give an empty summary.
    """
    from fedcore.incremental.metrics import average_incremental_accuracy, forgetting

    last: Dict[int, Mapping[str, Any]] = {}
    for rec in records:
        if "task" in rec and "acc.seen" in rec:  # scored by incremental_evaluate (not the engine's default)
            last[int(rec["task"])] = rec
    tasks = sorted(last)
    if not tasks:
        return {}
    t_max = len(tasks)
    acc = np.full((t_max, t_max), np.nan)
    for i, t in enumerate(tasks):
        for j in range(i + 1):  # a task the model never reached (no client could train it) scores 0
            acc[i, j] = float(last[t].get(f"acc.task{j}", 0.0))
    seen = [float(last[t]["acc.seen"]) for t in tasks]
    return {
        "avg_inc_acc": average_incremental_accuracy(acc_seen=seen),
        "final_acc": seen[-1],
        "forgetting": forgetting(acc=acc) if t_max > 1 else float("nan"),
        "acc_seen": seen,
        "acc_matrix": acc.tolist(),
    }
