"""Prefect flows for the round-based systems (FedPAD first): one run, and a grid of runs.

* :func:`grid` runs every (method, seed) cell of a grid concurrently on Ray (a task per cell,
  each the plain round driver), logs each cell to MLflow as it ends, and writes the table,
  the statistics and the plots that DVC tracks.
* :func:`single` runs one experiment with a Prefect task per round whose clients run as Ray tasks: the
  same :func:`fedcore.engine.run_rounds` loop, driven through the flow's ``submit_round``.

Inputs are checked before any service starts, so a missing partition fails in a second.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

import mlflow
import numpy as np
from omegaconf import DictConfig, OmegaConf
from prefect import flow, get_run_logger
from prefect.futures import as_completed

from fedcore.engine import Done, RoundConfig, RoundsResult, run_rounds
from fedcore.evaluate.plots import plot_incremental, plot_methods, plot_openset_rounds, plot_rounds
from fedcore.evaluate.stats import friedman_p, friedman_ranks, wilcoxon_against
from flows import config as C
from flows import plot_data, runtime, tracking, ui
from flows.tasks import (check_checkpoints, grid_openset_view, load_domain_partition, round_cell_dir, round_inputs,
                         run_round_cell_task, train_round_task, unknown_counts, unknown_scenarios)


def _runner(cfg: DictConfig):
    return runtime.make_task_runner(address=cfg.flow.ray_address, num_cpus=int(cfg.flow.num_cpus), root=C.ROOT)


def results_dir(cfg: DictConfig, system: str, grid_name: str) -> Path:
    return C.resolve_path(cfg.paths.results) / system / grid_name


def _start_cell_run(cfg: DictConfig, system: str, grid_name: str, method: str, rcfg: RoundConfig, part, *,
                    started_ms: int | None = None):
    run = tracking.start_run(f"{method}-s{rcfg.seed}", started_ms=started_ms)
    ui.link_runs(run)
    g = C.to_dict(cfg)[system]["grids"][grid_name]
    mlflow.log_params(tracking.flatten({"system": system, "grid": grid_name, "method": method,
                                        "trainer": {"name": rcfg.trainer, **rcfg.trainer_params},
                                        "strategy": {"name": rcfg.strategy, **rcfg.strategy_params},
                                        "rounds": rcfg.rounds, "participation": rcfg.participation,
                                        "seed": rcfg.seed, "data": {k: v for k, v in g.items()
                                                                    if k not in ("methods", "seeds")}}))
    mlflow.set_tags({**tracking.lineage_tags(seed=rcfg.seed, prepared=None,
                                             partition_dir=C.domains_dir(cfg, system, grid_name),
                                             extra={"system": system, "grid": grid_name, "method": method,
                                                    "trainer": rcfg.trainer, "strategy": rcfg.strategy,
                                                    "config_fingerprint": rcfg.fingerprint()}),
                     "stage": f"{system}@{grid_name}"})
    return run


def _cell_outputs(res: RoundsResult, part, out: Path, title: str, score: str | None = None) -> List[Path]:
    """rounds.json, rounds.png and rounds.csv (``dvc plots`` reads it) of one run; ``score`` (open-set runs)
    picks the AUROC plotted."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "rounds.json").write_text(json.dumps(res.records, indent=0, allow_nan=True) + "\n")
    if res.records and "task" in res.records[-1]:
        from fedcore.incremental.evaluate import task_end_metrics

        plot = plot_incremental(res.records, task_end_metrics(res.records)["acc_matrix"], out, title=title)
    elif score is None:
        plot = plot_rounds(res.records, list(part.domains), out, title=title)
    else:
        plot = plot_openset_rounds(res.records, list(part.domains), out, score=score, title=title)
    return [plot, out / "rounds.json", plot_data.write_records_csv(res.records, out / plot_data.ROUNDS_CSV)]


def _log_tasks(records: List[Dict[str, Any]]) -> None:
    """A class-incremental run's per-task series on the active MLflow run, step = task: ``task_acc.seen`` (the
    accuracy on every class seen so far, at the task's last round) and ``task_acc.task<j>`` (row t of the
    accuracy matrix: task j's classes after task t). The per-round series are ``acc.seen`` and ``acc.task<j>``."""
    if not records or "task" not in records[-1]:
        return
    from mlflow.entities import Metric

    from fedcore.incremental.evaluate import task_end_metrics

    m = task_end_metrics(records)
    if not m:
        return
    now = int(time.time() * 1000)
    batch = [Metric("task_acc.seen", float(a), now, t) for t, a in enumerate(m["acc_seen"])]
    batch += [Metric(f"task_acc.task{j}", float(v), now, t) for t, row in enumerate(m["acc_matrix"])
              for j, v in enumerate(row[:t + 1])]
    tracking.log_metric_batches(batch)


def _log_ledgers(res: RoundsResult, rcfg: RoundConfig) -> None:
    """A private round-based run's ledgers, on the active MLflow run, as private test-time adaptation writes
    its own (:mod:`fedcore.privacy.ledger`): a ledger line per client and round (``eps_round.c<k>``,
    ``eps_client_total.c<k>``, ``eps_budget_remaining.c<k>``, ``privacy_sigma.c<k>``, ``privacy_refused.c<k>``,
    step = round), and ``ledgers/privacy_ledger.json`` and ``.png``. They are MLflow artifacts only: the DVC
    outputs (rounds.json) already hold each round's ε and σ per client."""
    from fedcore.evaluate.plots import plot_ledger
    from fedcore.privacy.ledger import ledger_document, round_ledger_lines
    from fedcore.train import create_trainer

    if not res.ledgers:
        return
    trainer = create_trainer(rcfg.trainer, **rcfg.trainer_params)
    form = getattr(trainer, "privacy", "none")
    if form not in ("lbdp", "dp", "nbafl"):  # clip-only and no privacy promise nothing, and keep no account
        return
    budget = float(trainer.epsilon)
    lines = round_ledger_lines(res.records, budget=budget)
    tracking.log_client_lines(lines)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        doc = ledger_document(delta=trainer.delta, clients=res.ledgers, privacy=form, budget=budget)
        (folder / "privacy_ledger.json").write_text(json.dumps(doc, indent=1) + "\n")
        points = [{"step": r, "client": k, "label": f"c{k}", "eps_client_total": line["eps_client_total"],
                   "privacy_refused": line["privacy_refused"]} for r, k, line in lines]
        paths = [folder / "privacy_ledger.json"]
        if points:
            paths.append(plot_ledger(points, folder, step="round", budget=budget, width=len(res.records)))
        tracking.log_files(paths, artifact_path="ledgers")


def _headline_score(cfg: DictConfig, system: str, grid_name: str, method: str | None, trainer: str) -> str | None:
    return C.method_scores(cfg, system, method, trainer)[0] if C.is_openset(cfg, system, grid_name) else None


def grid(cfg: DictConfig, system: str = "fedpad", grid_name: str | None = None, *,
         written: Mapping[str, str] | None = None) -> List[Dict[str, Any]]:
    """Every (method, seed) cell of the grid, concurrently on Ray; results/<system>/<grid>/ for DVC.

    ``written``: md5s of the partition if the calling flow wrote it itself
    (:func:`flows.integrity.record`); otherwise it is checked against ``dvc.lock``.
    """
    name = str(cfg[system].grid if grid_name is None else grid_name)
    g = C.grid(cfg, system, name)
    part = load_domain_partition(cfg, system, name, written=written)  # before any service starts
    counts = None
    if C.is_openset(cfg, system, name):  # a bad split or unknown scenario fails here, not in every cell
        view = grid_openset_view(g, part)
        unknown_scenarios(g, view)
        counts = unknown_counts(view)
    cells = [(str(m), int(s)) for s in g.seeds for m in g.methods]
    configs = {(m, s): C.round_config(cfg, system, method=m, seed=s, grid_name=name) for m, s in cells}
    check_checkpoints({round_cell_dir(cfg, system, name, m, s): rc.fingerprint() for (m, s), rc in configs.items()},
                      resume=bool(cfg.flow.resume))  # before any service starts, as the partition
    from flows import model_registry

    model_registry.check(cfg)
    params = ui.round_parameters(cfg, system, name, methods=list(g.methods), seeds=list(g.seeds))

    @flow(name=f"{system}-grid", task_runner=_runner(cfg), log_prints=True, flow_run_name=lambda: f"{system}-{name}")
    def grid_flow(system: str, grid: str, data: str, methods: List[str], seeds: List[int], resume: bool,
                  config: Dict[str, str]) -> List[Dict[str, Any]]:  # the parameters are for the UI
        logger = get_run_logger()
        tracking.setup(C.tracking_uri(cfg), f"fedcore-{system}")
        target = _target_method(cfg, system, g)
        cfg_dict = C.to_dict(cfg)
        futures = [run_round_cell_task.with_options(retries=int(cfg.flow.retries), task_run_name=f"{name}-{m}-s{s}")
                   .submit(cfg_dict=cfg_dict, system=system, grid_name=name, method=m, seed=s, written=written)
                   for m, s in cells]
        done = as_completed(futures)
        if cfg.flow.progress:
            from tqdm.auto import tqdm

            done = tqdm(done, total=len(futures), desc=f"{system} grid {name}", unit="cell")
        rows = []
        for i, fut in enumerate(done, 1):
            cell = fut.result()
            m, s, res = cell["method"], cell["seed"], cell["result"]
            with _start_cell_run(cfg, system, name, m, configs[(m, s)], part, started_ms=cell["started_ms"]) as run:
                tracking.log_rounds(res.records)
                _log_tasks(res.records)
                _log_ledgers(res, configs[(m, s)])
                mlflow.log_metrics(res.summary)
                mlflow.log_metric("run_seconds", cell["seconds"])
                paths = _cell_outputs(res, part, results_dir(cfg, system, name) / "cells" / f"{m}-s{s}",
                                      title=f"{system} {name}: {m} (seed {s})",
                                      score=_headline_score(cfg, system, name, m, configs[(m, s)].trainer))
                tracking.log_files(paths, artifact_path="plots")
                _register(cfg, system, name, cell, target=(target, g.seeds[0]))
            tracking.end_run_at(run.info.run_id, cell["ended_ms"])
            sm = res.summary
            opened = f", AUROC {sm['final_auroc']:.3f}" if "final_auroc" in sm else ""
            opened += f", avg incremental {sm['avg_inc_acc']:.3f}" if "avg_inc_acc" in sm else ""
            logger.info("[%d/%d] %s seed %d: avg %.3f, worst %.3f%s (%.0fs)", i, len(cells), m, s,
                        sm["final_avg_acc"], sm["final_worst_acc"], opened, cell["seconds"])
            rows.append({"method": m, "seed": s, "summary": sm, "seconds": cell["seconds"],
                         "rounds": len(res.records), **_incremental_row(res.records)})
        order = {c: i for i, c in enumerate(cells)}
        return sorted(rows, key=lambda r: order[(r["method"], r["seed"])])

    try:
        rows = grid_flow(**params)
    finally:
        runtime.shutdown_ray()
    out = results_dir(cfg, system, name)
    if C.is_incremental(cfg, system, name):
        target = cfg[system].get("target")
        write_incremental_report(rows, out=out, title=f"{system} {name}",
                                 target=str(target) if target in g.methods else None)
    elif C.is_openset(cfg, system, name):
        scores = {m: C.method_scores(cfg, system, m, configs[(m, g.seeds[0])].trainer) for m in g.methods}
        target = cfg[system].get("target")
        sets = g.get("unknown_sets")
        write_openset_report(rows, domains=list(part.domains), out=out, title=f"{system} {name}", scores=scores,
                             target=str(target) if target in g.methods else None,
                             unknown_sets=None if sets is None else OmegaConf.to_container(sets, resolve=True),
                             unknown_counts=counts)
    else:
        write_grid_report(rows, domains=list(part.domains), out=out, title=f"{system} {name}",
                          target=system if system in g.methods else None)
    return rows


def _target_method(cfg: DictConfig, system: str, g) -> str:
    """The method a grid is about: ``<system>.target`` (FedPD++, PP-FCIL), else the system's own name; a
    grid without it (an ablation grid such as FedPAD's digits_gamma) is represented by its last method."""
    target = str(cfg[system].get("target") or system)
    return target if target in g.methods else str(g.methods[-1])


def _register(cfg: DictConfig, system: str, grid_name: str, cell: Mapping[str, Any], *, target) -> None:
    """Log the cell's final model and register it as ``<system>-<grid>`` when the config names the cell.

    With ``flow.register=configured`` that is the grid's target method at its first seed, so a grid
    of 30 cells logs and registers one model (logging a model costs a second or two per cell);
    ``all`` logs and registers every cell.
    """
    from flows import model_registry

    name = model_registry.model_name(cfg, system)
    if not name or not model_registry.wanted(cfg, (cell["method"], cell["seed"]), target):
        return
    if cfg.flow.get("register_model") is None:
        name = f"{system}-{grid_name}"  # a grid is a protocol: its versions compare only with each other
    res = cell["result"]
    # the system's headline: incremental accuracy (PP-FCIL), AUROC (FedPD++), worst-domain accuracy (FedPAD)
    metric = next(m for m in ("avg_inc_acc", "final_auroc", "final_worst_acc", *res.summary) if m in res.summary)
    uri = tracking.log_model(cell["spec"], res.final_state, example=cell["example"])
    model_registry.register(uri, name=name, run_id=mlflow.active_run().info.run_id, summary=res.summary,
                            metric=metric, aliases=list(cfg.flow.get("aliases") or []),
                            description=model_registry.describe(
                                f"{cell['method']}, seed {cell['seed']}, {system} grid {grid_name}", res.summary,
                                metric))


def _incremental_row(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A class-incremental cell's accuracy after each task, and the most ε any of its clients spent."""
    if not records or "task" not in records[-1]:
        return {}
    from fedcore.incremental.evaluate import task_end_metrics

    per_client = re.compile(r"^epsilon\.c\d+$")  # epsilon.c3; epsilon.<domain> is the domain's mean
    eps = [v for rec in records for k, v in rec.items() if per_client.match(k)]
    return {"acc_seen": task_end_metrics(records)["acc_seen"], "max_epsilon": max(eps) if eps else None}


def write_grid_report(rows: List[Dict[str, Any]], *, domains: List[str], out: Path, title: str,
                      target: str | None) -> str:
    """table.md (mean ± std over seeds), summary.json (DVC metrics), stats.md and methods.png."""
    out.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {m: [r for r in rows if r["method"] == m] for m in methods}
    agg = []
    for m in methods:
        rs = by[m]
        avg = np.array([r["summary"]["final_avg_acc"] for r in rs])
        worst = np.array([r["summary"]["final_worst_acc"] for r in rs])
        agg.append({"method": m, "n": len(rs), "avg_mean": float(avg.mean()), "avg_std": float(avg.std(ddof=0)),
                    "worst_mean": float(worst.mean()), "worst_std": float(worst.std(ddof=0)),
                    "domains": {d: float(np.mean([r["summary"][f"final_acc.{d}"] for r in rs])) for d in domains},
                    "agg_ms": 1000 * float(np.mean([r["summary"]["agg_seconds_mean"] for r in rs])),
                    "mib_per_round": float(np.mean([r["summary"]["bytes_per_round"] for r in rs])) / 2 ** 20,
                    "seconds": float(np.mean([r["seconds"] for r in rs]))})
    seeds = max(a["n"] for a in agg)
    head = (f"| method | avg acc | worst acc | {' | '.join(domains)} | server agg ms | MiB/round | run s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in agg:
        lines.append(f"| {a['method']} | {a['avg_mean']:.3f} ± {a['avg_std']:.3f} | {a['worst_mean']:.3f} ± "
                     f"{a['worst_std']:.3f} | " + " | ".join(f"{a['domains'][d]:.3f}" for d in domains)
                     + f" | {a['agg_ms']:.1f} | {a['mib_per_round']:.2f} | {a['seconds']:.0f} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(f"{title}: final-round test accuracy, mean ± std over {seeds} seed(s)\n\n"
                                  + table + "\n")
    summary = {a["method"]: {"avg_acc": a["avg_mean"], "avg_acc_std": a["avg_std"], "worst_acc": a["worst_mean"],
                             "worst_acc_std": a["worst_std"], **{f"acc.{d}": v for d, v in a["domains"].items()},
                             "agg_ms": a["agg_ms"], "run_seconds": a["seconds"]} for a in agg}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    scores = {m: [r["summary"]["final_worst_acc"] for r in sorted(by[m], key=lambda r: r["seed"])] for m in methods}
    (out / "scores.json").write_text(json.dumps({"worst_acc_by_seed": scores}, indent=1) + "\n")
    plot_methods(agg, out / "methods.png", title=f"{title}: average and worst-domain accuracy")
    if target is not None and len(methods) > 1 and len({len(v) for v in scores.values()}) == 1:
        (out / "stats.md").write_text(stats_report(scores, target) + "\n")
    else:
        (out / "stats.md").write_text(f"No paired test: this grid has no {target or 'target'} method beside others "
                                      "with the same seeds.\n")
    return table


def write_openset_report(rows: List[Dict[str, Any]], *, domains: List[str], out: Path, title: str,
                         scores: Dict[str, List[str]], target: str | None,
                         unknown_sets: Mapping[str, Mapping[str, List[int]]] | None = None,
                         unknown_counts: Mapping[str, Mapping[int, int]] | None = None) -> str:
    """table.md, summary.json, scores.json, stats.md and methods.png of an open-set grid.

    A method scored several ways (FedAvg: MSP and OpenMax) gives one row per score,
    ``<method>+<score>``. The paired tests use (seed × domain) blocks of AUROC. With
    ``unknown_sets`` (heterogeneous unknowns) and ``unknown_counts`` (per domain, the unknown test
    rows of each class), table.md adds each method's AUROC per scenario, beside the scenario's
    pairwise overlap, and what the same scenario gives under every relabelling of the unknown
    classes (:func:`relabelled_aurocs`), and its AUROC per unknown class.
    """
    out.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    wanted = [*(unknown_sets or {}), *(f"class{c}" for c in sorted({c for cs in (unknown_counts or {}).values()
                                                                      for c in cs}) if unknown_sets)]
    for r in rows:
        missing = [u for u in wanted if not any(k.startswith(f"final_auroc_{u}.") for k in r["summary"])]
        if missing:  # the checkpoint fingerprint covers training, not evaluation settings
            raise ValueError(f"{r['method']} seed {r['seed']} has no AUROC for unknown scenario(s) {missing}: its "
                             "records come from a checkpoint written before unknown_sets named them. Rerun the grid "
                             "with flow.resume=false (resume never re-evaluates a finished round)")
    agg, per_block = [], {}
    for m in methods:
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["seed"])
        for s in scores[m]:
            name = m if len(scores[m]) == 1 else f"{m}+{s}"
            col = {k: np.array([r["summary"][f"final_{k}"] for r in rs])
                   for k in ("avg_acc", "worst_acc", f"auroc.{s}", f"oscr.{s}")}
            agg.append({"method": name, "n": len(rs),
                        "acc_mean": float(col["avg_acc"].mean()), "acc_std": float(col["avg_acc"].std()),
                        "auroc_mean": float(col[f"auroc.{s}"].mean()), "auroc_std": float(col[f"auroc.{s}"].std()),
                        "oscr_mean": float(col[f"oscr.{s}"].mean()), "oscr_std": float(col[f"oscr.{s}"].std()),
                        "domains": {d: float(np.mean([r["summary"][f"final_auroc.{s}.{d}"] for r in rs]))
                                    for d in domains},
                        "agg_ms": 1000 * float(np.mean([r["summary"]["agg_seconds_mean"] for r in rs])),
                        "mib_per_round": float(np.mean([r["summary"]["bytes_per_round"] for r in rs])) / 2 ** 20,
                        "seconds": float(np.mean([r["seconds"] for r in rs])),
                        "scenarios": {u: np.array([r["summary"][f"final_auroc_{u}.{s}"] for r in rs])
                                      for u in (unknown_sets or {})},
                        "per_class": {(d, c): np.array([r["summary"][f"final_auroc_class{c}.{s}.{d}"] for r in rs])
                                      for d, cs in (unknown_counts or {}).items() for c in cs}
                        if unknown_sets else {}})
            per_block[name] = [r["summary"][f"final_auroc.{s}.{d}"] for r in rs for d in domains]
    seeds = max(a["n"] for a in agg)
    head = f"| method | closed acc | AUROC | OSCR | {' | '.join(domains)} | server agg ms | MiB/round | run s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in agg:
        lines.append(f"| {a['method']} | {a['acc_mean']:.3f} ± {a['acc_std']:.3f} | {a['auroc_mean']:.3f} ± "
                     f"{a['auroc_std']:.3f} | {a['oscr_mean']:.3f} ± {a['oscr_std']:.3f} | "
                     + " | ".join(f"{a['domains'][d]:.3f}" for d in domains)
                     + f" | {a['agg_ms']:.0f} | {a['mib_per_round']:.2f} | {a['seconds']:.0f} |")
    table = "\n".join(lines)
    extra = _unknown_sets_table(agg, unknown_sets, unknown_counts) if unknown_sets else ""
    (out / "table.md").write_text(f"{title}: final-round closed-set accuracy, AUROC and OSCR (mean over domains), "
                                  f"mean ± std over {seeds} seed(s); per-domain columns are AUROC\n\n" + table + "\n"
                                  + extra)
    (out / "summary.json").write_text(json.dumps(
        {a["method"]: {"closed_acc": a["acc_mean"], "auroc": a["auroc_mean"], "auroc_std": a["auroc_std"],
                       "oscr": a["oscr_mean"], **{f"auroc.{d}": v for d, v in a["domains"].items()},
                       **{f"auroc_{u}": float(v.mean()) for u, v in a["scenarios"].items()}}
         for a in agg}, indent=1, sort_keys=True) + "\n")
    (out / "scores.json").write_text(json.dumps({"auroc_by_seed_domain": per_block}, indent=1) + "\n")
    plot_methods(agg, out / "methods.png", title=f"{title}: closed-set accuracy, AUROC and OSCR",
                 bars=(("acc", "closed-set accuracy"), ("auroc", "AUROC"), ("oscr", "OSCR")), ylabel="score")
    if target is not None and len(per_block) > 1 and len({len(v) for v in per_block.values()}) == 1:
        (out / "stats.md").write_text(stats_report(per_block, target, label="AUROC",
                                                   blocks="seed × domain") + "\n")
    else:
        (out / "stats.md").write_text("No paired test: this grid has no target method beside others with the same "
                                      "seeds.\n")
    return table


def relabelled_aurocs(per_class: Mapping[Tuple[str, int], float], counts: Mapping[str, Mapping[int, int]],
                      sets: Mapping[str, List[int]]) -> np.ndarray:
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


def _unknown_sets_table(agg: List[Dict[str, Any]], unknown_sets: Mapping[str, Mapping[str, List[int]]],
                        counts: Mapping[str, Mapping[int, int]] | None) -> str:
    """Markdown: AUROC per heterogeneous-unknown scenario and method, the same scenarios under every
    relabelling of the unknown classes, and AUROC per unknown class."""
    from fedcore.data.openset import pairwise_overlap

    names = list(unknown_sets)
    head = ("| method | " + " | ".join(f"{u} ({100 * pairwise_overlap(unknown_sets[u]):.0f} %)" for u in names)
            + f" | {names[0]} − {names[-1]} |")
    lines = ["", "Heterogeneous unknowns: every client shares the known classes and meets only its own unknown "
             "classes at test time; AUROC (mean over domains) per scenario, with its mean pairwise overlap of "
             "unknown sets, mean ± std over seeds. The models are the same in every scenario: only the unknown "
             "test rows scored change.", "", head, "|" + "---|" * (head.count("|") - 1)]
    for a in agg:
        sc = a["scenarios"]
        lines.append(f"| {a['method']} | " + " | ".join(f"{sc[u].mean():.3f} ± {sc[u].std():.3f}" for u in names)
                     + f" | {(sc[names[0]] - sc[names[-1]]).mean():+.3f} |")
    if not counts:
        return "\n".join(lines) + "\n"
    lines += ["", "The same scenarios under every relabelling of the unknown classes (same overlap, other classes "
              "per domain), from the per-class AUROCs below: mean [min, max] over relabellings of the seed-mean "
              "AUROC. A gap between scenarios that the relabellings do not keep comes from which classes were "
              "assigned, not from the overlap.", "", head.replace(f" | {names[0]} − {names[-1]} |", " |"),
              "|" + "---|" * (head.count("|") - 2)]
    for a in agg:
        mean_pc = {k: float(v.mean()) for k, v in a["per_class"].items()}
        cells = []
        for u in names:
            vals = relabelled_aurocs(mean_pc, counts, unknown_sets[u])
            cells.append(f"{vals.mean():.3f} [{vals.min():.3f}, {vals.max():.3f}]")
        lines.append(f"| {a['method']} | " + " | ".join(cells) + " |")
    classes = sorted({c for cs in counts.values() for c in cs})
    lines += ["", "AUROC against each unknown class alone (mean over domains and seeds):", "",
              "| method | " + " | ".join(f"class {c}" for c in classes) + " |", "|---|" + "---|" * len(classes)]
    for a in agg:
        lines.append(f"| {a['method']} | " + " | ".join(
            f"{np.mean([a['per_class'][(d, c)].mean() for d in counts]):.3f}" for c in classes) + " |")
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
        col = {k: np.array([r["summary"].get(k, np.nan) for r in rs], dtype=float)
               for k in ("avg_inc_acc", "final_acc", "forgetting")}
        col["max_epsilon"] = np.array([np.nan if r.get("max_epsilon") is None else r["max_epsilon"] for r in rs])
        seen = np.array([r["acc_seen"] for r in rs], dtype=float)
        agg.append({"method": m, "n": len(rs), **{f"{k}_mean": float(np.nanmean(v)) if np.isfinite(v).any()
                                                   else float("nan") for k, v in col.items()},
                    **{f"{k}_std": float(np.nanstd(v)) if np.isfinite(v).any() else float("nan")
                       for k, v in col.items()},
                    "seen": seen.mean(0).tolist(),
                    "round_s": float(np.mean([r["seconds"] / max(1, r["rounds"]) for r in rs])),
                    "mib_per_round": float(np.mean([r["summary"]["bytes_per_round"] for r in rs])) / 2 ** 20,
                    "seconds": float(np.mean([r["seconds"] for r in rs]))})
        per_seed[m] = col["avg_inc_acc"].tolist()
    seeds = max(a["n"] for a in agg)
    tasks = len(agg[0]["seen"])
    private = any(np.isfinite(a["max_epsilon_mean"]) for a in agg)
    head = ("| method | avg incremental acc | final acc | forgetting | " + " | ".join(f"after task {t}" for t in
            range(tasks)) + (" | max client ε" if private else "") + " | s/round | MiB/round | run s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in agg:
        eps = (f" | {a['max_epsilon_mean']:.2f}" if np.isfinite(a["max_epsilon_mean"]) else " | –") if private else ""
        lines.append(f"| {a['method']} | {a['avg_inc_acc_mean']:.3f} ± {a['avg_inc_acc_std']:.3f} | "
                     f"{a['final_acc_mean']:.3f} ± {a['final_acc_std']:.3f} | {a['forgetting_mean']:.3f} ± "
                     f"{a['forgetting_std']:.3f} | " + " | ".join(f"{v:.3f}" for v in a["seen"])
                     + eps + f" | {a['round_s']:.2f} | {a['mib_per_round']:.2f} | {a['seconds']:.0f} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(f"{title}: class-incremental accuracy on the classes seen so far, mean ± std over "
                                  f"{seeds} seed(s); each task is scored at its last round\n\n" + table + "\n")
    (out / "summary.json").write_text(json.dumps(
        {a["method"]: {"avg_inc_acc": a["avg_inc_acc_mean"], "avg_inc_acc_std": a["avg_inc_acc_std"],
                       "final_acc": a["final_acc_mean"], "forgetting": a["forgetting_mean"],
                       **({"max_epsilon": a["max_epsilon_mean"]} if np.isfinite(a["max_epsilon_mean"]) else {})}
         for a in agg}, indent=1, sort_keys=True) + "\n")
    (out / "scores.json").write_text(json.dumps({"avg_inc_acc_by_seed": per_seed}, indent=1) + "\n")
    plot_methods(agg, out / "methods.png", title=f"{title}: class-incremental accuracy",
                 bars=(("avg_inc_acc", "average incremental"), ("final_acc", "final")), ylabel="accuracy")
    if target is not None and len(methods) > 1 and len({len(v) for v in per_seed.values()}) == 1:
        (out / "stats.md").write_text(stats_report(per_seed, target, label="Average incremental accuracy",
                                                   blocks="seed") + "\n")
    else:
        (out / "stats.md").write_text("No paired test: this grid has no target method beside others with the same "
                                      "seeds.\n")
    return table


def stats_report(scores: Dict[str, List[float]], target: str, *, label: str = "Worst-domain accuracy",
                 blocks: str = "seed × setting") -> str:
    """Wilcoxon (target vs each other method, paired by block) and Friedman average ranks on one metric."""
    n = len(scores[target])
    lines = [f"{label}, {target} against each method, paired over {n} blocks ({blocks}). "
             f"Two-sided Wilcoxon signed-rank; with n = {n} the smallest possible p is {2 / 2 ** n:.3g}.", "",
             f"| vs | mean gap ({target} − other) | {target} wins | p |", "|---|---|---|---|"]
    for t in wilcoxon_against(scores, target):
        lines.append(f"| {t.other} | {t.mean_gap:+.3f} | {t.wins}/{t.n} | {t.p_value:.3f} |")
    ranks = friedman_ranks(scores)
    lines += ["", f"Friedman average rank (1 = best; p = {friedman_p(scores):.3g} that all rank alike):", "",
              "| method | average rank |", "|---|---|"]
    lines += [f"| {m} | {r:.2f} |" for m, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    return "\n".join(lines)


def single(cfg: DictConfig, system: str = "fedpad") -> RoundsResult:
    """One experiment (``trainer`` x ``strategy`` groups): a Prefect task per round, its clients as Ray tasks."""
    name = str(cfg[system].grid)
    part = load_domain_partition(cfg, system, name)  # before any service starts
    rcfg = C.single_round_config(cfg, system)
    rdata, spec, evaluate = round_inputs(cfg, system, name, part, rcfg)
    label = f"{rcfg.trainer}+{rcfg.strategy}"
    ckpt = C.resolve_path(cfg.paths.checkpoints) / system / name / f"single-{label}-s{rcfg.seed}"
    check_checkpoints({ckpt: rcfg.fingerprint()}, resume=bool(cfg.flow.resume))  # before any service starts
    params = ui.round_parameters(cfg, system, name, rcfg=rcfg)

    runner = runtime.make_driver_runner(address=cfg.flow.ray_address, num_cpus=int(cfg.flow.num_cpus), root=C.ROOT)

    @flow(name=f"{system}-rounds", task_runner=runner, log_prints=True,
          flow_run_name=lambda: f"{system}-{name}-{label}-s{rcfg.seed}")
    def rounds_flow(system: str, grid: str, data: str, trainer: str, strategy: str, seed: int, resume: bool,
                    config: Dict[str, str]) -> RoundsResult:  # the parameters are for the UI
        logger = get_run_logger()
        tracking.setup(C.tracking_uri(cfg), f"fedcore-{system}")
        submit_round = round_submit(rdata, retries=int(cfg.flow.retries),
                                    retry_delay_seconds=float(cfg.flow.retry_delay_seconds), num_gpus=_gpus(cfg),
                                    fault=_faults(cfg, ckpt))

        def on_round(record, state):
            logger.info("round %d/%d: avg %.3f, worst %.3f, clients %s", record["round"] + 1, rcfg.rounds,
                        record["avg_acc"], record["worst_acc"], record["clients"])
            log(record)

        with _start_cell_run(cfg, system, name, label, rcfg, part):
            t0 = time.perf_counter()
            log = tracking.BackgroundRoundLog()  # MLflow writes overlap the next round
            try:
                res = run_rounds(rdata, spec, rcfg, submit_round=submit_round, evaluate=evaluate, checkpoint_dir=ckpt,
                                 resume=bool(cfg.flow.resume), stop_after=cfg.flow.stop_after, on_round=on_round,
                                 progress=bool(cfg.flow.progress), desc=f"{label} rounds")
            except BaseException:
                log.close(raise_errors=False)  # the run's own error is the one to report
                raise
            log.close()
            _log_tasks(res.records)
            _log_ledgers(res, rcfg)
            mlflow.log_metrics(res.summary)
            mlflow.log_metric("run_seconds", time.perf_counter() - t0)
            paths = _cell_outputs(res, part, results_dir(cfg, system, name) / "single" / f"{label}-s{rcfg.seed}",
                                  title=f"{system} {name}: {label}",
                                  score=_headline_score(cfg, system, name, None, rcfg.trainer))
            tracking.log_files(paths + [ckpt / "server_state.pt", ckpt / "server_state.sha256"],
                               artifact_path="outputs")
        return res

    try:
        return rounds_flow(**params)
    finally:
        runtime.shutdown_ray()


def round_submit(data, *, retries: int = 0, retry_delay_seconds: float = 0.0, num_gpus: float = 0.0,
                 fault: Mapping[str, Tuple[int, Path]] | None = None, threads: int = 1):
    """The round engine's ``submit_round`` inside a flow: one named Prefect task per round, its clients on Ray.

    The unit of orchestration is the round, not the client: a Prefect task per sub-second client
    step cost 0.5-1.2 s per round of ten clients on 2 cores (README, Performance), a plain Ray task
    a few ms. The round task logs each client as it finishes. Data moves once: each client's arrays
    (of each task, for data that arrives in tasks) go to Ray's object store the first time they are
    needed, the global state once per round; Ray tasks receive references, not arrays.
    ``fault={"fault"|"crash": (round, folder)}`` makes client 0's step fail once, or its worker die
    once, in that round (tests of retries). ``threads``: CPUs per client step (one by default: a
    round's clients train side by side).
    """
    task = train_round_task.with_options(retries=retries, retry_delay_seconds=retry_delay_seconds)
    arrays = runtime.PutOnce()  # (client, task, "x"|"y") -> that client's arrays of that task
    states = runtime.PutOnce(keep=1)  # the round's global state

    def submit_round(fn, calls):
        r = int(calls[0]["round_index"])
        shipped, names, markers = [], [], {}
        for j, kw in enumerate(calls):
            i = int(kw["client_id"])
            key = (i, int(kw["broadcast"].get("task", 0)))  # data in tasks: the engine passes this task's slice
            shipped.append({**kw, "x": arrays((*key, "x"), kw["x"]), "y": arrays((*key, "y"), kw["y"]),
                            "global_state": states(id(kw["global_state"]), kw["global_state"])})
            names.append(f"round {r} client {i} ({data.client_group[i]})")
            found = {f"{kind}_marker": str(folder / f"{kind}-round{r}.marker")
                     for kind, (at, folder) in (fault or {}).items() if at == r and i == 0}
            if found:
                markers[j] = found
        named = task.with_options(task_run_name=f"round-{r:03d}-{len(calls)}-clients")
        return [Done(u) for u in named(calls=shipped, names=names, num_gpus=num_gpus, markers=markers,
                                       threads=threads)]

    return submit_round


def _gpus(cfg: DictConfig) -> float:
    from flows.federation import _gpus as gpus

    return gpus(cfg)


def _faults(cfg: DictConfig, folder: Path):
    from flows.federation import _faults as faults

    return faults(cfg, folder)
