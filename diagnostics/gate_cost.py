"""What does privatising UGSA's gate statistic cost in accuracy?

    python diagnostics/gate_cost.py [--methods tent bpa ...] [--seeds 0 1 2] [--epsilon 1]
                                    [--settings history-b0.2 none-b1] [--json out.json] [hydra overrides...]

Needs the private variant's source model (`dvc repro pretrain@private`). In ``dp`` mode a client
releases its gate statistic σ_k with Gaussian noise of std z·ln C / n, and that release takes
μ_g = 1/z of the arrival's budget, so the gradient noise σ is calibrated for what is left
(docs/systems/dptta.md). Each run here is DP-TTA's setting of the stress cell ``ugsa-lr1e-2-p3`` (UGSA,
lr 0.01, 3 passes, seeded noise) at one ε, in two modes:

- ``private``: as shipped, a noised σ_k and σ calibrated with μ_g reserved;
- ``exact``: σ_k released without noise and σ calibrated for the whole ε: the code before the gate
  was privatised, whose guarantee did not cover σ_k.

The gap private − exact is the accuracy the gate's privacy costs. Each setting names UGSA's
normaliser and β: ``history-b0.2`` is the shipped default, ``none-b1`` the reading under which the
gate moves the merge most (docs/systems/bpfedctta.md). Prints, per setting and method, the final
average hold-out and average online accuracy of each mode (mean ± std over the seeds) and the
paired gap with a paired t-test, then every method-seed pair pooled per setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
from scipy.stats import ttest_rel, wilcoxon

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcore.aggregate import UGSA_NORMALIZERS  # noqa: E402
from fedcore.engine import run_arrivals  # noqa: E402
from fedcore.privacy import calibrate_sigma, gate_noise_std  # noqa: E402
from flows.config import compose as C  # noqa: E402
from flows.runs.stress import cell_config  # noqa: E402
from flows.runs.tasks import load_inputs  # noqa: E402

CELL = "ugsa-lr1e-2-p3"
MODES = ("private", "exact")
METRICS = (("final_avg_holdout_acc", "final hold-out"), ("avg_online_acc", "online"))


def parse_setting(name: str) -> tuple:
    """``<normalizer>-b<beta>``, e.g. ``history-b0.2``."""
    normalizer, sep, beta = name.partition("-b")
    if not sep or normalizer not in UGSA_NORMALIZERS:
        raise SystemExit(
            f"bad setting {name!r}: write <normalizer>-b<beta> with normalizer "
            f"{', '.join(UGSA_NORMALIZERS)}, e.g. history-b0.2"
        )
    return normalizer, float(beta)


def arrival_config(cfg, *, method: str, seed: int, epsilon: float, setting: str, mode: str):
    normalizer, beta = parse_setting(setting)
    acfg = C.arrival_config(cfg, method=method, aggregator="ugsa", seed=seed, form=f"dp-eps{epsilon:g}")
    agg = dict(acfg.aggregator_params, normalizer=normalizer, beta=beta)
    privacy = dict(acfg.privacy)
    if mode == "exact":
        pcfg = acfg.privacy_config()
        privacy["noise_multiplier"] = calibrate_sigma(
            pcfg.epsilon, pcfg.delta, uses=acfg.uses_per_arrival, method=pcfg.calibration
        )
    return dataclasses.replace(acfg, aggregator_params=agg, privacy=privacy)


def run_one(inputs, acfg, mode: str):
    """One run in process (``inputs``: partition, spec, source weights); ``exact`` releases σ_k unnoised."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid names are: {', '.join(MODES)}")
    if mode == "exact":
        with mock.patch("fedcore.engine.arrivals.privatize_gate", lambda sigma, cfg, **kw: sigma):
            return run_arrivals(*inputs, acfg)
    return run_arrivals(*inputs, acfg)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["tent", "eata", "sar", "deyo", "come", "bpa"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--settings", nargs="+", default=["history-b0.2", "none-b1"])
    ap.add_argument("--json", type=Path, default=None, help="also write every run's metrics here")
    args, overrides = ap.parse_known_args(argv)
    for s in args.settings:
        parse_setting(s)
    cfg = cell_config(C.compose(overrides), CELL, "dptta")
    inputs = load_inputs(cfg)
    private, exact = (
        arrival_config(
            cfg, method=args.methods[0], seed=args.seeds[0], epsilon=args.epsilon, setting=args.settings[0], mode=m
        )
        for m in MODES
    )
    pcfg = private.privacy_config()
    n = min(len(t.stream_y) for t in inputs[0].targets)
    print(
        f"ε = {args.epsilon:g} per arrival, δ = {pcfg.delta:g}, z = {pcfg.gate_noise_multiplier:g}: σ = "
        f"{pcfg.sigma(private.uses_per_arrival):.3f} private, "
        f"{exact.privacy_config().sigma(exact.uses_per_arrival):.3f} exact; gate noise std {gate_noise_std(num_classes=inputs[1].num_classes, n=n, noise_multiplier=pcfg.gate_noise_multiplier):.3f} "
        f"nats at n = {n}",
        flush=True,
    )
    runs = []
    total = len(args.settings) * len(args.methods) * len(args.seeds) * len(MODES)
    t0 = time.perf_counter()
    for setting in args.settings:
        for method in args.methods:
            for seed in args.seeds:
                for mode in MODES:
                    acfg = arrival_config(
                        cfg, method=method, seed=seed, epsilon=args.epsilon, setting=setting, mode=mode
                    )
                    summary = run_one(inputs, acfg, mode).summary
                    row = {
                        "setting": setting,
                        "method": method,
                        "seed": seed,
                        "mode": mode,
                        **{key: float(summary[key]) for key, _ in METRICS},
                    }
                    runs.append(row)
                    print(
                        f"[{len(runs)}/{total}, {time.perf_counter() - t0:.0f} s] {setting} {method} s{seed} "
                        f"{mode}: hold-out {row['final_avg_holdout_acc']:.4f}, online {row['avg_online_acc']:.4f}",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
    print(table(runs, args.settings, args.methods))


def table(runs, settings, methods) -> str:
    """Per setting and method: each mode's mean ± std over seeds (population std, as the stress report),
    the paired gap private − exact, the seeds where private is above and a paired t-test; then, per
    setting, every method-seed pair pooled: mean ± std of the gaps, pairs below / above, and a
    Wilcoxon signed-rank test."""

    def values(setting, method, mode, key):
        rows = sorted(
            (r for r in runs if (r["setting"], r["method"], r["mode"]) == (setting, method, mode)),
            key=lambda r: r["seed"],
        )
        return np.array([r[key] for r in rows])

    lines = []
    for key, label in METRICS:
        lines += [
            "",
            f"{label}: mean ± std over seeds; gap private − exact, seeds where private is above, paired t-test p",
            "",
            "| setting | method | private | exact | gap | above | p |",
            "|---|---|---|---|---|---|---|",
        ]
        pooled = {}
        for setting in settings:
            for method in methods:
                p, e = values(setting, method, "private", key), values(setting, method, "exact", key)
                d = p - e
                pooled.setdefault(setting, []).extend(d)
                pval = float(ttest_rel(p, e).pvalue) if len(d) > 1 and np.any(d != d[0]) else math.nan
                lines.append(
                    f"| {setting} | {method} | {p.mean():.3f} ± {p.std():.3f} | "
                    f"{e.mean():.3f} ± {e.std():.3f} | {d.mean():+.4f} | "
                    f"{int((d > 0).sum())}/{len(d)} | {pval:.3g} |"
                )
        lines += [
            "",
            f"{label}, every method-seed pair: gap mean ± std, pairs below / above / level, Wilcoxon signed-rank p",
            "",
        ]
        for setting, gaps in pooled.items():
            d = np.array(gaps)
            pval = float(wilcoxon(d).pvalue) if np.any(d != 0) else math.nan
            lines.append(
                f"- {setting}: {d.mean():+.4f} ± {d.std():.4f} over {len(d)} pairs, "
                f"{int((d < 0).sum())} below / {int((d > 0).sum())} above / {int((d == 0).sum())} level, "
                f"p = {pval:.3g}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
