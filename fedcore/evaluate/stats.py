"""Statistics for method comparisons: paired Wilcoxon signed-rank tests and Friedman average ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class PairedTest:
    """``target`` against ``other`` over n paired blocks (seeds × settings)."""

    other: str
    n: int
    mean_gap: float  # mean of target − other
    wins: int  # blocks where target > other
    p_value: float  # two-sided Wilcoxon signed-rank (exact for small n); nan when every gap is 0


def wilcoxon_against(scores: Mapping[str, Sequence[float]], target: str) -> List[PairedTest]:
    """Wilcoxon signed-rank test of ``target`` against every other method, paired block by block.

    ``scores[method][b]`` is the method's score in block b (the same blocks for every method).
    With n blocks the smallest two-sided p the exact test can give is 2 / 2ⁿ (0.25 at n = 3,
    0.03 at n = 6), so a few seeds on one setting cannot reach p < 0.05 whatever the gap.
    """
    from scipy.stats import wilcoxon

    a = np.asarray(scores[target], dtype=float)
    out = []
    for other, vals in scores.items():
        if other == target:
            continue
        b = np.asarray(vals, dtype=float)
        if b.shape != a.shape:
            raise ValueError(f"{other} has {len(b)} blocks, {target} has {len(a)}: pair them block by block")
        gap = a - b
        p = float("nan") if np.all(gap == 0) else float(wilcoxon(a, b, zero_method="zsplit").pvalue)
        out.append(PairedTest(other=other, n=len(a), mean_gap=float(gap.mean()), wins=int((gap > 0).sum()), p_value=p))
    return out


def friedman_ranks(scores: Mapping[str, Sequence[float]]) -> Dict[str, float]:
    """Average rank of each method over the blocks (1 = best, ties share the mean rank)."""
    from scipy.stats import rankdata

    names = list(scores)
    table = np.asarray([scores[m] for m in names], dtype=float)  # (methods, blocks)
    ranks = np.apply_along_axis(lambda col: rankdata(-col), 0, table)
    return {m: float(r) for m, r in zip(names, ranks.mean(axis=1))}


def friedman_p(scores: Mapping[str, Sequence[float]]) -> float:
    """p-value of the Friedman test that all methods rank alike (needs ≥ 3 methods and ≥ 2 blocks)."""
    from scipy.stats import friedmanchisquare

    if len(scores) < 3 or len(next(iter(scores.values()))) < 2:
        return float("nan")
    return float(friedmanchisquare(*[np.asarray(v, dtype=float) for v in scores.values()]).pvalue)
