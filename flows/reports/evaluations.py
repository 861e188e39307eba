"""How a round-based grid is built and judged: one :class:`Evaluation` per kind, chosen by the system.

A system declares its evaluation by name (:attr:`flows.systems.base.System.evaluation`):

* ``domains``: every client trains on every class of its domain; each domain's test set is scored
  by accuracy, and the grid by average and worst-domain accuracy (FedPAD);
* ``openset``: clients train on the grid's known classes; AUROC and OSCR against the unknown ones (FedPD++);
* ``incremental``: the data arrives in tasks of classes; accuracy on the classes seen so far, and
  forgetting (PP-FCIL).

An evaluation gives the round engine its inputs (``RoundData``, the ``ModelSpec`` and the
``evaluate`` function) and writes a cell's plot and the grid's report. A new kind is one more
:class:`Evaluation` passed to :func:`register`; the config checks then treat its grids as they treat
``domains`` grids (``rounds`` rounds, no tasks, no unknown classes): the class-incremental schedule and
the open-set scores are checked for the two built-in kinds that have them (:func:`flows.config.compose.validate_rounds`). Report and plot code is imported only where it runs
(the driver), so a Ray worker that builds inputs loads no matplotlib.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
from omegaconf import DictConfig, OmegaConf

from fedcore.engine import RoundData
from flows import systems
from flows.config import compose as C


@dataclass
class GridRun:
    """What a grid's report is written from: the finished cells and the grid they ran in."""

    cfg: DictConfig
    system: str
    grid_name: str
    rows: List[Dict[str, Any]]
    part: Any
    trainers: Dict[str, str]  # method -> trainer name
    out: Path

    @property
    def grid(self) -> DictConfig:
        return C.grid(self.cfg, self.system, self.grid_name)

    @property
    def title(self) -> str:
        return f"{self.system} {self.grid_name}"


Inputs = Callable[..., Tuple[RoundData, Any, Any]]


@dataclass(frozen=True)
class Evaluation:
    """One way of building and judging a round-based grid.

    ``inputs(cfg, system, grid_name, part, rcfg, *, method)`` -> ``(RoundData, ModelSpec, evaluate)``;
    ``plot(records, part, out, title, score)`` -> the cell's plot; ``report(GridRun)`` -> the grid's
    table (it also writes summary.json, scores.json, stats.md, methods.png); ``scored``: methods are
    judged by unknown scores (an open-set grid), so a cell's plot shows its headline score; ``shares``: the
    cells' clients are the partition's, so each domain's share of each round's average is logged and reported
    (:func:`domain_shares`).
    """

    name: str
    inputs: Inputs
    plot: Callable[..., Path]
    report: Callable[[GridRun], str]
    scored: bool = False
    shares: bool = False


EVALUATIONS: Dict[str, Evaluation] = {}


def register(evaluation: Evaluation) -> Evaluation:
    EVALUATIONS[evaluation.name] = evaluation
    return evaluation


def get(name: str) -> Evaluation:
    if name not in EVALUATIONS:
        raise ValueError(f"unknown evaluation {name!r}; valid names are: {', '.join(sorted(EVALUATIONS))}")
    return EVALUATIONS[name]


def of(system: str) -> Evaluation:
    """The evaluation a round-based system declares."""
    return get(systems.get(system).evaluation)


def round_inputs(cfg: DictConfig, system: str, grid_name: str, part, rcfg, *, method: str | None = None):
    """``(RoundData, ModelSpec, evaluate)`` for one run of a round-based grid, as the system's evaluation builds it."""
    return of(system).inputs(cfg, system, grid_name, part, rcfg, method=method)


OPENMAX_FIT_CAP = 2000  # training samples OpenMax is fitted on, each round (a seeded subsample)


def domain_inputs(cfg: DictConfig, system: str, grid_name: str, part, rcfg, *, method: str | None = None):
    """A closed-set grid (FedPAD) trains on every class and is scored by accuracy (``evaluate`` is None: the
    engine's default)."""
    spec = C.grid_model_spec(cfg, system, grid_name, num_classes=part.num_classes)
    return round_data(part), spec, None


def openset_inputs(cfg: DictConfig, system: str, grid_name: str, part, rcfg, *, method: str | None = None):
    """An open-set grid (FedPD++, ``known`` classes) trains on the known classes only, gives a PROSER model one
    dummy output more, and scores AUROC and OSCR per domain."""
    from functools import partial

    from fedcore.openset.evaluate import check_scores, openset_evaluate

    g = C.grid(cfg, system, grid_name)
    view = grid_openset_view(g, part, seed=rcfg.seed)
    dummy = rcfg.trainer == "proser"
    scores = check_scores(C.method_scores(cfg, system, method, rcfg.trainer), dummy=dummy)
    spec = C.grid_model_spec(cfg, system, grid_name, num_classes=view.num_known + int(dummy))
    fit = None
    if "openmax" in scores:
        x, y = np.concatenate(view.rounds.client_x), np.concatenate(view.rounds.client_y)
        keep = np.sort(np.random.default_rng(rcfg.seed).permutation(len(y))[:OPENMAX_FIT_CAP])
        fit = (x[keep], y[keep])
    evaluate = partial(
        openset_evaluate,
        spec=spec,
        known=view.rounds.eval_sets,
        unknown=view.unknown_test,
        scores=scores,
        fit=fit,
        device=rcfg.device,
        unknown_sets=unknown_scenarios(g, view),
        folded=C.random_split(g),
    )
    return view.rounds, spec, evaluate


def known_classes(g: DictConfig, num_classes: int, seed: int | None) -> Any:
    """An open-set grid's known classes: its ``known`` as written, or with ``known_split: random`` the first
    ``known`` classes of a permutation of all of them drawn from the cell's seed (ascending), so that a grid
    of three seeds is judged on three splits and every method meets the same split at the same seed."""
    known = OmegaConf.to_object(g.known) if OmegaConf.is_config(g.known) else int(g.known)
    if not C.random_split(g):
        return known
    if seed is None:
        raise ValueError("known_split: random needs the cell's seed to draw the known classes")
    return sorted(int(c) for c in np.random.default_rng(int(seed)).permutation(num_classes)[:known])


def grid_openset_view(g: DictConfig, part, *, seed: int | None = None):
    """The open-set view of a partition under an open-set grid's ``known`` / ``unknown`` classes (drawn from
    ``seed`` under ``known_split: random``)."""
    from fedcore.data.openset import make_split, openset_view

    known = known_classes(g, part.num_classes, seed)
    split = make_split(part.num_classes, known=known, unknown=None if g.unknown is None else list(g.unknown))
    return openset_view(part, split)


def unknown_scenarios(g: DictConfig, view):
    """The grid's heterogeneous-unknown scenarios (``unknown_sets``) as row masks, plus one scenario
    ``class<c>`` per unknown class c (every domain scored on c alone: the per-class AUROCs any
    scenario's AUROC is the count-weighted mean of); None when the grid has none."""
    from fedcore.data.openset import unknown_masks

    sets = g.get("unknown_sets")
    if sets is None:
        return None
    sets = OmegaConf.to_container(sets, resolve=True)
    clash = [u for u in sets if isinstance(u, str) and u.startswith("class")]
    if clash:
        raise ValueError(
            f"unknown scenario name(s) {clash}: names starting 'class' are the per-class scenarios "
            "added to every grid with unknown_sets; rename them"
        )
    per_class = {f"class{c}": {d: [c] for d in view.unknown_test} for c in view.split.unknown}
    return unknown_masks(view, {**sets, **per_class})


def unknown_counts(view) -> Dict[str, Dict[int, int]]:
    """Per domain, how many unknown test rows each unknown class has."""
    return {
        d: {int(c): int(np.sum(view.unknown_labels[d] == c)) for c in view.split.unknown} for d in view.unknown_test
    }


def incremental_inputs(cfg: DictConfig, system: str, grid_name: str, part, rcfg, *, method: str | None = None):
    """Class-incremental data: the partition's samples pooled, split into ``tasks`` tasks of classes (order
    shuffled by ``seed``) and dealt to ``clients`` clients with Dirichlet(``alpha``) label skew per task.
    The split depends on the config's ``seed`` only, so every method and training seed sees the same data."""
    from functools import partial

    from fedcore.incremental.evaluate import incremental_evaluate
    from fedcore.incremental.schedule import incremental_view, make_schedule

    g = C.grid(cfg, system, grid_name)
    schedule = make_schedule(num_classes=part.num_classes, tasks=int(g.tasks), seed=int(cfg.seed))
    data = incremental_view(
        np.concatenate(part.client_x),
        np.concatenate(part.client_y),
        np.concatenate(part.test_x),
        np.concatenate(part.test_y),
        schedule,
        num_clients=int(g.clients),
        alpha=float(g.alpha),
        rounds_per_task=int(g.rounds_per_task),
        seed=int(cfg.seed),
        group="+".join(part.domains),
    )
    spec = C.grid_model_spec(cfg, system, grid_name, num_classes=part.num_classes)
    evaluate = partial(
        incremental_evaluate, spec=spec, test=data.eval_sets["test"], task_classes=data.task_classes, device=rcfg.device
    )
    return data, spec, evaluate


def round_data(part) -> RoundData:
    """A domain partition as the round engine's input: clients grouped by domain, one test set per domain."""
    return RoundData(
        client_x=list(part.client_x),
        client_y=list(part.client_y),
        client_group=[part.domains[d] for d in part.client_domain],
        eval_sets={d: (x, y) for d, x, y in zip(part.domains, part.test_x, part.test_y)},
    )


def domain_shares(records: List[Dict[str, Any]], part, weighting: str | None) -> List[Dict[str, float]]:
    """Each round's share of the client average per domain: the weights the server gave the round's merged
    clients (``clients`` of the record), summed by domain, out of 1. A server step after the average (FedAdam's,
    FedDyn's correction) is not counted.

    ``weighting``: the strategy's ``client_weighting``: ``examples`` (each client's example count), ``clients``
    (each alike), or the per-client metric holding the weight (FedPAD's ``alpha``, as ``alpha.c<i>``). None, or
    a round with no merged client, gives no shares (``[]`` / an empty dict)."""
    if weighting is None:
        return []
    sizes = [len(y) for y in part.client_y]
    out: List[Dict[str, float]] = []
    for rec in records:
        ids = [int(i) for i in rec["clients"]]
        if weighting == "examples":
            w = {i: float(sizes[i]) for i in ids}
        elif weighting == "clients":
            w = {i: 1.0 for i in ids}
        else:
            w = {i: float(rec[f"{weighting}.c{i}"]) for i in ids}
        total = sum(w.values())
        if not ids or not total > 0:
            out.append({})
            continue
        share = {d: 0.0 for d in part.domains}
        for i, v in w.items():
            share[part.domain_of(i)] += v / total
        out.append(share)
    return out


def domain_sizes(part) -> Dict[str, Tuple[int, int]]:
    """``{domain: (clients, training examples)}`` of a domain partition."""
    return {d: (len(part.clients_of(d)), sum(len(part.client_y[i]) for i in part.clients_of(d))) for d in part.domains}


# ------------------------------------------------------------------------------------ plots and reports
def _plot_domains(records, part, out: Path, title: str, score: str | None = None) -> Path:
    from fedcore.evaluate.plots import plot_rounds

    return plot_rounds(records, list(part.domains), out, title=title)


def _plot_openset(records, part, out: Path, title: str, score: str | None = None) -> Path:
    from fedcore.evaluate.plots import plot_openset_rounds

    return plot_openset_rounds(records, list(part.domains), out, score=score, title=title)


def _plot_incremental(records, part, out: Path, title: str, score: str | None = None) -> Path:
    from fedcore.evaluate.plots import plot_incremental
    from fedcore.incremental.evaluate import task_end_metrics

    return plot_incremental(records, task_end_metrics(records)["acc_matrix"], out, title=title)


def _report_domains(run: GridRun) -> str:
    from flows.reports.tables import write_grid_report

    return write_grid_report(
        run.rows,
        domains=list(run.part.domains),
        out=run.out,
        title=run.title,
        target=_target(run),
        sizes=domain_sizes(run.part),
    )


def _target(run: GridRun) -> str | None:
    """The method a grid is about: ``<system>.target``, else the method named as the system, if the grid ran it."""
    target = C.grid_target(run.cfg, run.system, run.grid) or run.system
    return target if target in run.grid.methods else None


def _report_openset(run: GridRun) -> str:
    from flows.reports.tables import write_openset_report

    g = run.grid
    scores = {m: C.method_scores(run.cfg, run.system, m, run.trainers[m]) for m in g.methods}
    sets = g.get("unknown_sets")
    counts = None if sets is None else unknown_counts(grid_openset_view(g, run.part))
    target = C.grid_target(run.cfg, run.system, g)
    return write_openset_report(
        run.rows,
        domains=list(run.part.domains),
        out=run.out,
        title=run.title,
        scores=scores,
        target=str(target) if target in g.methods else None,
        unknown_sets=None if sets is None else OmegaConf.to_container(sets, resolve=True),
        unknown_counts=counts,
        known={int(s): list(grid_openset_view(g, run.part, seed=int(s)).split.known) for s in g.seeds}
        if C.random_split(g)
        else None,
    )


def _report_incremental(run: GridRun) -> str:
    from flows.reports.tables import write_incremental_report

    target = C.grid_target(run.cfg, run.system, run.grid)
    return write_incremental_report(
        run.rows, out=run.out, title=run.title, target=str(target) if target in run.grid.methods else None
    )


def check_grid(cfg: DictConfig, system: str, grid_name: str, part) -> None:
    """Grid-level checks before any service starts, so that a bad open-set split or unknown scenario fails
    once, here, and not in every cell. A scored evaluation is an open-set one (``known`` classes)."""
    g = C.grid(cfg, system, grid_name)
    if of(system).scored:
        for seed in g.seeds if C.random_split(g) else [None]:
            view = grid_openset_view(g, part, seed=seed)
            unknown_scenarios(g, view)


register(Evaluation("domains", inputs=domain_inputs, plot=_plot_domains, report=_report_domains, shares=True))
register(Evaluation("openset", inputs=openset_inputs, plot=_plot_openset, report=_report_openset, scored=True))
register(Evaluation("incremental", inputs=incremental_inputs, plot=_plot_incremental, report=_report_incremental))
