"""Paired timings summarised against a target ratio: shared by the orchestration benchmarks.

This VM's speed drifts by 20-40% over minutes, more than the overheads measured, so each benchmark times
its baseline and its flow back to back, and a run's evidence is the set of per-pair ratios: their median,
how sure that median is, and on which side of the issue's target they sit, beyond the noise.
"""

from __future__ import annotations

import numpy as np


def median_summary(ratios: list, target: float, *, draws: int = 10_000, seed: int = 0) -> str:
    """The median of ``ratios``, its 95% bootstrap interval, how many lie above ``target``, and the one-sided
    Wilcoxon signed-rank p-value that they sit on the median's side of it: above the target when the
    median is (a missed target), below it otherwise (a met one). The VM's drift moves single pairs by
    +-0.3, so one median of five cannot tell 1.2 from 1.15. The interval and the test treat the pairs as
    independent; neighbouring pairs share the VM's state, so both are somewhat optimistic."""
    from scipy.stats import wilcoxon

    r = np.asarray(ratios, dtype=float)
    meds = np.median(np.random.default_rng(seed).choice(r, size=(draws, r.size)), axis=1)
    lo, hi = np.quantile(meds, [0.025, 0.975])
    text = f"median {np.median(r):.3f} (95% bootstrap interval {lo:.3f}-{hi:.3f}), above {target} in {int((r > target).sum())} of {r.size}"
    if r.size >= 6:
        side = "greater" if np.median(r) > target else "less"
        p = wilcoxon(r - target, alternative=side).pvalue
        text += f", {'above' if side == 'greater' else 'below'} it at Wilcoxon one-sided p = {p:.3g}"
    return text
