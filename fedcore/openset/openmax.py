"""OpenMax (Bendale & Boult, CVPR 2016) as an unknown scorer fitted on training logits.

OpenMax replaces the softmax layer of a trained classifier. From the training set it keeps,
per class, the mean activation vector (MAV) of the correctly classified samples and a Weibull
model of how far those samples lie from it (extreme-value theory on the largest distances). At
test time the top ``alpha`` logits are shrunk by how far the sample lies outside their class's
distribution, and the mass taken from them becomes the logit of an extra *unknown* class.

Ambiguities of the paper and of the authors' code (``abhijitbendale/OSDN``), and how this file
settles them:

- **Activation vector.** The logits (the authors' ``fc8``), one vector per image (no ten-crop
  averaging: a federated client scores what it is given).
- **Distance.** ``"eucos"`` = euclidean / 200 + cosine distance, as the authors' code; or
  ``"euclidean"``. The cosine distance of a zero vector (undefined) is taken as 1 (orthogonal).
- **Weibull fit.** Per class, the ``tail_size`` largest distances of its correctly classified
  training samples (all of them if fewer) are fitted by maximum likelihood with
  ``scipy.stats.weibull_min.fit(tail, floc=0)``: a two-parameter Weibull with location fixed at
  0, whose CDF ``1 - exp(-(d / scale) ** shape)`` is the weight ``w_c(d)``. This is *not* libMR's
  ``FitHigh``, which first translates the tail (``d + 10000 - min(tail)``) and evaluates the CDF
  on the translated distance; the translation only moves where the CDF rises, and a zero
  location keeps ``w(0) = 0`` and the fit independent of an arbitrary constant. Distances of
  exactly 0 (a sample at its MAV) are left out of the tail: they carry no tail information and
  make the log-likelihood ``-inf``.
- **Revision.** With classes ranked by logit (highest first; ties by lower class index), the
  class of rank ``r`` (0-based) gets ``alpha_weight = (alpha - r) / alpha`` for ``r < alpha`` and 0
  after. Each logit becomes ``v_c * (1 - w_c * alpha_weight_c)`` and the unknown logit is the sum
  of what was removed, ``sum_c v_c * w_c * alpha_weight_c``, as in the paper's Algorithm 2 and the
  authors' code (a negative logit is therefore *raised*; this is kept, not patched).
- **Output.** The softmax over the ``C`` revised logits and the unknown logit. :meth:`OpenMax.score`
  returns the unknown probability (no threshold ``epsilon``: the open-set metrics sweep it);
  :meth:`OpenMax.predict` the argmax over the ``C`` revised known probabilities, the closed-set
  label OpenMax itself gives. The base network's label is ``logits.argmax(1)``.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from fedcore.openset.metrics import as_numpy, check_logits

DISTANCES = ("eucos", "euclidean")
EUCOS_EUCLIDEAN_SCALE = 200.0  # the authors' eucos divides the euclidean distance by 200


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def pairwise_distance(z: np.ndarray, centres: np.ndarray, *, distance: str = "eucos") -> np.ndarray:
    """Distance of every row of ``z`` to every centre.

    Parameters
    ----------
    z : numpy.ndarray
        (N, D) activation vectors.
    centres : numpy.ndarray
        (M, D) mean activation vectors.
    distance : {"eucos", "euclidean"}
        ``"eucos"``: ``euclidean / 200 + (1 - cosine similarity)``; a zero vector has cosine
        similarity 0 with everything.

    Returns
    -------
    numpy.ndarray
        float64 (N, M), >= 0.
    """
    if distance not in DISTANCES:
        raise ValueError(f"unknown distance {distance!r}; valid names are: {', '.join(DISTANCES)}")
    z = np.asarray(z, dtype=np.float64)
    centres = np.asarray(centres, dtype=np.float64)
    diff = z[:, None, :] - centres[None, :, :]
    euclid = np.sqrt((diff * diff).sum(axis=-1))
    if distance == "euclidean":
        return euclid
    nz = np.linalg.norm(z, axis=1)[:, None]
    nc = np.linalg.norm(centres, axis=1)[None, :]
    denom = nz * nc
    cos = np.divide(z @ centres.T, denom, out=np.zeros_like(euclid), where=denom > 0)
    return euclid / EUCOS_EUCLIDEAN_SCALE + np.clip(1.0 - cos, 0.0, 2.0)


def _weibull():
    """``scipy.stats.weibull_min``, imported on first use: scipy.stats costs 1.5 s to import, and every Ray
    worker imports this module (through the round strategies) whether or not it scores with OpenMax."""
    from scipy.stats import weibull_min

    return weibull_min


class OpenMax:
    """OpenMax unknown scorer over a classifier's logits.

    Parameters
    ----------
    tail_size : int, default 20
        Number of largest MAV distances per class that the Weibull model is fitted to (>= 2).
    alpha : int or None, default None
        Number of top-ranked classes whose logits are revised; ``None`` means
        ``min(number of classes, 10)``. Checked against the number of classes in :meth:`fit`.
    distance : {"eucos", "euclidean"}, default "eucos"
        Distance between a logit vector and a MAV (see :func:`pairwise_distance`).

    Attributes
    ----------
    mav_ : numpy.ndarray
        (C, C) mean logit vector of the correctly classified training samples of each class.
    shape_, scale_ : numpy.ndarray
        (C,) Weibull shape and scale per class (location 0).
    alpha_ : int
        The number of revised classes in use.

    Examples
    --------
    >>> om = OpenMax(tail_size=20).fit(train_logits, train_y)          # doctest: +SKIP
    >>> open_set_metrics(om.predict(z_k), y_k, om.score(z_k), om.score(z_u))  # doctest: +SKIP
    """

    def __init__(self, *, tail_size: int = 20, alpha: int | None = None, distance: str = "eucos") -> None:
        if not _is_int(tail_size) or tail_size < 2:
            raise ValueError(
                f"tail_size must be an int >= 2 (a Weibull fit needs two points), got {tail_size!r}; the authors use 20"
            )
        if alpha is not None and (not _is_int(alpha) or alpha < 1):
            raise ValueError(f"alpha must be an int >= 1 or None (= min(classes, 10)), got {alpha!r}")
        if distance not in DISTANCES:
            raise ValueError(f"unknown distance {distance!r}; valid names are: {', '.join(DISTANCES)}")
        self.tail_size = int(tail_size)
        self.alpha = None if alpha is None else int(alpha)
        self.distance = distance
        self.mav_: np.ndarray | None = None
        self.shape_: np.ndarray | None = None
        self.scale_: np.ndarray | None = None
        self.alpha_: int | None = None

    def __repr__(self) -> str:
        return f"OpenMax(tail_size={self.tail_size}, alpha={self.alpha}, distance={self.distance!r})"

    @property
    def num_classes(self) -> int:
        self._check_fitted()
        return int(cast(np.ndarray, self.mav_).shape[0])

    def fit(self, logits: Any, y: Any) -> "OpenMax":
        """Fit the MAVs and per-class Weibull models on training logits.

        Parameters
        ----------
        logits : numpy.ndarray or torch.Tensor
            (N, C) logits of the training samples.
        y : array-like of int
            (N,) their labels in ``0..C-1``.

        Returns
        -------
        OpenMax
            ``self``, fitted.

        Raises
        ------
        ValueError
            If a class has no correctly classified training sample, or too few distinct nonzero
            distances for a Weibull fit; or on malformed inputs.
        """
        z = check_logits(logits)
        labels = as_numpy(y)
        n, c = z.shape
        if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(
                f"y must be an int array of shape ({n},) to match logits, got {labels.dtype} {labels.shape}"
            )
        if n and (labels.min() < 0 or labels.max() >= c):
            raise ValueError(
                f"y must be class indices 0..{c - 1} (the logits have {c} columns), got {labels.min()}..{labels.max()}"
            )
        alpha = min(c, 10) if self.alpha is None else self.alpha
        if alpha > c:
            raise ValueError(f"alpha={alpha} exceeds the {c} classes of the logits; set alpha <= {c} (or None)")
        pred = z.argmax(axis=1)
        mav = np.empty((c, c))
        shape = np.empty(c)
        scale = np.empty(c)
        for k in range(c):
            rows = (labels == k) & (pred == k)
            if not rows.any():
                raise ValueError(
                    f"class {k} has no correctly classified training sample, so OpenMax has no mean "
                    "activation vector for it; train the model longer, or score with MSP "
                    "(fedcore.openset.msp_score) instead"
                )
            mav[k] = z[rows].mean(axis=0)
            d = pairwise_distance(z[rows], mav[k][None], distance=self.distance)[:, 0]
            tail = np.sort(d)[-self.tail_size :]
            tail = tail[tail > 0]
            if np.unique(tail).size < 2:
                raise ValueError(
                    f"class {k} has {int(rows.sum())} correctly classified training sample(s) but fewer "
                    "than 2 distinct nonzero distances to its MAV, too few for a Weibull fit; fit on "
                    "more training samples, train the model longer, or score with MSP "
                    "(fedcore.openset.msp_score) instead"
                )
            shape[k], _, scale[k] = _weibull().fit(tail, floc=0)
        self.mav_, self.shape_, self.scale_, self.alpha_ = mav, shape, scale, alpha
        return self

    def _check_fitted(self) -> None:
        if self.mav_ is None:
            raise RuntimeError("this OpenMax is not fitted; call fit(train_logits, train_y) first")

    def _checked(self, logits: Any) -> np.ndarray:
        self._check_fitted()
        mav = cast(np.ndarray, self.mav_)  # fitted: fit() sets mav_, shape_, scale_ and alpha_ together
        z = check_logits(logits)
        if z.shape[1] != mav.shape[0]:
            raise ValueError(
                f"logits have {z.shape[1]} columns but OpenMax was fitted on {mav.shape[0]} "
                "classes; score logits of the same model"
            )
        return z

    def weibull_cdf(self, distances: Any) -> np.ndarray:
        """The per-class Weibull CDF ``w_c(d)`` at given distances.

        Parameters
        ----------
        distances : array-like
            (N, C) distance of each sample to each class's MAV.

        Returns
        -------
        numpy.ndarray
            float64 (N, C) in [0, 1], non-decreasing in the distance, 0 at distance 0.
        """
        self._check_fitted()
        shape, scale = cast(np.ndarray, self.shape_), cast(np.ndarray, self.scale_)  # fitted (checked above)
        d = np.asarray(distances, dtype=np.float64)
        if d.ndim != 2 or d.shape[1] != len(shape):
            raise ValueError(f"distances must be (N, {len(shape)}), got {d.shape}")
        return _weibull().cdf(d, shape[None, :], loc=0.0, scale=scale[None, :])

    def predict_proba(self, logits: Any) -> np.ndarray:
        """OpenMax probabilities: the C known classes, then the unknown class in the last column.

        Parameters
        ----------
        logits : numpy.ndarray or torch.Tensor
            (N, C) logits of the model OpenMax was fitted on.

        Returns
        -------
        numpy.ndarray
            float64 (N, C + 1); each row sums to 1.
        """
        z = self._checked(logits)
        mav, alpha = cast(np.ndarray, self.mav_), cast(int, self.alpha_)  # fitted (checked by _checked)
        n, c = z.shape
        w = self.weibull_cdf(pairwise_distance(z, mav, distance=self.distance))
        ranked = np.argsort(-z, axis=1, kind="stable")[:, :alpha]
        alpha_weight = np.zeros_like(z)
        np.put_along_axis(alpha_weight, ranked, (alpha - np.arange(alpha, dtype=np.float64)) / alpha, axis=1)
        removed = z * w * alpha_weight
        revised = np.concatenate([z - removed, removed.sum(axis=1, keepdims=True)], axis=1)
        revised -= revised.max(axis=1, keepdims=True)
        e = np.exp(revised)
        return e / e.sum(axis=1, keepdims=True)

    def score(self, logits: Any) -> np.ndarray:
        """Unknown score: the OpenMax probability of the unknown class, float64 (N,) in [0, 1]."""
        return self.predict_proba(logits)[:, -1]

    def predict(self, logits: Any) -> np.ndarray:
        """Closed-set label: argmax over the C revised known-class probabilities, int64 (N,)."""
        return self.predict_proba(logits)[:, :-1].argmax(axis=1).astype(np.int64)


__all__ = ["OpenMax", "pairwise_distance", "DISTANCES"]
