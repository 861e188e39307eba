"""An open-set view of a domain partition: clients train on known classes, tests add unknowns.

Open-set recognition benchmarks (e.g. "6 known / 4 unknown" on digits) split the classes of a
closed-set dataset in two. :func:`make_split` names the split; :func:`openset_view` applies it to
a :class:`~fedcore.data.domains.DomainPartition`:

- every client keeps only its known-class samples, relabelled ``0..K-1`` in the order of
  ``split.known`` (unknown-class training samples are dropped: unknowns appear only at test time);
- each domain's test set is cut into its known part (relabelled the same way; the round engine's
  ``eval_sets``) and its unknown part (images only: an unknown sample has no label to predict);
- classes in neither ``known`` nor ``unknown`` (possible with an explicit ``unknown``) are dropped
  from training and testing alike.

The result's ``rounds`` is a :class:`~fedcore.engine.rounds.RoundData`, so the round loop trains
on it unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Sequence, Tuple, cast

import numpy as np

from fedcore.data.domains import DomainPartition
from fedcore.types import RoundData


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


@dataclass(frozen=True)
class OpenSetSplit:
    """Which classes are known (trained on, predicted) and which are unknown (test-time only).

    Attributes
    ----------
    known : tuple of int
        Known class ids; known class ``known[j]`` is relabelled ``j``.
    unknown : tuple of int
        Unknown class ids.

    Use :func:`make_split` to build one checked against the number of classes.
    """

    known: Tuple[int, ...]
    unknown: Tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("known", "unknown"):
            ids = getattr(self, name)
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not all(_is_int(c) for c in ids):
                raise ValueError(f"{name} must be a sequence of int class ids, got {ids!r}")
            object.__setattr__(self, name, tuple(int(c) for c in ids))
            dup = sorted({c for c in getattr(self, name) if getattr(self, name).count(c) > 1})
            if dup:
                raise ValueError(f"{name} lists class(es) {dup} more than once; list each class once")
        if not self.known:
            raise ValueError("the split has no known class; give known at least one class id (e.g. known=6)")
        if not self.unknown:
            raise ValueError(
                "the split has no unknown class; leave at least one class out of known, "
                "or list unknown classes explicitly"
            )
        both = sorted(set(self.known) & set(self.unknown))
        if both:
            raise ValueError(f"class(es) {both} are both known and unknown; remove them from one of the two")
        neg = sorted(c for c in self.known + self.unknown if c < 0)
        if neg:
            raise ValueError(f"class ids must be >= 0, got {neg}")

    @property
    def num_known(self) -> int:
        return len(self.known)

    def check(self, num_classes: int) -> None:
        """Raise ValueError if a class id is outside ``0..num_classes-1``."""
        out = sorted(c for c in self.known + self.unknown if not 0 <= c < num_classes)
        if out:
            raise ValueError(
                f"class id(s) {out} are outside 0..{num_classes - 1} (the data has {num_classes} "
                "classes); use ids in that range"
            )


def make_split(num_classes: int, *, known: int | Sequence[int], unknown: Sequence[int] | None = None) -> OpenSetSplit:
    """Name the known and unknown classes of an open-set benchmark.

    Parameters
    ----------
    num_classes : int
        Number of classes of the closed-set data.
    known : int or sequence of int
        An int ``k`` takes the first ``k`` classes ``0..k-1`` as known (the papers' "6 known /
        4 unknown" is ``known=6`` on 10 classes); a sequence gives the class ids, in the order
        they are relabelled ``0..K-1``.
    unknown : sequence of int, optional
        Unknown class ids; default: every class not in ``known``, ascending.

    Returns
    -------
    OpenSetSplit

    Raises
    ------
    ValueError
        If known and unknown overlap, a class id is out of range, or either side is empty.
    """
    if not _is_int(num_classes) or num_classes < 2:
        raise ValueError(
            f"num_classes must be an int >= 2 (one known and one unknown class at least), got {num_classes!r}"
        )
    if _is_int(known):
        n_known = cast(int, known)  # an int or a NumPy integer
        if not 0 <= n_known <= num_classes:
            raise ValueError(
                f"known={known} is outside 0..{num_classes}: as an int it counts the first classes "
                f"taken as known; use 1..{num_classes - 1}"
            )
        known_ids: Tuple[int, ...] = tuple(range(int(n_known)))
    elif isinstance(known, (str, bytes)) or not isinstance(known, Sequence):
        raise ValueError(f"known must be an int (the first `known` classes) or a sequence of class ids, got {known!r}")
    else:
        known_ids = tuple(known)
    if unknown is None:
        taken = {c for c in known_ids if _is_int(c)}
        unknown_ids: Tuple[int, ...] = tuple(c for c in range(num_classes) if c not in taken)
    else:
        unknown_ids = (
            tuple(unknown)
            if isinstance(unknown, Sequence) and not isinstance(unknown, (str, bytes))
            else cast(Tuple[int, ...], unknown)
        )  # a malformed value is reported by OpenSetSplit
    split = OpenSetSplit(known=known_ids, unknown=unknown_ids)
    split.check(num_classes)
    return split


@dataclass
class OpenSetData:
    """A domain partition seen through an open-set split.

    Attributes
    ----------
    rounds : RoundData
        Client data of the known classes only, labels relabelled ``0..K-1`` in the order of
        ``split.known``; ``eval_sets`` holds each domain's known-class test set, relabelled alike.
    unknown_test : dict of str to numpy.ndarray
        Per domain, the test images of the unknown classes.
    split : OpenSetSplit
        The split applied.
    unknown_labels : dict of str to numpy.ndarray
        Per domain, the original class id of each row of ``unknown_test`` (never shown to a
        model; it lets a client's test be limited to its own unknown classes, see
        :func:`unknown_masks`).
    """

    rounds: RoundData
    unknown_test: Dict[str, np.ndarray]
    split: OpenSetSplit
    unknown_labels: Dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_known(self) -> int:
        """Number of known classes, the width of a closed-set classifier's output."""
        return self.split.num_known


def openset_view(part: DomainPartition, split: OpenSetSplit) -> OpenSetData:
    """Apply an open-set split to a domain partition.

    Parameters
    ----------
    part : DomainPartition
        Clients holding one domain each, and one test set per domain.
    split : OpenSetSplit
        Known and unknown classes (ids of ``part.classes``).

    Returns
    -------
    OpenSetData
        Known-class clients and test sets with labels ``0..K-1``, plus per-domain unknown test images.

    Raises
    ------
    ValueError
        If a class id is outside the partition's classes, a client holds no known-class sample,
        or a domain's test set has no known or no unknown sample.
    """
    if not isinstance(split, OpenSetSplit):
        raise ValueError(f"split must be an OpenSetSplit (see make_split), got {type(split).__name__}")
    split.check(part.num_classes)
    relabel = np.full(part.num_classes, -1, dtype=np.int64)
    relabel[list(split.known)] = np.arange(split.num_known)
    known = np.asarray(split.known, dtype=np.int64)
    unknown = np.asarray(split.unknown, dtype=np.int64)

    client_x, client_y, client_group = [], [], []
    for i, (dk, x, y) in enumerate(zip(part.client_domain, part.client_x, part.client_y)):
        keep = np.isin(y, known)
        if not keep.any():
            raise ValueError(
                f"client {i} (domain {part.domains[dk]!r}) holds no sample of the known classes "
                f"{list(split.known)}; choose other known classes or give this client more data "
                "(with label skew: raise label_alpha)"
            )
        client_x.append(x[keep])
        client_y.append(relabel[y[keep]])
        client_group.append(part.domains[dk])

    eval_sets: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    unknown_test: Dict[str, np.ndarray] = {}
    unknown_labels: Dict[str, np.ndarray] = {}
    for name, x, y in zip(part.domains, part.test_x, part.test_y):
        k_rows, u_rows = np.isin(y, known), np.isin(y, unknown)
        if not k_rows.any():
            raise ValueError(
                f"the test set of domain {name!r} has no sample of the known classes "
                f"{list(split.known)}; choose other known classes or raise test_fraction"
            )
        if not u_rows.any():
            raise ValueError(
                f"the test set of domain {name!r} has no sample of the unknown classes "
                f"{list(split.unknown)}; choose other unknown classes or raise test_fraction"
            )
        eval_sets[name] = (x[k_rows], relabel[y[k_rows]])
        unknown_test[name] = x[u_rows]
        unknown_labels[name] = np.asarray(y[u_rows], dtype=np.int64)

    rounds = RoundData(client_x=client_x, client_y=client_y, client_group=client_group, eval_sets=eval_sets)
    return OpenSetData(rounds=rounds, unknown_test=unknown_test, split=split, unknown_labels=unknown_labels)


def unknown_masks(
    view: OpenSetData, scenarios: Mapping[str, Mapping[str, Sequence[int]]]
) -> Dict[str, Dict[str, np.ndarray]]:
    """Heterogeneous unknowns: per scenario, which of each domain's unknown test rows that domain's client meets.

    Every client shares the known classes and trains on them alone, so the unknown classes a
    client meets at test time cannot change any model: a scenario only chooses, per domain, the
    unknown classes its test is scored against (the paper's Table 14 settings, see
    :func:`pairwise_overlap`).

    Parameters
    ----------
    view : OpenSetData
    scenarios : mapping of str to mapping of str to sequence of int
        ``{scenario: {domain: [unknown class ids]}}``; every domain of the view, each list a
        non-empty subset of ``view.split.unknown``.

    Returns
    -------
    dict
        ``{scenario: {domain: bool mask over view.unknown_test[domain]}}``.

    Raises
    ------
    ValueError
        A domain missing or foreign, a class that is not unknown, or a domain left with no test row.
    """
    out: Dict[str, Dict[str, np.ndarray]] = {}
    unknown = set(view.split.unknown)
    if not isinstance(scenarios, Mapping):
        raise ValueError(
            f"unknown_sets must map scenario names to {{domain: [unknown class ids]}}, got {type(scenarios).__name__}"
        )
    for name, per_domain in scenarios.items():
        where = f"unknown scenario {name!r}"
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            raise ValueError(
                f"{where}: a scenario name becomes part of MLflow metric keys; use letters, digits, '_' and '-' only"
            )
        if not isinstance(per_domain, Mapping):
            raise ValueError(f"{where} must map each domain to its unknown class ids, got {per_domain!r}")
        foreign = sorted(set(per_domain) - set(view.unknown_test))
        missing = [d for d in view.unknown_test if d not in per_domain]
        if foreign or missing:
            raise ValueError(
                f"{where} names domain(s) {foreign} that have no test set and misses {missing}; give "
                f"every one of {', '.join(view.unknown_test)} its unknown classes"
            )
        out[name] = {}
        for d, ids in per_domain.items():
            ids = list(ids) if isinstance(ids, Sequence) and not isinstance(ids, (str, bytes)) else ids
            if not isinstance(ids, list) or not ids or not all(_is_int(c) for c in ids):
                raise ValueError(f"{where}, domain {d!r}: give a non-empty list of class ids, got {ids!r}")
            bad = sorted(set(ids) - unknown)
            if bad:
                raise ValueError(
                    f"{where}, domain {d!r}: class(es) {bad} are not unknown classes of the split "
                    f"(unknown: {list(view.split.unknown)}); a known class cannot be an unknown"
                )
            absent = [c for c in ids if not np.any(view.unknown_labels[d] == c)]
            if absent:
                raise ValueError(
                    f"{where}, domain {d!r}: its test set has no sample of class(es) {absent}; "
                    "choose other classes or raise test_fraction"
                )
            out[name][d] = np.isin(view.unknown_labels[d], np.asarray(ids, dtype=np.int64))
    return out


def pairwise_overlap(sets: Mapping[str, Sequence[int]]) -> float:
    """Mean over domain pairs of |U_i ∩ U_j| / min(|U_i|, |U_j|): 1 when all domains meet the same
    unknowns, 0 when no two share one (the paper's 100 / 50 / 0 % overlap, over its one-client-per-
    domain HDR-FL; a scenario cannot tell apart clients that share a domain and its test set)."""
    named = [set(v) for v in sets.values()]
    pairs = [(a, b) for i, a in enumerate(named) for b in named[i + 1 :]]
    if not pairs:
        return 1.0
    return float(np.mean([len(a & b) / min(len(a), len(b)) for a, b in pairs]))


__all__ = ["OpenSetSplit", "OpenSetData", "make_split", "openset_view", "unknown_masks", "pairwise_overlap"]
