"""Stress protocols: where continual test-time adaptation degrades, and what prevents it.

Three protocols share this code, each a block of the config (``<system>.stress``, or
``bpfedctta.stress_cifar``):

- ``bpfedctta`` (``bpfedctta.stress``, DVC ``stress@<cell>``): a cell lays a few settings over the
  ``mnist`` variant: the adaptation ``lr`` of every gradient method, the number of ``passes`` over the
  10 clients, the ``stream`` order and the ``batch_size``. Each cell is the sweep {source, bn, tent,
  bpa} × {none, sequential, fedavg, ugsa} × seeds. Do BPA or UGSA prevent continual Tent's decline?
- ``dptta`` (``dptta.stress``, DVC ``stress_private@<cell>``): the same over the ``private`` variant
  (GroupNorm model): {source, tent, sar, deyo, come} in the continual setting (``sequential``) × privacy
  forms {plain, clip, dp} × seeds. Where do the plain methods fall below the source model, and do
  clipping (the paper's clip-only form) or DP recover them?

- ``cifar10`` (``bpfedctta.stress_cifar``, DVC ``stress_cifar@<cell>``): the BPFedCTTA protocol over the
  ``cifar10`` variant (ResNet-20 on CIFAR-10-C), on a narrower sweep: a CIFAR arrival costs about 25
  times an MNIST one.

Each cell writes ``results/<protocol folder>/<cell>/``, with one figure of online accuracy per arrival
for every method; the report stage pairs the cells that were run (mean ± std, paired tests by seed).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np
from omegaconf import DictConfig, OmegaConf

from flows.config import compose as C
from flows.config import schema

METRICS = (
    ("final_avg_holdout_acc", "final hold-out"),
    ("avg_online_acc", "online"),
    ("final_worst_holdout_acc", "worst hold-out"),
    ("forgetting", "forgetting"),
)


@dataclass(frozen=True)
class Protocol:
    """Where a stress protocol lives in the config and DVC, and what its report pairs."""

    system: str  # the config block holding ``stress`` (and the variant)
    variant: str  # the variant every cell is laid over
    stage: str  # the DVC foreach stage, ``<stage>@<cell>``
    title: str
    order: Tuple[Tuple[str, ...], ...]  # the sweep's display order: methods, aggregators, privacy forms
    gaps: str  # what the report's gaps are, in words
    target: str | None = None  # one run paired against ``against`` in every cell, and pooled
    target_label: str = ""
    against: Tuple[str, ...] = ()
    block: str = "stress"  # the key of the protocol's block under ``system``


_BPFEDCTTA = dict(
    order=(("source", "bn", "tent", "bpa"), ("none", "sequential", "fedavg", "ugsa")),
    gaps="BPA+UGSA minus the named method",
    target="bpa+ugsa",
    target_label="BPA+UGSA",
    against=("tent+sequential", "tent+ugsa", "bpa+sequential"),
)
PROTOCOLS = {
    "bpfedctta": Protocol("bpfedctta", "mnist", "stress", "BPFedCTTA stress protocol", **_BPFEDCTTA),
    "cifar10": Protocol(
        "bpfedctta",
        "cifar10",
        "stress_cifar",
        "BPFedCTTA stress protocol on CIFAR-10-C",
        block="stress_cifar",
        **_BPFEDCTTA,
    ),
    "dptta": Protocol(
        "dptta",
        "private",
        "stress_private",
        "DP-TTA stress protocol (GroupNorm)",
        (
            ("source", "tent", "eata", "sar", "deyo", "come", "bpa"),
            ("none", "sequential", "fedavg", "ugsa"),
            ("plain", "clip", "dp0", "dp-eps1", "dp-eps5", "dp-eps10", "dp-eps20"),
        ),
        "each plain method minus the source model, and each privacy form minus its plain method",
    ),
}


def protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"unknown stress protocol {name!r}; valid names are: {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]


def _stress(cfg: DictConfig, proto: Protocol) -> DictConfig:
    return cfg[proto.system][proto.block]


def cell_names(cfg: DictConfig, name: str = "bpfedctta") -> List[str]:
    return [str(k) for k in _stress(cfg, protocol(name)).cells]


def results_root(cfg: DictConfig, name: str = "bpfedctta") -> Path:
    return C.resolve_path(_stress(cfg, protocol(name)).results)


def cell_config(cfg: DictConfig, cell: str, name: str = "bpfedctta") -> DictConfig:
    """The protocol's variant with stress cell ``cell`` laid over it, writing to its own results folder."""
    proto = protocol(name)
    stress = _stress(cfg, proto)
    if cell not in stress.cells:
        raise ValueError(f"unknown stress cell {cell!r}; valid names are: {', '.join(cell_names(cfg, name))}")
    settings = dict(stress.cells[cell])
    unknown = sorted(set(settings) - set(schema.STRESS_CELL))
    if unknown:
        raise ValueError(f"stress cell {cell!r} sets {unknown}; a cell may set: {', '.join(schema.STRESS_CELL)}")
    chosen = str(cfg.get("variant", proto.variant))
    overlay = cfg[C.variant_system(cfg, chosen)].variants[chosen]
    if chosen != proto.variant and any((OmegaConf.to_container(overlay) or {}).values()):
        # its settings are already laid over cfg: the protocol's variant on top would keep some of them
        raise ValueError(
            f"variant={chosen}: the {name} stress cells run on variant {proto.variant!r} (its inputs and its "
            f"results folder); drop variant={chosen}"
        )
    out = C.with_variant(cfg, proto.variant)
    OmegaConf.set_struct(out, False)
    out.sweep.methods = list(stress.methods)
    out.sweep.aggregators = list(stress.aggregators)
    out.sweep.privacy = list(stress.get("privacy", ["plain"]))
    for key, value in settings.items():
        OmegaConf.update(out, schema.STRESS_CELL[key], value, force_add=True)
    out.sweep.seeds = [int(s) for s in stress.seeds]
    out.paths.results = str(Path(str(stress.results)) / cell)
    out.paths.checkpoints = str(Path(str(cfg.paths.checkpoints)) / Path(str(stress.results)).name / cell)
    out.flow.experiment = str(stress.experiment)
    out.flow.register = "none"  # a stress cell is a measurement, not a model to deploy
    return out


def run_cell(cfg: DictConfig, name: str = "bpfedctta") -> Path:
    """The sweep of the cell named by ``<system>.stress.cell``, then its figure (also logged to MLflow)."""
    from flows.runs.steps import adapt

    proto = protocol(name)
    cell = _stress(cfg, proto).cell
    if cell is None:
        raise ValueError(
            f"name a stress cell: {proto.system}.{proto.block}.cell=<name>, one of {', '.join(cell_names(cfg, name))}"
        )
    ccfg = cell_config(cfg, str(cell), name)
    adapt(ccfg)
    folder = C.resolve_path(ccfg.paths.results)
    fig = plot_cell(folder, title=f"stress cell {cell}: {describe(cfg, str(cell), name)}", name=name)
    _log_figure(ccfg, str(cell), fig, proto)
    return fig


def describe(cfg: DictConfig, cell: str, name: str = "bpfedctta") -> str:
    proto = protocol(name)
    s = dict(_stress(cfg, proto).cells[cell])
    base = C.with_variant(cfg, proto.variant).adapt
    text = (
        f"lr {s.get('lr', 'per method')}, {s.get('passes', base.passes)} passes, "
        f"{s.get('stream', base.get('stream', 'shuffled'))} stream, batch {s.get('batch_size', base.batch_size)}"
    )
    if "beta" in s or "normalizer" in s:
        ugsa = cfg.aggregator.params if cfg.aggregator.name == "ugsa" else {}
        text += (
            f"; UGSA β = {s.get('beta', ugsa.get('beta', '?'))}, "
            f"normaliser {s.get('normalizer', ugsa.get('normalizer', '?'))}"
        )
    return text


def _runs(raw: Mapping[str, object]) -> List[Tuple[str, int, str]]:
    """``(method+aggregator[+form], seed, run folder name)`` of every run in a cell's summary.json ``raw``.

    The run folders are named ``method-aggregator[-form]-s<seed>`` (flows.runs.tasks.cell_name), and a
    privacy form may hold a hyphen itself (``dp-eps10``): so the names come from summary.json's keys.
    """
    out = []
    for key in raw:
        if key == "headline":
            continue
        parts = key.split("+")
        out.append(("+".join(parts[:-1]), int(parts[-1][1:]), "-".join(parts)))
    return out


def _summary(folder: Path) -> Dict[str, Mapping[str, float]]:
    return json.loads((folder / "summary.json").read_text())


def online_curves(folder: Path, name: str = "bpfedctta") -> Dict[str, np.ndarray]:
    """``{method+aggregator[+form]: (seeds, arrivals) online accuracy}`` from a cell's run folders."""
    curves: Dict[str, List[List[float]]] = {}
    for key, _seed, run in sorted(_runs(_summary(folder)), key=lambda r: r[1]):
        with (folder / "cells" / run / "arrivals.csv").open() as fh:
            acc = [float(row["online_acc"]) for row in csv.DictReader(fh)]
        curves.setdefault(key, []).append(acc)
    return {k: np.asarray(curves[k]) for k in sorted(curves, key=lambda k: _sweep_order(k, name))}


def _sweep_order(key: str, name: str = "bpfedctta") -> tuple:
    """A ``method+aggregator[+form]`` key in the sweep's order: method, aggregator, form (unknown last).

    A form with a clip norm (``clip-c5``) sorts beside its form without one, by clip norm (C = 1 unnamed).
    """
    parts = key.split("+")
    parts += ["plain"] * (3 - len(parts))
    order = protocol(name).order + (("plain",),) * (3 - len(protocol(name).order))
    return sum((_rank(v, o) for v, o in zip(parts, order)), ())


def _rank(value: str, order: Sequence[str]) -> tuple:
    base, clip = value, 1.0
    if value not in order and "-c" in value:
        head, _, tail = value.rpartition("-c")
        try:
            base, clip = head, float(tail)
        except ValueError:
            pass
    return (order.index(base) if base in order else len(order), base, clip, value)


def plot_cell(folder: Path, *, title: str, name: str = "bpfedctta") -> Path:
    """Online accuracy per arrival of every run, and each minus the reference's (BN, else the source)."""
    from fedcore.evaluate.plots import plot_curves

    curves = online_curves(folder, name)
    reference = next((k for k in curves if k.startswith("bn+")), None) or next(
        (k for k in curves if k.startswith("source+")), None
    )
    return plot_curves(
        curves,
        folder / "online_by_method.png",
        title=title,
        xlabel="arrival",
        ylabel="online accuracy (mean over seeds)",
        reference=reference,
    )


def _log_figure(cfg: DictConfig, cell: str, path: Path, proto: Protocol) -> None:
    import mlflow

    from flows.services import tracking

    tracking.setup(C.tracking_uri(cfg), cfg.flow.experiment)
    with tracking.start_run(f"{proto.stage.replace('_', '-')}-{cell}"):
        mlflow.set_tags({"fedcore.kind": "stress-cell", "stress.cell": cell, "stress.protocol": proto.stage})
        mlflow.log_params({k: v for k, v in dict(_stress(cfg, proto).cells[cell]).items()})
        mlflow.log_artifact(str(path))


# ------------------------------------------------------------------------------------ report
def load_cell(folder: Path) -> Dict[str, Dict[int, Mapping[str, float]]]:
    """``{method+aggregator[+form]: {seed: summary}}`` from a cell's summary.json."""
    raw = _summary(folder)
    out: Dict[str, Dict[int, Mapping[str, float]]] = {}
    for key, seed, _run in _runs(raw):
        out.setdefault(key, {})[seed] = raw[f"{key}+s{seed}"]
    return out


def paired(
    cell: Mapping[str, Mapping[int, Mapping[str, float]]], metric: str, target: str, other: str
) -> Dict[str, float]:
    """``target`` − ``other`` on ``metric`` over the seeds both ran: mean gap, wins, paired t-test p."""
    from scipy.stats import ttest_rel

    seeds = sorted(set(cell[target]) & set(cell[other]))
    a = np.array([cell[target][s][metric] for s in seeds])
    b = np.array([cell[other][s][metric] for s in seeds])
    gap = a - b
    p = float("nan") if len(seeds) < 2 or np.all(gap == gap[0]) else float(ttest_rel(a, b).pvalue)
    return {"n": len(seeds), "gap": float(gap.mean()), "wins": int((gap > 0).sum()), "p": p}


def privacy_pairs(cell: Mapping[str, object]) -> List[Tuple[str, str]]:
    """DP-TTA's questions, per gradient method and aggregator: plain − source, then each form − plain."""
    pairs = []
    sources = [k for k in cell if k.startswith("source+")]
    for key in cell:
        method, aggregator, *form = key.split("+")
        if method == "source":
            continue
        if not form:  # the source run under the same aggregator, else the one there is
            same = f"source+{aggregator}"
            pairs += [(key, same)] if same in cell else [(key, src) for src in sources]
        else:
            plain = f"{method}+{aggregator}"
            if plain in cell:
                pairs.append((key, plain))
    return pairs


def _pair_rows(cell, pairs: Sequence[Tuple[str, str]], *, label) -> List[str]:
    rows = []
    for target, other in pairs:
        h = paired(cell, "final_avg_holdout_acc", target, other)
        o = paired(cell, "avg_online_acc", target, other)
        rows.append(
            f"| {label(target, other)} | {h['gap']:+.3f} | {h['wins']}/{h['n']} | {h['p']:.3f} | "
            f"{o['gap']:+.3f} | {o['wins']}/{o['n']} | {o['p']:.3f} |"
        )
    return rows


def report(cfg: DictConfig, name: str = "bpfedctta") -> str:
    """Mean ± std per cell, the paired tests, and (with a target) those pooled over cells × seeds (Wilcoxon)."""
    from fedcore.evaluate.stats import wilcoxon_against

    proto = protocol(name)
    root = results_root(cfg, name)
    ran = [c for c in cell_names(cfg, name) if (root / c / "summary.json").is_file()]
    if not ran:
        raise FileNotFoundError(
            f"no stress cell has results under {root}. Build one with "
            f"`dvc repro {proto.stage}@{cell_names(cfg, name)[0]}` (or all of them with "
            f"`dvc repro {proto.stage}_report`)."
        )
    lines = [
        f"# {proto.title}",
        "",
        f"Cells run: {len(ran)} of {len(cell_names(cfg, name))} ({', '.join(ran)}). "
        f"Mean ± std over seeds; gaps are {proto.gaps}, paired by seed "
        "(p: paired t-test, nan when a gap cannot vary or with one seed).",
        "",
    ]
    # per comparison, block by block over the cells holding both rows (an ablation cell holds few rows)
    pooled: Dict[str, Tuple[List[float], List[float], List[str]]] = {}
    summary: Dict[str, Dict] = {}
    for c in ran:
        cell = load_cell(root / c)
        lines += [
            f"## {c}: {describe(cfg, c, name)}",
            "",
            "| method | " + " | ".join(n for _, n in METRICS) + " |",
            "|---|" + "---|" * len(METRICS),
        ]
        for key, by_seed in sorted(cell.items(), key=lambda kv: _sweep_order(kv[0], name)):
            vals = [[by_seed[s][m] for s in sorted(by_seed)] for m, _ in METRICS]
            lines.append(f"| {key} | " + " | ".join(f"{np.mean(v):.3f} ± {np.std(v):.3f}" for v in vals) + " |")
        lines.append("")
        summary[c] = {
            key: {m: float(np.mean([by_seed[s][m] for s in by_seed])) for m, _ in METRICS}
            for key, by_seed in cell.items()
        }
        head = "| final hold-out gap | wins | p | online gap | wins | p |"
        if proto.target and proto.target in cell:
            lines += [f"| {proto.target_label} against {head}", "|---|---|---|---|---|---|---|"]
            lines += _pair_rows(cell, [(proto.target, o) for o in proto.against if o in cell], label=lambda t, o: o)
            lines.append("")
            for other in (o for o in proto.against if o in cell):
                mine, theirs, cells = pooled.setdefault(other, ([], [], []))
                seeds = sorted(set(cell[proto.target]) & set(cell[other]))
                mine.extend(cell[proto.target][s]["final_avg_holdout_acc"] for s in seeds)
                theirs.extend(cell[other][s]["final_avg_holdout_acc"] for s in seeds)
                cells.append(c)
        elif not proto.target:
            pairs = sorted(privacy_pairs(cell), key=lambda p: (_sweep_order(p[0], name), _sweep_order(p[1], name)))
            if pairs:
                lines += [f"| comparison {head}", "|---|---|---|---|---|---|---|"]
                lines += _pair_rows(cell, pairs, label=lambda t, o: f"{t} − {o}")
                lines.append("")
        lines.append(f"![online accuracy per arrival]({c}/online_by_method.png)")
        lines.append("")
    testable = {o: v for o, v in pooled.items() if len(v[0]) >= 2}
    if testable:
        lines += [
            "## Pooled over cells × seeds (final hold-out accuracy, Wilcoxon signed-rank)",
            "",
            "Each comparison pools the cells that hold both rows, seed by seed.",
            "",
            f"| {proto.target_label} against | cells | blocks | mean gap | wins | p |",
            "|---|---|---|---|---|---|",
        ]
        for other, (mine, theirs, cells) in testable.items():
            (t,) = wilcoxon_against({proto.target: mine, other: theirs}, proto.target)
            lines.append(f"| {other} | {len(cells)} | {t.n} | {t.mean_gap:+.3f} | {t.wins}/{t.n} | {t.p_value:.3f} |")
        lines.append("")
    text = "\n".join(lines).replace("](", f"]({root.name}/")
    report_md, summary_json = report_paths(cfg, name)
    report_md.write_text(text)
    summary_json.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return text


def report_paths(cfg: DictConfig, name: str = "bpfedctta") -> tuple:
    """Beside the cells' folder, not in it: the report stage reads that whole folder."""
    root = results_root(cfg, name)
    return root.parent / f"{root.name}_report.md", root.parent / f"{root.name}_summary.json"


def check(cfg: DictConfig, cells: Sequence[str] | None = None, name: str = "bpfedctta") -> None:
    """Every cell composes into a valid sweep, before any work (a typo fails in a second)."""
    from flows.runs.tasks import sweep_cells

    for cell in cells or cell_names(cfg, name):
        ccfg = cell_config(cfg, cell, name)
        C.check_forms(ccfg, list(ccfg.sweep.privacy), where=f"stress cell {cell!r}: privacy")
        for m, a, f, s in sweep_cells(ccfg):
            C.arrival_config(ccfg, method=m, aggregator=a, form=f, seed=s)
