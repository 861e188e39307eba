"""iCaRL's herding selection and a fixed-size per-client exemplar memory.

Herding (Rebuffi et al., iCaRL, CVPR 2017, Alg. 4): with μ the class mean of the features φ,

    p_k = argmin_x ‖μ − (1/k) (φ(x) + Σ_{j<k} φ(p_j))‖,   without replacement,

so the running mean of the first k exemplars tracks μ as closely as a greedy choice can: the
first pick is the sample nearest the mean, and after all n picks the running mean is μ.

The memory keeps the raw samples (not features) of every class seen, at most ``capacity`` in
all: m = min(per_class, capacity // classes) per class, iCaRL's rule, so as classes accumulate
each keeps fewer, dropping its last-herded exemplars first.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

import numpy as np
import torch


def herding(*, features, m: int, normalize: bool = True) -> np.ndarray:
    """Indices of the samples iCaRL's herding picks, in the order picked.

    Parameters
    ----------
    features:
        (n, D) features φ(x) of one class's n >= 1 samples (numpy or a CPU tensor).
    m:
        How many to pick, >= 1; with m > n all n are returned, in herding order.
    normalize:
        L2-normalise each feature row first (iCaRL's φ); μ is then the mean of the
        normalised rows. A zero row stays zero.

    Returns
    -------
    np.ndarray
        (min(m, n),) int64 indices into ``features``, distinct. Ties go to the lower index.
    """
    if isinstance(features, torch.Tensor):
        features = features.detach().cpu().numpy()
    try:
        phi = np.asarray(features, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError("features must be an (n, D) array of numbers, one row per sample") from None
    if phi.ndim != 2 or phi.shape[0] == 0 or phi.shape[1] == 0:
        raise ValueError(f"features must be a non-empty (n, D) array, one row per sample, got shape {phi.shape}")
    if not np.isfinite(phi).all():
        raise ValueError("features has non-finite values; herding needs finite features")
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
        raise ValueError(f"m (exemplars to pick) must be an integer >= 1, got {m!r}")
    if normalize:
        norms = np.linalg.norm(phi, axis=1, keepdims=True)
        phi = phi / np.where(norms > 0, norms, 1.0)
    n = phi.shape[0]
    mu = phi.mean(axis=0)
    running = np.zeros_like(mu)
    taken = np.zeros(n, dtype=bool)
    order = np.empty(min(int(m), n), dtype=np.int64)
    for k in range(1, order.size + 1):
        dist = np.linalg.norm(mu - (running + phi) / k, axis=1)
        dist[taken] = np.inf
        pick = int(np.argmin(dist))
        order[k - 1] = pick
        taken[pick] = True
        running += phi[pick]
    return order


def _checkpointable(dtype: np.dtype) -> bool:
    try:
        torch.from_numpy(np.zeros(0, dtype=dtype))
    except TypeError:
        return False
    return dtype.kind in "biuf"


class ExemplarMemory:
    """A fixed-size memory of raw samples per class, filled in herding order.

    Parameters
    ----------
    capacity:
        The most samples the memory holds in all, >= 1.
    per_class:
        The most exemplars one class keeps, 1 <= per_class <= capacity. Each class keeps
        min(per_class, capacity // number_of_classes_stored).
    """

    def __init__(self, *, capacity: int, per_class: int = 20) -> None:
        for name, value in (("capacity", capacity), ("per_class", per_class)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if per_class > capacity:
            raise ValueError(
                f"m exemplars per class larger than the memory: per_class={per_class} > "
                f"capacity={capacity}; lower per_class or raise capacity"
            )
        self.capacity = int(capacity)
        self.per_class = int(per_class)
        self._store: Dict[int, np.ndarray] = {}

    # -- queries ---------------------------------------------------------------------------

    def quota_for(self, num_classes: int) -> int:
        """min(per_class, capacity // num_classes): the exemplars each of num_classes classes keeps."""
        return min(self.per_class, self.capacity // max(1, int(num_classes)))

    @property
    def quota(self) -> int:
        """The per-class limit with the classes stored now."""
        return self.quota_for(len(self._store))

    @property
    def classes(self) -> List[int]:
        """The stored classes, sorted."""
        return sorted(self._store)

    def __len__(self) -> int:
        return sum(len(v) for v in self._store.values())

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored samples."""
        return sum(v.nbytes for v in self._store.values())

    def data(self) -> Tuple[np.ndarray, np.ndarray]:
        """Every stored sample and its class.

        Returns
        -------
        tuple[np.ndarray, np.ndarray]
            x (N, ...) in class order, each class in herding order, and y (N,) int64;
            (0,)-shaped arrays when the memory is empty. Copies, not views.
        """
        if not self._store:
            return np.zeros(0), np.zeros(0, dtype=np.int64)
        classes = self.classes
        x = np.concatenate([self._store[c] for c in classes], axis=0)
        y = np.concatenate([np.full(len(self._store[c]), c, dtype=np.int64) for c in classes])
        return x, y

    # -- updates ---------------------------------------------------------------------------

    def update(self, *, cls: int, x, order) -> None:
        """Store class ``cls``'s samples ``x[order]`` (first-herded first), within the quota.

        A class already stored is replaced. Adding a class lowers the quota of every class,
        which drops their last-herded exemplars.

        Parameters
        ----------
        cls:
            The class label, an integer.
        x:
            (n, ...) the class's raw samples (numpy or a CPU tensor), a numeric dtype; every
            class's samples must have the same per-sample shape.
        order:
            1-D distinct indices into ``x``, in herding order (from :func:`herding`).
        """
        if isinstance(cls, bool) or not isinstance(cls, (int, np.integer)):
            raise ValueError(f"cls must be an integer class label, got {cls!r}")
        cls = int(cls)
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().numpy()
        x = np.asarray(x)
        if x.ndim < 1 or x.shape[0] == 0:
            raise ValueError(f"x must be an (n, ...) array with n >= 1 samples, got shape {x.shape}")
        if not _checkpointable(x.dtype):
            raise ValueError(
                f"x has dtype {x.dtype}, which cannot be checkpointed as a tensor; convert it to a "
                "numeric dtype such as float32 or uint8"
            )
        if isinstance(order, torch.Tensor):
            order = order.detach().cpu().numpy()
        idx = np.asarray(order)
        if idx.ndim != 1 or idx.size == 0 or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"order must be a non-empty 1-D array of integer indices into x, got {order!r}")
        if idx.min() < 0 or idx.max() >= x.shape[0]:
            raise ValueError(f"order has indices outside [0, {x.shape[0]}) (x has {x.shape[0]} samples)")
        if np.unique(idx).size != idx.size:
            raise ValueError("order repeats an index; pass distinct indices, e.g. from herding()")
        others = [v for c, v in self._store.items() if c != cls]
        if others and others[0].shape[1:] != x.shape[1:]:
            raise ValueError(
                f"x's samples have shape {x.shape[1:]} but the memory holds samples of shape {others[0].shape[1:]}"
            )
        num_classes = len(others) + 1
        q = self.quota_for(num_classes)
        if q < 1:
            raise ValueError(
                f"a memory of capacity {self.capacity} cannot keep one exemplar for each of "
                f"{num_classes} classes; raise capacity to at least {num_classes}"
            )
        self._store[cls] = x[idx[:q]].copy()
        for c in self._store:
            self._store[c] = self._store[c][:q]

    # -- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> Dict[str, object]:
        """Plain ints, lists and tensors only, so ``torch.load(weights_only=True)`` reads it back."""
        classes = self.classes
        return {
            "capacity": self.capacity,
            "per_class": self.per_class,
            "classes": classes,
            "exemplars": [torch.from_numpy(np.ascontiguousarray(self._store[c])).clone() for c in classes],
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> "ExemplarMemory":
        """The memory a :meth:`state_dict` describes (its tensors copied to numpy)."""
        missing = {"capacity", "per_class", "classes", "exemplars"} - set(state)
        if missing:
            raise ValueError(f"not an ExemplarMemory state_dict: missing {', '.join(sorted(missing))}")
        memory = cls(capacity=state["capacity"], per_class=state["per_class"])
        classes, exemplars = list(state["classes"]), list(state["exemplars"])
        if len(classes) != len(exemplars) or len(set(classes)) != len(classes):
            raise ValueError("state_dict 'classes' must be distinct and match 'exemplars' one to one")
        q = memory.quota_for(len(classes))
        for c, t in zip(classes, exemplars):
            arr = t.detach().cpu().numpy().copy() if isinstance(t, torch.Tensor) else np.asarray(t).copy()
            if arr.ndim < 1 or len(arr) > q:
                raise ValueError(
                    f"state_dict class {c} holds {len(arr) if arr.ndim else 0} exemplars; "
                    f"{len(classes)} classes in a memory of capacity {memory.capacity} keep at most {q}"
                )
            memory._store[int(c)] = arr
        shapes = {v.shape[1:] for v in memory._store.values()}
        if len(shapes) > 1:
            raise ValueError(f"state_dict exemplars have different sample shapes: {sorted(map(str, shapes))}")
        return memory


__all__ = ["herding", "ExemplarMemory"]
