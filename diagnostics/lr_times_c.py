"""Do clip-only runs at exactly the same lr · C end alike?

    python diagnostics/lr_times_c.py [--methods come tent] [--seeds 0 1 2] [hydra overrides...]
    python diagnostics/lr_times_c.py --normalised [--methods come sar] ...

Needs the private variant's source model (`dvc repro pretrain@private`). With SGD and every sample
clipped, a step is lr · C times a mean of the samples' unit gradients, so lr and C should act only
through their product. The stress cells compared lr 0.003 at C = 0.3 with lr 0.01 at C = 0.1
(docs/systems/dptta.md), whose products differ by 11% (0.0009 and 0.001), and COME ended 0.022 apart. This
runs each method in the continual setting of those cells (clip-only form, 3 passes) at the two
partners with the product made exact:

- lr 0.003 at C = 1/3 (lr · C = 0.001), beside lr 0.01 at C = 0.1;
- lr 0.01 at C = 0.09 (lr · C = 0.0009), beside lr 0.003 at C = 0.3.

and prints each run's final average hold-out accuracy and share of samples clipped, then the
recorded partner's from `results/stress_private/clipnorm-lr{3e-3,1e-2}-p3/summary.json`
(`make stress-private`, or `make pull`, first).

Runs at equal products still end apart where not every sample is clipped (lr 0.001 or 0.003 at
C = 1): an unclipped sample's step scales with lr alone. ``--normalised`` tests that reading: both
runs of each pair scale every sample's non-zero gradient up to norm C before clipping, so that
every sample is "clipped" and only lr · C can matter:

- lr 0.001 at C = 1 beside lr 0.01 at C = 0.1 (lr · C = 0.001);
- lr 0.003 at C = 1 beside lr 0.01 at C = 0.3 (lr · C = 0.003).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcore.engine import run_arrivals  # noqa: E402
from fedcore.privacy import dp  # noqa: E402
from flows.config import compose as C  # noqa: E402
from flows.runs.stress import cell_config  # noqa: E402
from flows.runs.tasks import load_inputs  # noqa: E402

CELLS = {0.001: "lr1e-3-p3", 0.003: "clipnorm-lr3e-3-p3", 0.01: "clipnorm-lr1e-2-p3"}
# (lr, form run here, lr of the recorded partner, its form)
PAIRS = ((0.003, "clip-c0.333333", 0.01, "clip-c0.1"), (0.01, "clip-c0.09", 0.003, "clip-c0.3"))
# (lr, form, lr, form): both run with every sample's gradient scaled up to norm C (--normalised)
NORMALISED_PAIRS = ((0.001, "clip", 0.01, "clip-c0.1"), (0.003, "clip", 0.01, "clip-c0.3"))


def normalised(privatize):
    """``privatize`` with every sample's non-zero gradient first scaled up to norm ``clip_norm`` (a
    sample a filter dropped keeps its zero gradient), so that clipping then scales every sample to C."""

    def wrapped(per_sample, *, clip_norm, **kw):
        norms = dp.flatten_per_sample(per_sample).norm(dim=1)
        up = torch.where(norms > 0, (clip_norm / norms.clamp_min(1e-30)).clamp(min=1.0), torch.ones_like(norms))
        return privatize(
            {k: g * up.view(-1, *([1] * (g.dim() - 1))) for k, g in per_sample.items()}, clip_norm=clip_norm, **kw
        )

    return wrapped


def mean_and_seeds(gaps: list) -> str:
    return f"{np.mean(gaps):+.4f} (seeds {', '.join(f'{g:+.4f}' for g in gaps)})"


def recorded(cell: str) -> dict:
    path = C.ROOT / "results" / "stress_private" / cell / "summary.json"
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `dvc repro stress_private@{cell}` (or `make pull`) first")
    return json.loads(path.read_text())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["come", "tent"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--normalised", action="store_true", help="the pairs at equal products with every sample at norm C")
    args, overrides = ap.parse_known_args(argv)
    base = C.compose(overrides)
    cfgs = {lr: cell_config(base, cell, "dptta") for lr, cell in CELLS.items()}
    inputs = load_inputs(cfgs[0.003])
    if args.normalised:
        return compare_normalised(cfgs, inputs, args.methods, args.seeds)
    summaries = {partner_lr: recorded(CELLS[partner_lr]) for _, _, partner_lr, _ in PAIRS}
    for method in args.methods:
        for lr, form, partner_lr, partner_form in PAIRS:
            gaps = []
            for seed in args.seeds:
                acfg = C.arrival_config(cfgs[lr], method=method, aggregator="sequential", seed=seed, form=form)
                res = run_arrivals(*inputs, acfg)
                clipped = float(np.mean([r["clip_fraction"] for r in res.records]))
                mine = res.summary["final_avg_holdout_acc"]
                theirs = summaries[partner_lr][f"{method}+sequential+{partner_form}+s{seed}"]["final_avg_holdout_acc"]
                gaps.append(mine - theirs)
                print(
                    f"{method}, seed {seed}: lr {lr:g} {form} {mine:.4f} ({clipped:.3f} clipped); "
                    f"recorded lr {partner_lr:g} {partner_form} {theirs:.4f}",
                    flush=True,
                )
            print(
                f"{method}: lr {lr:g} {form} minus lr {partner_lr:g} {partner_form}: {mean_and_seeds(gaps)}", flush=True
            )


def compare_normalised(cfgs, inputs, methods, seeds) -> None:
    for method in methods:
        for pair in NORMALISED_PAIRS:
            ends = {}
            for lr, form in (pair[:2], pair[2:]):
                for seed in seeds:
                    acfg = C.arrival_config(cfgs[lr], method=method, aggregator="sequential", seed=seed, form=form)
                    with mock.patch.object(dp, "privatize", normalised(dp.privatize)):
                        ends[lr, seed] = run_arrivals(*inputs, acfg).summary["final_avg_holdout_acc"]
                    print(
                        f"{method}, seed {seed}: lr {lr:g}, C = {acfg.privacy['clip_norm']:g}, every sample at "
                        f"norm C: {ends[lr, seed]:.4f}",
                        flush=True,
                    )  # its clip_fraction means nothing here
            gaps = [ends[pair[0], s] - ends[pair[2], s] for s in seeds]
            print(
                f"{method}, every sample at norm C: lr {pair[0]:g} {pair[1]} minus lr {pair[2]:g} {pair[3]}: "
                f"{mean_and_seeds(gaps)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
