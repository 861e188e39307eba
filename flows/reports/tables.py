"""What a round-based grid writes for DVC and people: tables, summaries, paired tests and plots.

One writer per evaluation (:mod:`flows.reports.evaluations` says which a system uses): per-domain accuracy
with the worst domain (:func:`write_grid_report`), open-set AUROC and OSCR
(:func:`write_openset_report`), class-incremental accuracy (:func:`write_incremental_report`).
Each writes ``table.md``, ``summary.json`` (DVC metrics), ``scores.json`` (what the paired tests
use), ``stats.md`` and ``methods.png`` into the grid's results folder: the stage's outputs, which hold
nothing that differs between two runs of the same cells, so that ``dvc repro`` rebuilds them to the bytes
``dvc.lock`` records. How long the methods took goes to ``timings.md`` beside them (:func:`write_timings`),
which DVC does not track.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

import numpy as np

from fedcore.evaluate.plots import plot_domain_shares, plot_methods
from fedcore.evaluate.stats import friedman_p, friedman_ranks, wilcoxon_against
from flows.config import compose as C

# The summary.json keys a reader compares first, by the system's evaluation (``python -m flows.reports.exp``'s
# columns); the rest (per-domain scores, spreads) are there for ``--all`` and ``dvc exp diff``.
HEADLINE_KEYS = {
    "domains": ("avg_acc", "worst_acc"),
    "openset": ("closed_acc", "auroc", "oscr"),
    "incremental": ("avg_inc_acc", "final_acc", "forgetting"),
    "arrivals": ("avg_online_acc", "final_avg_holdout_acc", "final_worst_holdout_acc", "forgetting"),
}

# timings.md's columns for a grid of rounds: (header, key, format)
ROUND_TIMES = (("server aggregation ms per round", "agg_ms", ".1f"), ("run s", "seconds", ".0f"))


def write_timings(
    agg: List[Mapping[str, Any]], out: Path, *, title: str, columns: Tuple[Tuple[str, str, str], ...]
) -> Path:
    """``timings.md``: how long each method took where the grid ran, mean over its seeds.

    ``columns``: ``(header, key of an agg entry, format)``. Not a stage output: the same cells take a different
    time on every run, so DVC does not track it and ``make push`` does not share it; each cell's MLflow run
    holds the same measurements (``run_seconds``, ``agg_seconds`` per round)."""
    head = "| method | " + " | ".join(h for h, _, _ in columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    lines += ["| " + " | ".join([str(a["method"]), *(format(a[k], f) for _, k, f in columns)]) + " |" for a in agg]
    path = out / "timings.md"
    path.write_text(
        f"{title}: wall-clock time on the machine that ran the grid, mean over seeds. Machine-dependent and "
        "not tracked by DVC.\n\n" + "\n".join(lines) + "\n"
    )
    return path


def write_grid_report(
    rows: List[Dict[str, Any]],
    *,
    domains: List[str],
    out: Path,
    title: str,
    target: str | None,
    sizes: Mapping[str, Tuple[int, int]] | None = None,
) -> str:
    """table.md (mean ± std over seeds), summary.json (DVC metrics), stats.md and methods.png.

    Rows with ``shares`` (each domain's share of the round's client average per round, and ``weights``, how the
    server weighs clients) add a weights column, and a second table and ``weights.png`` of each domain's
    share; ``sizes`` (per domain: clients, training examples) heads the table. "worst domain" is the domain
    lowest in most seeds, with how many when the seeds disagree."""
    out.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {m: [r for r in rows if r["method"] == m] for m in methods}
    agg = []
    for m in methods:
        rs = by[m]
        avg = np.array([r["summary"]["final_avg_acc"] for r in rs])
        worst = np.array([r["summary"]["final_worst_acc"] for r in rs])
        agg.append(
            {
                "method": m,
                "n": len(rs),
                "avg_mean": float(avg.mean()),
                "avg_std": float(avg.std(ddof=0)),
                "worst_mean": float(worst.mean()),
                "worst_std": float(worst.std(ddof=0)),
                "domains": {d: float(np.mean([r["summary"][f"final_acc.{d}"] for r in rs])) for d in domains},
                "agg_ms": 1000 * float(np.mean([r["summary"]["agg_seconds_mean"] for r in rs])),
                "mib_per_round": float(np.mean([r["summary"]["bytes_per_round"] for r in rs])) / 2**20,
                "seconds": float(np.mean([r["seconds"] for r in rs])),
                "weights": rs[0].get("weights") or "–",
                "worst_domain": _worst_domain(rs, domains),
                "shares": _mean_shares([r.get("shares") or [] for r in rs], domains),
            }
        )
    seeds = max(a["n"] for a in agg)
    shared = any(a["shares"] is not None for a in agg)
    wcol = " weights |" if shared else ""
    head = f"| method |{wcol} avg acc | worst acc | worst domain | {' | '.join(domains)} | MiB/round |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in agg:
        lines.append(
            f"| {a['method']} |"
            + (f" {a['weights']} |" if shared else "")
            + f" {a['avg_mean']:.3f} ± {a['avg_std']:.3f} | {a['worst_mean']:.3f} ± {a['worst_std']:.3f} | "
            + f"{a['worst_domain']} | "
            + " | ".join(f"{a['domains'][d]:.3f}" for d in domains)
            + f" | {a['mib_per_round']:.2f} |"
        )
    table = "\n".join(lines)
    heading = f"{title}: final-round test accuracy, mean ± std over {seeds} seed(s)"
    if sizes:
        heading += ". Domains (clients / training examples): " + ", ".join(
            f"{d} {sizes[d][0]} / {sizes[d][1]:,}" for d in domains
        )
    text = heading + "\n\n" + table + "\n"
    if shared:
        text += "\n" + _shares_table(agg, domains) + "\n"
        series = {a["method"]: a["shares"] for a in agg if a["shares"] is not None}
        plot_domain_shares(
            series, domains, out / "weights.png", title=f"{title}: each domain's share of the round's average"
        )
    (out / "table.md").write_text(text)
    write_timings(agg, out, title=title, columns=ROUND_TIMES)
    summary = {
        a["method"]: {
            "avg_acc": a["avg_mean"],
            "avg_acc_std": a["avg_std"],
            "worst_acc": a["worst_mean"],
            "worst_acc_std": a["worst_std"],
            **{f"acc.{d}": v for d, v in a["domains"].items()},
        }
        for a in agg
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    scores = {m: [r["summary"]["final_worst_acc"] for r in sorted(by[m], key=lambda r: r["seed"])] for m in methods}
    (out / "scores.json").write_text(json.dumps({"worst_acc_by_seed": scores}, indent=1) + "\n")
    plot_methods(agg, out / "methods.png", title=f"{title}: average and worst-domain accuracy")
    if target is not None and len(methods) > 1 and len({len(v) for v in scores.values()}) == 1:
        (out / "stats.md").write_text(stats_report(scores, target) + "\n")
    else:
        (out / "stats.md").write_text(
            f"No paired test: this grid has no {target or 'target'} method beside others with the same seeds.\n"
        )
    return table


def _worst_domain(rows: List[Mapping[str, Any]], domains: List[str]) -> str:
    """The domain that scored lowest in most seeds (the first of a tie), with ``(k/n)`` when not in all n."""
    lowest = [min(domains, key=lambda d: r["summary"][f"final_acc.{d}"]) for r in rows]
    top = max(domains, key=lambda d: (lowest.count(d), -domains.index(d)))
    k = lowest.count(top)
    return top if k == len(lowest) else f"{top} ({k}/{len(lowest)})"


def _mean_shares(per_seed: List[List[Mapping[str, float]]], domains: List[str]) -> np.ndarray | None:
    """(rounds, domains): each domain's share of the round's client average, mean over seeds (NaN where no client
    merged); None when no seed has shares."""
    runs = [np.array([[s.get(d, np.nan) for d in domains] for s in shares]) for shares in per_seed if shares]
    if not runs or len({r.shape for r in runs}) != 1:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a round in which no seed merged a client
        return np.nanmean(np.stack(runs), axis=0)


def _shares_table(agg: List[Mapping[str, Any]], domains: List[str]) -> str:
    """Each domain's share of the round's client average (the server's weights summed over its merged clients),
    mean over rounds and seeds, then the last round's."""
    head = f"| method | weights | {' | '.join(domains)} |"
    lines = [
        "Each domain's share of the round's client average (before any server step, such as FedAdam's or "
        "FedDyn's): the server's weights summed over the domain's merged clients, mean over rounds and seeds "
        "(last round in brackets).",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for a in agg:
        sh = a["shares"]
        if sh is None:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(sh, axis=0)
        lines.append(
            f"| {a['method']} | {a['weights']} | "
            + " | ".join(f"{mean[k]:.3f} ({sh[-1, k]:.3f})" for k in range(len(domains)))
            + " |"
        )
    return "\n".join(lines)


def write_openset_report(
    rows: List[Dict[str, Any]],
    *,
    domains: List[str],
    out: Path,
    title: str,
    scores: Dict[str, List[str]],
    target: str | None,
    unknown_sets: Mapping[str, Mapping[str, List[int]]] | None = None,
    unknown_counts: Mapping[str, Mapping[int, int]] | None = None,
    known: Mapping[int, List[int]] | None = None,
) -> str:
    """table.md, summary.json, scores.json, stats.md and methods.png of an open-set grid.

    ``known`` (seed -> its known classes) marks a grid whose known classes were drawn per seed: table.md
    then names each seed's split and adds the authors' max(AUROC, 1 − AUROC) beside the signed AUROC.

    A method scored several ways (FedAvg: MSP and OpenMax) gives one row per score,
    ``<method>+<score>``. The paired tests use (seed × domain) blocks of AUROC. With
    ``unknown_sets`` (heterogeneous unknowns) and ``unknown_counts`` (per domain, the unknown test
    rows of each class), table.md adds each method's AUROC per scenario, beside the scenario's
    pairwise overlap, and what the same scenario gives under every relabelling of the unknown
    classes (:func:`relabelled_aurocs`), and its AUROC per unknown class.
    """
    out.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    wanted = [
        *(unknown_sets or {}),
        *(f"class{c}" for c in sorted({c for cs in (unknown_counts or {}).values() for c in cs}) if unknown_sets),
    ]
    for r in rows:
        missing = [u for u in wanted if not any(k.startswith(f"final_auroc_{u}.") for k in r["summary"])]
        if missing:  # the checkpoint fingerprint covers training, not evaluation settings
            raise ValueError(
                f"{r['method']} seed {r['seed']} has no AUROC for unknown scenario(s) {missing}: its "
                "records come from a checkpoint written before unknown_sets named them. Rerun the grid "
                "with flow.resume=false (resume never re-evaluates a finished round)"
            )
    agg, per_block = [], {}
    for m in methods:
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["seed"])
        for s in scores[m]:
            name = m if len(scores[m]) == 1 else f"{m}+{s}"
            col = {
                k: np.array([r["summary"][f"final_{k}"] for r in rs])
                for k in ("avg_acc", "worst_acc", f"auroc.{s}", f"oscr.{s}", *((f"auroc_max.{s}",) if known else ()))
            }
            agg.append(
                {
                    "method": name,
                    "n": len(rs),
                    "acc_mean": float(col["avg_acc"].mean()),
                    "acc_std": float(col["avg_acc"].std()),
                    "auroc_mean": float(col[f"auroc.{s}"].mean()),
                    "auroc_std": float(col[f"auroc.{s}"].std()),
                    "oscr_mean": float(col[f"oscr.{s}"].mean()),
                    "oscr_std": float(col[f"oscr.{s}"].std()),
                    **(
                        {
                            "auroc_max_mean": float(col[f"auroc_max.{s}"].mean()),
                            "auroc_max_std": float(col[f"auroc_max.{s}"].std()),
                        }
                        if known
                        else {}
                    ),
                    "domains": {d: float(np.mean([r["summary"][f"final_auroc.{s}.{d}"] for r in rs])) for d in domains},
                    "agg_ms": 1000 * float(np.mean([r["summary"]["agg_seconds_mean"] for r in rs])),
                    "mib_per_round": float(np.mean([r["summary"]["bytes_per_round"] for r in rs])) / 2**20,
                    "seconds": float(np.mean([r["seconds"] for r in rs])),
                    "scenarios": {
                        u: np.array([r["summary"][f"final_auroc_{u}.{s}"] for r in rs]) for u in (unknown_sets or {})
                    },
                    "per_class": {
                        (d, c): np.array([r["summary"][f"final_auroc_class{c}.{s}.{d}"] for r in rs])
                        for d, cs in (unknown_counts or {}).items()
                        for c in cs
                    }
                    if unknown_sets
                    else {},
                }
            )
            per_block[name] = [r["summary"][f"final_auroc.{s}.{d}"] for r in rs for d in domains]
    seeds = max(a["n"] for a in agg)
    folded = " max(AUROC, 1 − AUROC) |" if known else ""
    head = f"| method | closed acc | AUROC |{folded} OSCR | {' | '.join(domains)} | MiB/round |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in agg:
        lines.append(
            f"| {a['method']} | {a['acc_mean']:.3f} ± {a['acc_std']:.3f} | {a['auroc_mean']:.3f} ± "
            f"{a['auroc_std']:.3f} | "
            + (f"{a['auroc_max_mean']:.3f} ± {a['auroc_max_std']:.3f} | " if known else "")
            + f"{a['oscr_mean']:.3f} ± {a['oscr_std']:.3f} | "
            + " | ".join(f"{a['domains'][d]:.3f}" for d in domains)
            + f" | {a['mib_per_round']:.2f} |"
        )
    table = "\n".join(lines)
    if known:
        table += "\n\nKnown classes, drawn per seed: " + "; ".join(
            f"seed {s}: {', '.join(map(str, cs))}" for s, cs in sorted(known.items())
        )
    extra = _unknown_sets_table(agg, unknown_sets, unknown_counts) if unknown_sets else ""
    (out / "table.md").write_text(
        f"{title}: final-round closed-set accuracy, AUROC and OSCR (mean over domains), "
        f"mean ± std over {seeds} seed(s); per-domain columns are AUROC\n\n" + table + "\n" + extra
    )
    write_timings(agg, out, title=title, columns=ROUND_TIMES)
    (out / "summary.json").write_text(
        json.dumps(
            {
                a["method"]: {
                    "closed_acc": a["acc_mean"],
                    "auroc": a["auroc_mean"],
                    "auroc_std": a["auroc_std"],
                    "oscr": a["oscr_mean"],
                    **({"auroc_max": a["auroc_max_mean"]} if known else {}),
                    **{f"auroc.{d}": v for d, v in a["domains"].items()},
                    **{f"auroc_{u}": float(v.mean()) for u, v in a["scenarios"].items()},
                }
                for a in agg
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    (out / "scores.json").write_text(json.dumps({"auroc_by_seed_domain": per_block}, indent=1) + "\n")
    plot_methods(
        agg,
        out / "methods.png",
        title=f"{title}: closed-set accuracy, AUROC and OSCR",
        bars=(("acc", "closed-set accuracy"), ("auroc", "AUROC"), ("oscr", "OSCR")),
        ylabel="score",
    )
    if target is not None and len(per_block) > 1 and len({len(v) for v in per_block.values()}) == 1:
        (out / "stats.md").write_text(stats_report(per_block, target, label="AUROC", blocks="seed × domain") + "\n")
    else:
        (out / "stats.md").write_text(
            "No paired test: this grid has no target method beside others with the same seeds.\n"
        )
    return table


def relabelled_aurocs(
    per_class: Mapping[Tuple[str, int], float], counts: Mapping[str, Mapping[int, int]], sets: Mapping[str, List[int]]
) -> np.ndarray:
    """A scenario's AUROC (mean over domains) under every relabelling of the unknown classes.

    AUROC against a set of unknown classes is the row-count-weighted mean of the AUROCs against each
    class (every unknown row is compared with the same known rows), so a scenario's AUROC follows
    from ``per_class[(domain, class)]`` exactly. A permutation π of the unknown classes keeps the
    scenario's overlap and set sizes and changes only which classes each domain meets; the result
    holds one AUROC per π, in ``itertools.permutations`` order (the identity first).
    """
    from itertools import permutations

    classes = sorted({c for cs in counts.values() for c in cs})
    out = []
    for perm in permutations(classes):
        relabel = dict(zip(classes, perm))
        per_domain = []
        for d, cs in sets.items():
            mapped = [relabel[c] for c in cs]
            n = np.array([counts[d][c] for c in mapped], dtype=float)
            per_domain.append(float(np.dot(n, [per_class[(d, c)] for c in mapped]) / n.sum()))
        out.append(float(np.mean(per_domain)))
    return np.asarray(out)


def _unknown_sets_table(
    agg: List[Dict[str, Any]],
    unknown_sets: Mapping[str, Mapping[str, List[int]]],
    counts: Mapping[str, Mapping[int, int]] | None,
) -> str:
    """Markdown: AUROC per heterogeneous-unknown scenario and method, the same scenarios under every
    relabelling of the unknown classes, and AUROC per unknown class."""
    from fedcore.data.openset import pairwise_overlap

    names = list(unknown_sets)
    head = (
        "| method | "
        + " | ".join(f"{u} ({100 * pairwise_overlap(unknown_sets[u]):.0f} %)" for u in names)
        + f" | {names[0]} − {names[-1]} |"
    )
    lines = [
        "",
        "Heterogeneous unknowns: every client shares the known classes and meets only its own unknown "
        "classes at test time; AUROC (mean over domains) per scenario, with its mean pairwise overlap of "
        "unknown sets, mean ± std over seeds. The models are the same in every scenario: only the unknown "
        "test rows scored change.",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for a in agg:
        sc = a["scenarios"]
        lines.append(
            f"| {a['method']} | "
            + " | ".join(f"{sc[u].mean():.3f} ± {sc[u].std():.3f}" for u in names)
            + f" | {(sc[names[0]] - sc[names[-1]]).mean():+.3f} |"
        )
    if not counts:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "The same scenarios under every relabelling of the unknown classes (same overlap, other classes "
        "per domain), from the per-class AUROCs below: mean [min, max] over relabellings of the seed-mean "
        "AUROC. A gap between scenarios that the relabellings do not keep comes from which classes were "
        "assigned, not from the overlap.",
        "",
        head.replace(f" | {names[0]} − {names[-1]} |", " |"),
        "|" + "---|" * (head.count("|") - 2),
    ]
    for a in agg:
        mean_pc = {k: float(v.mean()) for k, v in a["per_class"].items()}
        cells = []
        for u in names:
            vals = relabelled_aurocs(mean_pc, counts, unknown_sets[u])
            cells.append(f"{vals.mean():.3f} [{vals.min():.3f}, {vals.max():.3f}]")
        lines.append(f"| {a['method']} | " + " | ".join(cells) + " |")
    classes = sorted({c for cs in counts.values() for c in cs})
    lines += [
        "",
        "AUROC against each unknown class alone (mean over domains and seeds):",
        "",
        "| method | " + " | ".join(f"class {c}" for c in classes) + " |",
        "|---|" + "---|" * len(classes),
    ]
    for a in agg:
        lines.append(
            f"| {a['method']} | "
            + " | ".join(f"{np.mean([a['per_class'][(d, c)].mean() for d in counts]):.3f}" for c in classes)
            + " |"
        )
    return "\n".join(lines) + "\n"


def write_incremental_report(rows: List[Dict[str, Any]], *, out: Path, title: str, target: str | None) -> str:
    """table.md, summary.json, scores.json, stats.md and methods.png of a class-incremental grid.

    Per method, mean ± std over seeds: average incremental accuracy, final accuracy, forgetting,
    the accuracy on the seen classes after each task, round time, and (private methods) the
    largest ε any client spent. The paired test uses seeds as blocks, on average incremental accuracy.
    """
    out.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    agg, per_seed = [], {}
    for m in methods:
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["seed"])
        col = {
            k: np.array([r["summary"].get(k, np.nan) for r in rs], dtype=float)
            for k in ("avg_inc_acc", "final_acc", "forgetting")
        }
        col["max_epsilon"] = np.array([np.nan if r.get("max_epsilon") is None else r["max_epsilon"] for r in rs])
        seen = np.array([r["acc_seen"] for r in rs], dtype=float)
        agg.append(
            {
                "method": m,
                "n": len(rs),
                **{f"{k}_mean": float(np.nanmean(v)) if np.isfinite(v).any() else float("nan") for k, v in col.items()},
                **{f"{k}_std": float(np.nanstd(v)) if np.isfinite(v).any() else float("nan") for k, v in col.items()},
                "seen": seen.mean(0).tolist(),
                "round_s": float(np.mean([r["seconds"] / max(1, r["rounds"]) for r in rs])),
                "mib_per_round": float(np.mean([r["summary"]["bytes_per_round"] for r in rs])) / 2**20,
                "seconds": float(np.mean([r["seconds"] for r in rs])),
            }
        )
        per_seed[m] = col["avg_inc_acc"].tolist()
    seeds = max(a["n"] for a in agg)
    tasks = len(agg[0]["seen"])
    private = any(np.isfinite(a["max_epsilon_mean"]) for a in agg)
    head = (
        "| method | avg incremental acc | final acc | forgetting | "
        + " | ".join(f"after task {t}" for t in range(tasks))
        + (" | max client ε" if private else "")
        + " | MiB/round |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in agg:
        eps = (f" | {a['max_epsilon_mean']:.2f}" if np.isfinite(a["max_epsilon_mean"]) else " | –") if private else ""
        lines.append(
            f"| {a['method']} | {a['avg_inc_acc_mean']:.3f} ± {a['avg_inc_acc_std']:.3f} | "
            f"{a['final_acc_mean']:.3f} ± {a['final_acc_std']:.3f} | {a['forgetting_mean']:.3f} ± "
            f"{a['forgetting_std']:.3f} | "
            + " | ".join(f"{v:.3f}" for v in a["seen"])
            + eps
            + f" | {a['mib_per_round']:.2f} |"
        )
    table = "\n".join(lines)
    (out / "table.md").write_text(
        f"{title}: class-incremental accuracy on the classes seen so far, mean ± std over "
        f"{seeds} seed(s); each task is scored at its last round\n\n" + table + "\n"
    )
    write_timings(agg, out, title=title, columns=(("s per round", "round_s", ".2f"), ("run s", "seconds", ".0f")))
    (out / "summary.json").write_text(
        json.dumps(
            {
                a["method"]: {
                    "avg_inc_acc": a["avg_inc_acc_mean"],
                    "avg_inc_acc_std": a["avg_inc_acc_std"],
                    "final_acc": a["final_acc_mean"],
                    "forgetting": a["forgetting_mean"],
                    **({"max_epsilon": a["max_epsilon_mean"]} if np.isfinite(a["max_epsilon_mean"]) else {}),
                }
                for a in agg
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    (out / "scores.json").write_text(json.dumps({"avg_inc_acc_by_seed": per_seed}, indent=1) + "\n")
    plot_methods(
        agg,
        out / "methods.png",
        title=f"{title}: class-incremental accuracy",
        bars=(("avg_inc_acc", "average incremental"), ("final_acc", "final")),
        ylabel="accuracy",
    )
    if target is not None and len(methods) > 1 and len({len(v) for v in per_seed.values()}) == 1:
        (out / "stats.md").write_text(
            stats_report(per_seed, target, label="Average incremental accuracy", blocks="seed") + "\n"
        )
    else:
        (out / "stats.md").write_text(
            "No paired test: this grid has no target method beside others with the same seeds.\n"
        )
    return table


def stats_report(
    scores: Dict[str, List[float]], target: str, *, label: str = "Worst-domain accuracy", blocks: str = "seed × setting"
) -> str:
    """Wilcoxon (target vs each other method, paired by block) and Friedman average ranks on one metric."""
    n = len(scores[target])
    lines = [
        f"{label}, {target} against each method, paired over {n} blocks ({blocks}). "
        f"Two-sided Wilcoxon signed-rank; with n = {n} the smallest possible p is {2 / 2**n:.3g}.",
        "",
        f"| vs | mean gap ({target} − other) | {target} wins | p |",
        "|---|---|---|---|",
    ]
    for t in wilcoxon_against(scores, target):
        lines.append(f"| {t.other} | {t.mean_gap:+.3f} | {t.wins}/{t.n} | {t.p_value:.3f} |")
    ranks = friedman_ranks(scores)
    lines += [
        "",
        f"Friedman average rank (1 = best; p = {friedman_p(scores):.3g} that all rank alike):",
        "",
        "| method | average rank |",
        "|---|---|",
    ]
    lines += [f"| {m} | {r:.2f} |" for m, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ reports over grids
def fedpad_report(cfg) -> None:
    """Wilcoxon and Friedman on worst-domain accuracy, pooled over the grids in ``fedpad.report`` (blocks: grid × seed)."""
    grids = [str(g) for g in cfg.fedpad.report]
    per_grid = {}
    for g in grids:
        path = results_dir(cfg, "fedpad", g) / "scores.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing. Build it with `dvc repro fedpad@{g}`.")
        per_grid[g] = json.loads(path.read_text())["worst_acc_by_seed"]
    common = [m for m in per_grid[grids[0]] if all(m in per_grid[g] for g in grids)]
    pooled = {m: [v for g in grids for v in per_grid[g][m]] for m in common}
    text = (
        f"# FedPAD against every method both grids ran: {', '.join(grids)}\n\n" + stats_report(pooled, "fedpad") + "\n"
    )
    out = C.resolve_path(cfg.paths.results) / "fedpad" / "report.md"
    out.write_text(text)
    print(text)


PRIVACY_LABELS = {"lbdp": "LBDP", "dp": "classic DP", "nbafl": "NbAFL"}  # the fcil trainer's private forms
SAME_DATA = (
    "set",
    "size",
    "max_per_domain",
    "clients_per_domain",
    "test_fraction",
    "size_skew",
    "tasks",
    "clients",
    "alpha",
    "rounds_per_task",
    "participation",
    "model",
    "norm",
)  # what grids compared on one curve share


def _privacy_label(tp: Mapping[str, Any]) -> str:
    """A private method's curve: its form, and the variant of its account where it is not the default."""
    default = _fcil_defaults()
    tp = {**default, **tp}
    form = str(tp["privacy"])
    variants = []
    if form == "lbdp" and tp["bdp_estimator"] != default["bdp_estimator"]:
        variants.append(str(tp["bdp_estimator"]))
    if form == "lbdp" and tp["bdp_sigma_from"] != default["bdp_sigma_from"]:
        variants.append(f"σ from a {tp['bdp_sigma_from']}")
    if form in ("lbdp", "dp") and tp["epsilon_conversion"] != default["epsilon_conversion"]:
        variants.append(f"{tp['epsilon_conversion']} ε")
    if form == "nbafl" and tp["nbafl_sensitivity"] != default["nbafl_sensitivity"]:
        variants.append(f"{tp['nbafl_sensitivity']}-case ΔS")
    label = PRIVACY_LABELS.get(form, form) + (f" ({', '.join(variants)})" if variants else "")
    return f"{label}, C = {float(tp['clip_norm']):g}"


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _clip_stats(cell: Path) -> Dict[str, float]:
    """A DP-SGD cell's per-sample gradient norms against C, averaged over its rounds and clients: the share
    clipped and the median norm before clipping (empty for forms that clip no per-sample gradient)."""
    path = cell / "rounds.json"
    if not path.is_file():
        return {}
    records = json.loads(path.read_text())
    out = {}
    for key in ("clipped_fraction", "grad_norm_median"):
        vals = [float(v) for r in records for k, v in r.items() if k.startswith(f"{key}.c") and math.isfinite(v)]
        if vals:
            out[key] = float(np.mean(vals))
    return out


def _fcil_defaults() -> Dict[str, Any]:
    """PP-FCIL's trainer settings as the library defaults them (its privacy form, its account's variants)."""
    import fedcore.train  # noqa: F401 - registers the trainers
    from fedcore.train.base import TRAINERS

    return TRAINERS.defaults("fcil")


def ppfcil_privacy(cfg) -> None:
    """The privacy-utility curve of a PP-FCIL grid (``ppfcil.privacy_report``) and of the grids run beside it on
    the same data (``ppfcil.privacy_report_with``): average incremental accuracy against ε_total for each
    private form and clip norm, beside the noise-free reference; the paired gap between LBDP and classic DP
    at each (ε, C); and every private method's score."""
    from fedcore.evaluate.plots import plot_privacy_utility
    from fedcore.evaluate.stats import wilcoxon_against

    grid_name = str(cfg.ppfcil.privacy_report)
    grids = [grid_name, *[str(g) for g in cfg.ppfcil.get("privacy_report_with", [])]]
    main = C.grid(cfg, "ppfcil", grid_name)
    curves, reference, pairs, rows = {}, None, {}, []
    for g in grids:
        differ = [k for k in SAME_DATA if C.grid(cfg, "ppfcil", g).get(k) != main.get(k)]
        if differ:
            raise ValueError(
                f"ppfcil grid {g!r} is not on grid {grid_name!r}'s data and schedule ({', '.join(differ)} "
                f"differ), so it cannot join its privacy curve; drop it from ppfcil.privacy_report_with "
                f"or give it the same settings"
            )
    for g in grids:
        spec = C.grid(cfg, "ppfcil", g)
        path = results_dir(cfg, "ppfcil", g) / "scores.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing. Build it with `dvc repro ppfcil@{g}`.")
        scores = json.loads(path.read_text())["avg_inc_acc_by_seed"]
        for m in spec.methods:
            tp = C.round_config(cfg, "ppfcil", method=str(m), seed=0, grid_name=g).trainer_params
            if str(m) not in scores:
                raise ValueError(
                    f"{path} has no scores for method {m!r}, which grid {g!r} now lists; rebuild it with "
                    f"`dvc repro ppfcil@{g}`"
                )
            vals = scores[str(m)]
            point = (float(np.mean(vals)), float(np.std(vals)))
            tp = {**_fcil_defaults(), **tp}
            form = tp["privacy"]
            if form == "none":
                reference = point
                continue
            if form == "clip":  # DP-SGD's mechanics without noise: no ε, a diagnostic (see the privacy-clip grid)
                continue
            eps, clip, label = float(tp["epsilon"]), float(tp["clip_norm"]), _privacy_label(tp)
            curves.setdefault(label, []).append((eps, *point))
            cells = [_clip_stats(results_dir(cfg, "ppfcil", g) / "cells" / f"{m}-s{s}") for s in spec.seeds]
            clipped = {k: float(np.mean([c[k] for c in cells if k in c])) for k in {k for c in cells for k in c}}
            rows.append((label, eps, str(m), g, point, len(vals), clipped))
            if label.split(",")[0] in ("LBDP", "classic DP"):
                pairs.setdefault((eps, clip), {})[form] = vals
    out = results_dir(cfg, "ppfcil", grid_name)
    plot_privacy_utility(
        curves, out / "privacy.png", reference=reference, title=f"PP-FCIL {grid_name}: privacy-utility"
    )
    lines = [
        f"# PP-FCIL privacy-utility ({' + '.join(grids)} grids)",
        "",
        "Average incremental accuracy, mean ± std over seeds; LBDP − classic DP paired over seeds.",
        "",
        "| ε_total | C | LBDP | classic DP | LBDP − DP | LBDP wins |",
        "|---|---|---|---|---|---|",
    ]
    for (eps, clip), d in sorted(pairs.items()):
        if {"lbdp", "dp"} <= set(d):
            gap = wilcoxon_against({"lbdp": d["lbdp"], "dp": d["dp"]}, "lbdp")[0]
            lines.append(
                f"| {eps:g} | {clip:g} | {np.mean(d['lbdp']):.3f} ± {np.std(d['lbdp']):.3f} | "
                f"{np.mean(d['dp']):.3f} ± {np.std(d['dp']):.3f} | {gap.mean_gap:+.3f} | {gap.wins}/{gap.n} |"
            )
    if reference is not None:
        lines += ["", f"No noise (same objective): {reference[0]:.3f} ± {reference[1]:.3f}."]
    lines += [
        "",
        "Every private method:",
        "",
        "| form | ε_total | method (grid) | avg incremental acc | seeds | clipped | median ‖g‖ |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {label} | {eps:g} | {m} ({g}) | {pt[0]:.3f} ± {pt[1]:.3f} | {n} | "
        f"{_fmt(clip.get('clipped_fraction'), '.2f')} | {_fmt(clip.get('grad_norm_median'), '.2f')} |"
        for label, eps, m, g, pt, n, clip in sorted(rows, key=lambda r: r[:4])
    ]
    lines += [
        "",
        "clipped: the share of per-sample gradients whose norm exceeded C; median ‖g‖: their median norm before "
        "clipping (both averaged over rounds, clients and seeds; DP-SGD forms only).",
    ]
    (out / "privacy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def results_dir(cfg, system: str, grid_name: str) -> Path:
    """``<paths.results>/<system>/<grid>``: where a round-based grid's outputs go."""
    return C.resolve_path(cfg.paths.results) / system / grid_name
