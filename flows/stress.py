"""BPFedCTTA's stress protocol: where continual adaptation degrades, and whether BPA or UGSA prevent it.

A stress cell (``bpfedctta.stress.cells.<name>``) lays a few settings over the ``mnist`` variant:
the adaptation ``lr`` of every gradient method, the number of ``passes`` over the 10 clients, the
``stream`` order and the ``batch_size``. Each cell is the sweep {source, bn, tent, bpa} × {none,
sequential, fedavg, ugsa} × seeds (``bpfedctta.stress``), written to ``results/stress/<cell>/`` by
``dvc repro stress@<cell>``, with one figure of online accuracy per arrival for every method.
``dvc repro stress_report`` pairs the cells that were run: mean ± std, and paired tests of BPA+UGSA.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Dict, List, Mapping, Sequence

import numpy as np
from omegaconf import DictConfig, OmegaConf

from flows import config as C

CELL_KEYS = {"lr": "sweep.method_params.lr", "passes": "adapt.passes", "stream": "adapt.stream",
             "batch_size": "adapt.batch_size", "beta": "sweep.aggregator_params.beta",
             "normalizer": "sweep.aggregator_params.normalizer", "methods": "sweep.methods",
             "aggregators": "sweep.aggregators"}
TARGET = "bpa+ugsa"
PAIRED_AGAINST = ("tent+sequential", "tent+ugsa", "bpa+sequential")
METRICS = (("final_avg_holdout_acc", "final hold-out"), ("avg_online_acc", "online"),
           ("final_worst_holdout_acc", "worst hold-out"), ("forgetting", "forgetting"))


def cell_names(cfg: DictConfig) -> List[str]:
    return [str(k) for k in cfg.bpfedctta.stress.cells]


def results_root(cfg: DictConfig) -> Path:
    return C.resolve_path(cfg.bpfedctta.stress.results)


def cell_config(cfg: DictConfig, cell: str) -> DictConfig:
    """The ``mnist`` variant with stress cell ``cell`` laid over it, writing to its own results folder."""
    stress = cfg.bpfedctta.stress
    if cell not in stress.cells:
        raise ValueError(f"unknown stress cell {cell!r}; valid names are: {', '.join(cell_names(cfg))}")
    settings = dict(stress.cells[cell])
    unknown = sorted(set(settings) - set(CELL_KEYS))
    if unknown:
        raise ValueError(f"stress cell {cell!r} sets {unknown}; a cell may set: {', '.join(CELL_KEYS)}")
    out = C.with_variant(cfg, "mnist")
    OmegaConf.set_struct(out, False)
    out.sweep.methods = list(stress.methods)
    out.sweep.aggregators = list(stress.aggregators)
    for key, value in settings.items():
        OmegaConf.update(out, CELL_KEYS[key], value, force_add=True)
    out.sweep.seeds = [int(s) for s in stress.seeds]
    out.sweep.privacy = ["plain"]
    out.paths.results = str(Path(str(stress.results)) / cell)
    out.paths.checkpoints = str(Path(str(cfg.paths.checkpoints)) / "stress" / cell)
    out.flow.experiment = str(stress.experiment)
    out.flow.register = "none"  # a stress cell is a measurement, not a model to deploy
    return out


def run_cell(cfg: DictConfig) -> Path:
    """The sweep of the cell named by ``bpfedctta.stress.cell``, then its figure (also logged to MLflow)."""
    from flows.stages import _adapt

    cell = cfg.bpfedctta.stress.cell
    if cell is None:
        raise ValueError(f"name a stress cell: bpfedctta.stress.cell=<name>, one of {', '.join(cell_names(cfg))}")
    ccfg = cell_config(cfg, str(cell))
    _adapt(ccfg)
    folder = C.resolve_path(ccfg.paths.results)
    fig = plot_cell(folder, title=f"stress cell {cell}: {describe(cfg, str(cell))}")
    _log_figure(ccfg, str(cell), fig)
    return fig


def describe(cfg: DictConfig, cell: str) -> str:
    s = dict(cfg.bpfedctta.stress.cells[cell])
    base = cfg.adapt
    text = (f"lr {s.get('lr', 'per method')}, {s.get('passes', base.passes)} passes, "
            f"{s.get('stream', base.get('stream', 'shuffled'))} stream, batch {s.get('batch_size', base.batch_size)}")
    if "beta" in s or "normalizer" in s:
        ugsa = cfg.aggregator.params if cfg.aggregator.name == "ugsa" else {}
        text += (f"; UGSA β = {s.get('beta', ugsa.get('beta', '?'))}, "
                 f"normaliser {s.get('normalizer', ugsa.get('normalizer', '?'))}")
    return text


def online_curves(folder: Path) -> Dict[str, np.ndarray]:
    """``{method+aggregator: (seeds, arrivals) online accuracy}`` from a cell's ``cells/*/arrivals.csv``."""
    curves: Dict[str, List[List[float]]] = {}
    for csv_path in sorted((folder / "cells").glob("*/arrivals.csv")):  # <method>-<aggregator>-s<seed>/
        method, aggregator = csv_path.parent.name.split("-")[:2]
        with csv_path.open() as fh:
            acc = [float(row["online_acc"]) for row in csv.DictReader(fh)]
        curves.setdefault(f"{method}+{aggregator}", []).append(acc)
    return {k: np.asarray(curves[k]) for k in sorted(curves, key=_sweep_order)}


def _sweep_order(name: str) -> tuple:
    """A ``method+aggregator`` key in the sweep's order: method, then aggregator (unknown names last)."""
    method, aggregator = name.split("+")
    rank = lambda v, order: (order.index(v) if v in order else len(order), v)  # noqa: E731
    return rank(method, ("source", "bn", "tent", "bpa")) + rank(aggregator, ("none", "sequential", "fedavg", "ugsa"))


def plot_cell(folder: Path, *, title: str) -> Path:
    """Online accuracy per arrival of every method+aggregator, and each minus BN's (when BN ran)."""
    from fedcore.evaluate.plots import plot_curves

    curves = online_curves(folder)
    return plot_curves(curves, folder / "online_by_method.png", title=title, xlabel="arrival",
                       ylabel="online accuracy (mean over seeds)",
                       reference=next((k for k in curves if k.startswith("bn+")), None))


def _log_figure(cfg: DictConfig, cell: str, path: Path) -> None:
    import mlflow

    from flows import tracking

    tracking.setup(C.tracking_uri(cfg), cfg.flow.experiment)
    with mlflow.start_run(run_name=f"stress-{cell}"):
        mlflow.set_tags({"fedcore.kind": "stress-cell", "stress.cell": cell})
        mlflow.log_params({k: v for k, v in dict(cfg.bpfedctta.stress.cells[cell]).items()})
        mlflow.log_artifact(str(path))


# ------------------------------------------------------------------------------------ report
def load_cell(folder: Path) -> Dict[str, Dict[int, Mapping[str, float]]]:
    """``{method+aggregator: {seed: summary}}`` from a cell's summary.json."""
    raw = json.loads((folder / "summary.json").read_text())
    out: Dict[str, Dict[int, Mapping[str, float]]] = {}
    for key, summary in raw.items():
        if key == "headline":
            continue
        parts = key.split("+")
        out.setdefault(f"{parts[0]}+{parts[1]}", {})[int(parts[-1][1:])] = summary
    return out


def paired(cell: Mapping[str, Mapping[int, Mapping[str, float]]], metric: str, target: str,
           other: str) -> Dict[str, float]:
    """``target`` − ``other`` on ``metric`` over the seeds both ran: mean gap, wins, paired t-test p."""
    from scipy.stats import ttest_rel

    seeds = sorted(set(cell[target]) & set(cell[other]))
    a = np.array([cell[target][s][metric] for s in seeds])
    b = np.array([cell[other][s][metric] for s in seeds])
    gap = a - b
    p = float("nan") if len(seeds) < 2 or np.all(gap == gap[0]) else float(ttest_rel(a, b).pvalue)
    return {"n": len(seeds), "gap": float(gap.mean()), "wins": int((gap > 0).sum()), "p": p}


def report(cfg: DictConfig) -> str:
    """Mean ± std per cell, the paired tests of BPA+UGSA, and the same pooled over cells × seeds (Wilcoxon)."""
    from fedcore.evaluate.stats import wilcoxon_against

    root = results_root(cfg)
    ran = [c for c in cell_names(cfg) if (root / c / "summary.json").is_file()]
    if not ran:
        raise FileNotFoundError(f"no stress cell has results under {root}. Build one with "
                                f"`dvc repro stress@{cell_names(cfg)[0]}` (or `make stress` for all).")
    lines = ["# BPFedCTTA stress protocol", "",
             f"Cells run: {len(ran)} of {len(cell_names(cfg))} ({', '.join(ran)}). "
             "Mean ± std over seeds; gaps are BPA+UGSA minus the named method, paired by seed "
             "(p: paired t-test, nan when a gap cannot vary).", ""]
    pooled: Dict[str, List[float]] = {}
    summary: Dict[str, Dict] = {}
    for c in ran:
        cell = load_cell(root / c)
        lines += [f"## {c}: {describe(cfg, c)}", "", "| method | " + " | ".join(n for _, n in METRICS) + " |",
                  "|---|" + "---|" * len(METRICS)]
        for name, by_seed in sorted(cell.items(), key=lambda kv: _sweep_order(kv[0])):
            vals = [[by_seed[s][m] for s in sorted(by_seed)] for m, _ in METRICS]
            lines.append(f"| {name} | " + " | ".join(f"{np.mean(v):.3f} ± {np.std(v):.3f}" for v in vals) + " |")
        lines.append("")
        summary[c] = {name: {m: float(np.mean([by_seed[s][m] for s in by_seed])) for m, _ in METRICS}
                      for name, by_seed in cell.items()}
        if TARGET in cell:
            lines += ["| BPA+UGSA against | final hold-out gap | wins | p | online gap | wins | p |",
                      "|---|---|---|---|---|---|---|"]
            for other in PAIRED_AGAINST:
                if other not in cell:
                    continue
                h = paired(cell, "final_avg_holdout_acc", TARGET, other)
                o = paired(cell, "avg_online_acc", TARGET, other)
                lines.append(f"| {other} | {h['gap']:+.3f} | {h['wins']}/{h['n']} | {h['p']:.3f} | "
                             f"{o['gap']:+.3f} | {o['wins']}/{o['n']} | {o['p']:.3f} |")
            lines.append("")
            common = sorted(set.intersection(*(set(cell[m]) for m in (TARGET, *PAIRED_AGAINST) if m in cell)))
            for m in (TARGET, *PAIRED_AGAINST):
                if m in cell:
                    pooled.setdefault(m, []).extend(cell[m][s]["final_avg_holdout_acc"] for s in common)
        lines.append(f"![online accuracy per arrival]({c}/online_by_method.png)")
        lines.append("")
    if TARGET in pooled and len(pooled[TARGET]) >= 2:
        lines += ["## Pooled over cells × seeds (final hold-out accuracy, Wilcoxon signed-rank)", "",
                  "| BPA+UGSA against | blocks | mean gap | wins | p |", "|---|---|---|---|---|"]
        usable = {m: v for m, v in pooled.items() if len(v) == len(pooled[TARGET])}
        for t in wilcoxon_against(usable, TARGET):
            lines.append(f"| {t.other} | {t.n} | {t.mean_gap:+.3f} | {t.wins}/{t.n} | {t.p_value:.3f} |")
        lines.append("")
    text = "\n".join(lines).replace("](", f"]({root.name}/")
    report_md, summary_json = report_paths(cfg)
    report_md.write_text(text)
    summary_json.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return text


def report_paths(cfg: DictConfig) -> tuple:
    """Beside the cells' folder, not in it: the report stage reads that whole folder."""
    root = results_root(cfg)
    return root.parent / f"{root.name}_report.md", root.parent / f"{root.name}_summary.json"


def check(cfg: DictConfig, cells: Sequence[str] | None = None) -> None:
    """Every cell composes into a valid sweep, before any work (a typo fails in a second)."""
    for cell in cells or cell_names(cfg):
        ccfg = cell_config(cfg, cell)
        for m in ccfg.sweep.methods:
            for a in ccfg.sweep.aggregators:
                C.arrival_config(ccfg, method=str(m), aggregator=str(a))
