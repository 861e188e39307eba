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
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import mlflow
from omegaconf import DictConfig
from prefect import flow, get_run_logger
from prefect.futures import as_completed

from fedcore.engine import RoundConfig, RoundsResult, run_rounds
from fedcore.engine.rounds import CLIENTS_DIR
from flows import systems
from flows.config import compose as C
from flows.reports import evaluations, plot_data
from flows.reports.evaluations import GridRun, round_inputs
from flows.reports.tables import results_dir
from flows.runs.tasks import (
    RoundProgress,
    check_checkpoints,
    load_domain_partition,
    round_cell_dir,
    run_round_cell_task,
    train_round_task,
)
from flows.runs.worker import pack
from flows.services import runtime, signals, tracking, ui
from flows.services.placement import faults, gpus


def _runner(cfg: DictConfig):
    return runtime.make_task_runner(address=cfg.flow.ray_address, num_cpus=int(cfg.flow.num_cpus), root=C.ROOT)


def _start_cell_run(
    cfg: DictConfig,
    system: str,
    grid_name: str,
    method: str,
    rcfg: RoundConfig,
    part,
    *,
    started_ms: int | None = None,
    checkpoint_dir: Path | None = None,
):
    """The MLflow run of a grid cell or a round run, active. ``checkpoint_dir``: a round run's checkpoints,
    where its run id is kept, so that a resume continues that run (its charts go on from the round it
    stopped at, beside the rounds logged before) instead of starting a second one."""
    run, earlier = tracking.resumable_run(
        f"{method}-s{rcfg.seed}", resume=bool(cfg.flow.resume), checkpoint_dir=checkpoint_dir, started_ms=started_ms
    )
    with tracking.failing_run(run):
        try:
            _describe_cell_run(run, cfg, system, grid_name, method, rcfg)
        except mlflow.exceptions.MlflowException as e:
            if earlier is None or "Changing param values" not in str(e):
                raise
            raise ValueError(
                f"the grid's settings changed since the interrupted run {earlier}, which this resume continues: "
                "resume with the settings it ran with, or set flow.resume=false to start afresh"
            ) from None
    return run


def _describe_cell_run(run, cfg: DictConfig, system: str, grid_name: str, method: str, rcfg: RoundConfig) -> None:
    ui.link_runs(run)
    g = C.to_dict(cfg)[system]["grids"][grid_name]
    mlflow.log_params(
        tracking.flatten(
            {
                "system": system,
                "grid": grid_name,
                "method": method,
                "trainer": {"name": rcfg.trainer, **rcfg.trainer_params},
                "strategy": {"name": rcfg.strategy, **rcfg.strategy_params},
                "rounds": rcfg.rounds,
                "participation": rcfg.participation,
                "seed": rcfg.seed,
                "data": {k: v for k, v in g.items() if k not in ("methods", "seeds")},
            }
        )
    )
    mlflow.set_tags(
        {
            **tracking.lineage_tags(
                seed=rcfg.seed,
                prepared=None,
                partition_dir=C.domains_dir(cfg, system, grid_name),
                extra={
                    "system": system,
                    "grid": grid_name,
                    "method": method,
                    "trainer": rcfg.trainer,
                    "strategy": rcfg.strategy,
                    "config_fingerprint": rcfg.fingerprint(),
                },
            ),
            "stage": f"{system}@{grid_name}",
        }
    )


def _cell_outputs(
    res: RoundsResult, part, out: Path, title: str, *, system: str, score: str | None = None
) -> List[Path]:
    """rounds.json, the system's plot of the run and rounds.csv (``dvc plots`` reads it), without the rounds'
    timings (MLflow has them); ``score`` (a scored evaluation, e.g. open-set) picks the score plotted."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "rounds.json").write_text(json.dumps(plot_data.reproducible(res.records), indent=0, allow_nan=True) + "\n")
    plot = evaluations.of(system).plot(res.records, part, out, title=title, score=score)
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
    batch += [
        Metric(f"task_acc.task{j}", float(v), now, t)
        for t, row in enumerate(m["acc_matrix"])
        for j, v in enumerate(row[: t + 1])
    ]
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
        points = [
            {
                "step": r,
                "client": k,
                "label": f"c{k}",
                "eps_client_total": line["eps_client_total"],
                "privacy_refused": line["privacy_refused"],
            }
            for r, k, line in lines
        ]
        paths = [folder / "privacy_ledger.json"]
        if points:
            paths.append(plot_ledger(points, folder, step="round", budget=budget, width=len(res.records)))
        tracking.log_files(paths, artifact_path="ledgers")


def _headline_score(cfg: DictConfig, system: str, method: str | None, trainer: str) -> str | None:
    return C.method_scores(cfg, system, method, trainer)[0] if evaluations.of(system).scored else None


def grid(
    cfg: DictConfig, system: str = "fedpad", grid_name: str | None = None, *, written: Mapping[str, str] | None = None
) -> List[Dict[str, Any]]:
    """Every (method, seed) cell of the grid, concurrently on Ray; results/<system>/<grid>/ for DVC.

    Its inputs are checked here, before any service starts; :func:`grid_flow` runs it.
    ``written``: md5s of the partition if the calling flow wrote it itself
    (:func:`flows.services.integrity.record`); otherwise it is checked against ``dvc.lock``.
    """
    name = str(cfg[system].grid if grid_name is None else grid_name)
    part = load_domain_partition(cfg, system, name, written=written)
    evaluations.check_grid(cfg, system, name, part)  # a bad split or unknown scenario fails here, not in every cell
    check_checkpoints(
        {round_cell_dir(cfg, system, name, m, s): rc.fingerprint() for (m, s), rc in _cell_configs(cfg, system, name)},
        resume=bool(cfg.flow.resume),
    )
    from flows.services import model_registry

    model_registry.check(cfg)
    run = grid_flow.with_options(
        name=f"{system}-grid", task_runner=_runner(cfg), flow_run_name=lambda: f"{system}-{name}"
    )
    try:
        return run(
            config=C.round_run(cfg, system, name),
            system=system,
            grid=name,
            written=None if written is None else dict(written),
        )
    finally:
        runtime.shutdown_ray()


def _cell_configs(cfg: DictConfig, system: str, grid_name: str) -> List[Tuple[Tuple[str, int], RoundConfig]]:
    """``((method, seed), its RoundConfig)`` for every cell of a grid, seed by seed."""
    g = C.grid(cfg, system, grid_name)
    return [
        ((str(m), int(s)), C.round_config(cfg, system, method=str(m), seed=int(s), grid_name=grid_name))
        for s in g.seeds
        for m in g.methods
    ]


@flow(name="round-grid", log_prints=True, on_crashed=[signals.crash_open_task_runs])
def grid_flow(
    config: Dict[str, Any], system: str, grid: str, written: Dict[str, str] | None = None
) -> List[Dict[str, Any]]:
    """Every (method, seed) cell of ``grid`` as a task on a Ray worker; each cell logged to MLflow as it ends,
    then the grid's report. ``config``: the resolved config the cells run on (:func:`flows.config.compose.round_run`).
    Returns the rows in cell order."""
    cfg = C.from_run(config)
    logger = get_run_logger()
    tracking.setup(C.tracking_uri(cfg), f"fedcore-{system}")
    g = C.grid(cfg, system, grid)
    part = load_domain_partition(cfg, system, grid, written=written)
    configs = dict(_cell_configs(cfg, system, grid))
    cells = list(configs)
    target = _target_method(cfg, system, g)
    with runtime.task_resources(num_gpus=gpus(cfg)):  # a cell on a GPU run asks Ray for its share
        futures = [
            run_round_cell_task.with_options(retries=int(cfg.flow.retries), task_run_name=f"{grid}-{m}-s{s}").submit(
                cfg_dict=config, system=system, grid_name=grid, method=m, rcfg=configs[(m, s)], written=written
            )
            for m, s in cells
        ]
    done = as_completed(futures)
    if cfg.flow.progress:
        from tqdm.auto import tqdm

        done = tqdm(done, total=len(futures), desc=f"{system} grid {grid}", unit="cell")
    rows = []
    logged = tracking.finished_runs(f"fedcore-{system}", f"{system}@{grid}") if cfg.flow.resume else {}
    failed = tracking.failed_runs(f"fedcore-{system}", f"{system}@{grid}") if cfg.flow.resume else {}
    shared = evaluations.of(system).shares
    for i, fut in enumerate(done, 1):
        cell = fut.result()
        signals.check()  # a cell that came back after a stop signal is not logged
        m, s, res = cell["method"], cell["seed"], cell["result"]
        server = configs[(m, s)].make_strategy()
        shares = evaluations.domain_shares(res.records, part, server.client_weighting) if shared else []
        weights = server.weighting_label
        paths = _cell_outputs(
            res,
            part,
            results_dir(cfg, system, grid) / "cells" / f"{m}-s{s}",
            title=f"{system} {grid}: {m} (seed {s})",
            system=system,
            score=_headline_score(cfg, system, m, configs[(m, s)].trainer),
        )
        earlier = (
            tracking.logged_before(logged, f"{m}-s{s}", configs[(m, s)].fingerprint(), res.summary)
            if cell["already_finished"]
            else None
        )
        if earlier is not None:
            # resumed from a finished checkpoint: MLflow holds this cell's run already
            logger.info("[%d/%d] %s seed %d: finished and logged before; not logged again", i, len(cells), m, s)
            rows.append(
                _row(m, s, res, {**cell, "seconds": earlier.get("run_seconds", cell["seconds"])}, weights, shares)
            )
            continue
        with _start_cell_run(cfg, system, grid, m, configs[(m, s)], part, started_ms=cell["started_ms"]) as run:
            tracking.link_resumed(failed, f"{m}-s{s}", configs[(m, s)].fingerprint(), run.info.run_id)
            mlflow.set_tags(cell.get("placement", {}))
            tracking.log_rounds(res.records)
            _log_shares(shares)
            _log_tasks(res.records)
            _log_ledgers(res, configs[(m, s)])
            mlflow.log_metrics(res.summary)
            mlflow.log_metric("run_seconds", cell["seconds"])
            tracking.log_files(paths, artifact_path="plots")
            _register(cfg, system, grid, cell, target=(target, g.seeds[0]))
            signals.check()  # a stop that landed while it was logged (where Python may drop it): not finished
        tracking.end_run_at(run.info.run_id, cell["ended_ms"])
        sm = res.summary
        opened = f", AUROC {sm['final_auroc']:.3f}" if "final_auroc" in sm else ""
        opened += f", avg incremental {sm['avg_inc_acc']:.3f}" if "avg_inc_acc" in sm else ""
        logger.info(
            "[%d/%d] %s seed %d: avg %.3f, worst %.3f%s (%.0fs)",
            i,
            len(cells),
            m,
            s,
            sm["final_avg_acc"],
            sm["final_worst_acc"],
            opened,
            cell["seconds"],
        )
        rows.append(_row(m, s, res, cell, weights, shares))
    order = {c: i for i, c in enumerate(cells)}
    rows.sort(key=lambda r: order[(r["method"], r["seed"])])
    evaluations.of(system).report(
        GridRun(
            cfg=cfg,
            system=system,
            grid_name=grid,
            rows=rows,
            part=part,
            trainers={m: configs[(m, int(g.seeds[0]))].trainer for m in map(str, g.methods)},
            out=results_dir(cfg, system, grid),
        )
    )
    return rows


def _row(
    method: str,
    seed: int,
    res: RoundsResult,
    cell: Mapping[str, Any],
    weights: str | None = None,
    shares: List[Dict[str, float]] | None = None,
) -> Dict[str, Any]:
    """A finished cell as the grid's report reads it; ``weights`` and ``shares``: how its server weighs the
    clients (its ``weighting_label``), and each domain's share of the round's average per round
    (:func:`flows.reports.evaluations.domain_shares`)."""
    return {
        "method": method,
        "seed": seed,
        "summary": res.summary,
        "seconds": cell["seconds"],
        "rounds": len(res.records),
        **({"weights": weights, "shares": shares} if shares else {}),
        **_incremental_row(res.records),
    }


def _log_shares(shares: List[Dict[str, float]]) -> None:
    """Each domain's share of the round's client average per round on the active MLflow run, as ``share.<domain>``."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    tracking.log_metric_batches(
        [Metric(f"share.{d}", float(v), now, r) for r, share in enumerate(shares) for d, v in share.items()]
    )


def _target_method(cfg: DictConfig, system: str, g) -> str:
    """The method a grid is about: ``<system>.target`` (FedPD++, PP-FCIL), else the system's own name; a
    grid without it (an ablation grid such as FedPAD's digits_gamma) is represented by its last method."""
    target = C.grid_target(cfg, system, g) or system
    return target if target in g.methods else str(g.methods[-1])


def _register(cfg: DictConfig, system: str, grid_name: str, cell: Mapping[str, Any], *, target) -> None:
    """Log the cell's final model and register it as ``<system>-<grid>`` when the config names the cell.

    With ``flow.register=configured`` that is the grid's target method at its first seed, so a grid
    of 30 cells logs and registers one model (logging a model costs a second or two per cell);
    ``all`` logs and registers every cell.
    """
    from flows.services import model_registry

    # by default a grid's own name: a grid is a protocol, its versions compare only with each other
    name = model_registry.model_name(cfg, default=f"{system}-{grid_name}")
    if not name or not model_registry.wanted(cfg, (cell["method"], cell["seed"]), target):
        return
    res = cell["result"]
    metric = systems.get(system).headline
    if metric not in res.summary:
        raise ValueError(
            f"system {system!r} declares headline {metric!r}, which its runs do not report; "
            f"they report: {', '.join(sorted(res.summary))}"
        )
    uri = tracking.log_model(cell["spec"], res.final_state, example=cell["example"])
    model_registry.register(
        uri,
        name=name,
        run_id=mlflow.active_run().info.run_id,
        summary=res.summary,
        metric=metric,
        aliases=list(cfg.flow.aliases),
        description=model_registry.describe(
            f"{cell['method']}, seed {cell['seed']}, {system} grid {grid_name}", res.summary, metric
        ),
    )


def _incremental_row(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A class-incremental cell's accuracy after each task, and the most ε any of its clients spent."""
    if not records or "task" not in records[-1]:
        return {}
    from fedcore.incremental.evaluate import task_end_metrics

    per_client = re.compile(r"^epsilon\.c\d+$")  # epsilon.c3; epsilon.<domain> is the domain's mean
    eps = [v for rec in records for k, v in rec.items() if per_client.match(k)]
    return {"acc_seen": task_end_metrics(records)["acc_seen"], "max_epsilon": max(eps) if eps else None}


def single(cfg: DictConfig, system: str = "fedpad") -> RoundsResult:
    """One experiment (``trainer`` x ``strategy`` groups): a Prefect task per round, its clients as Ray tasks.

    Its inputs are checked here, before any service starts; :func:`rounds_flow` runs it."""
    name = str(cfg[system].grid)
    load_domain_partition(cfg, system, name)
    rcfg = C.single_round_config(cfg, system)
    check_checkpoints({_single_dir(cfg, system, name, rcfg): rcfg.fingerprint()}, resume=bool(cfg.flow.resume))
    label = f"{rcfg.trainer}+{rcfg.strategy}-s{rcfg.seed}"
    run = rounds_flow.with_options(
        name=f"{system}-rounds",
        task_runner=runtime.make_driver_runner(
            address=cfg.flow.ray_address, num_cpus=int(cfg.flow.num_cpus), root=C.ROOT
        ),
        flow_run_name=lambda: f"{system}-{name}-{label}",
    )
    try:
        return run(config=C.round_run(cfg, system, name, single=True), system=system, grid=name)
    finally:
        runtime.shutdown_ray()


def _single_dir(cfg: DictConfig, system: str, grid_name: str, rcfg: RoundConfig) -> Path:
    """The checkpoint folder of one run (:func:`single`)."""
    label = f"{rcfg.trainer}+{rcfg.strategy}"
    return C.resolve_path(cfg.paths.checkpoints) / system / grid_name / f"single-{label}-s{rcfg.seed}"


@flow(name="round-run", log_prints=True, on_crashed=[signals.crash_open_task_runs])
def rounds_flow(config: Dict[str, Any], system: str, grid: str) -> RoundsResult:
    """One run of the ``trainer`` and ``strategy`` groups on ``grid``'s data: a Prefect task per round whose
    clients run as Ray tasks, each round logged to MLflow as it ends. ``config``: the resolved config the run
    reads (:func:`flows.config.compose.round_run` with ``single``)."""
    cfg = C.from_run(config)
    logger = get_run_logger()
    tracking.setup(C.tracking_uri(cfg), f"fedcore-{system}")
    part = load_domain_partition(cfg, system, grid)
    rcfg = C.single_round_config(cfg, system)
    rdata, spec, evaluate = round_inputs(cfg, system, grid, part, rcfg)
    label = f"{rcfg.trainer}+{rcfg.strategy}"
    ckpt = _single_dir(cfg, system, grid, rcfg)
    submit_round = round_submit(
        rdata,
        retries=int(cfg.flow.retries),
        retry_delay_seconds=float(cfg.flow.retry_delay_seconds),
        num_gpus=gpus(cfg),
        fault=faults(cfg, ckpt),
        plugins=list(cfg.get("plugins") or []),
    )

    def on_round(record, state):
        logger.info(
            "round %d/%d: avg %.3f, worst %.3f, clients %s",
            record["round"] + 1,
            rcfg.rounds,
            record["avg_acc"],
            record["worst_acc"],
            record["clients"],
        )
        log(record)

    with _start_cell_run(cfg, system, grid, label, rcfg, part, checkpoint_dir=ckpt):
        t0 = time.perf_counter()
        log = tracking.BackgroundRoundLog()  # MLflow writes overlap the next round
        try:
            res = run_rounds(
                rdata,
                spec,
                rcfg,
                submit_round=submit_round,
                evaluate=evaluate,
                checkpoint_dir=ckpt,
                resume=bool(cfg.flow.resume),
                stop_after=cfg.flow.stop_after,
                on_round=on_round,
                progress=bool(cfg.flow.progress),
                desc=f"{label} rounds",
            )
        except BaseException:
            log.close(raise_errors=False)  # the run's own error is the one to report
            raise
        log.close()
        _log_tasks(res.records)
        _log_ledgers(res, rcfg)
        mlflow.log_metrics(res.summary)
        mlflow.log_metric("run_seconds", time.perf_counter() - t0)
        paths = _cell_outputs(
            res,
            part,
            results_dir(cfg, system, grid) / "single" / f"{label}-s{rcfg.seed}",
            title=f"{system} {grid}: {label}",
            system=system,
            score=_headline_score(cfg, system, None, rcfg.trainer),
        )
        tracking.log_files(paths + [ckpt / "server_state.pt", ckpt / "server_state.sha256"], artifact_path="outputs")
        if (ckpt / CLIENTS_DIR).is_dir():  # the clients' states the server's state names: the checkpoint whole
            mlflow.log_artifacts(str(ckpt / CLIENTS_DIR), artifact_path=f"outputs/{CLIENTS_DIR}")
    return res


def round_submit(
    data,
    *,
    retries: int = 0,
    retry_delay_seconds: float = 0.0,
    num_gpus: float = 0.0,
    fault: Mapping[str, Tuple[int, Path]] | None = None,
    threads: int = 1,
    plugins: Sequence[str] = (),
):
    """The round engine's ``submit_round`` inside a flow: one named Prefect task per round, its clients on Ray.

    The unit of orchestration is the round, not the client: a Prefect task per sub-second client
    step cost 0.5-1.2 s per round of ten clients on 2 cores (README, Performance), a plain Ray task
    a few ms. The round task logs the round's progress as its clients finish. Data moves once: each client's arrays
    (of each task, for data that arrives in tasks) go to Ray's object store the first time they are
    needed, the global state and the server's broadcast once per round; Ray tasks receive references,
    not arrays.
    ``fault={"fault"|"crash": (round, folder)}`` makes client 0's step fail once, or its worker die
    once, in that round (tests of retries). ``threads``: CPUs per client step (one by default: a
    round's clients train side by side). ``plugins``: the run's plug-ins, imported by each worker.
    """
    task = train_round_task.with_options(retries=retries, retry_delay_seconds=retry_delay_seconds)
    arrays = runtime.PutOnce()  # (client, task, "x"|"y") -> that client's arrays of that task
    states = runtime.PutOnce(keep=1)  # the round's global state
    broadcasts = runtime.PutOnce(keep=1)  # what the server sends every client of the round (SCAFFOLD's c)

    def submit_round(fn, calls, take):
        signals.check()  # no round starts after a stop signal
        shipped, names, markers = [], [], {}
        for j in range(len(calls)):
            kw = calls[j]  # built now: a client's saved state is read from its file here, and goes to Ray's store
            i, r = int(kw["client_id"]), int(kw["round_index"])
            key = (i, int(kw["broadcast"].get("task", 0)))  # data in tasks: the engine passes this task's slice
            shipped.append(
                {
                    **kw,
                    "x": arrays((*key, "x"), kw["x"]),
                    "y": arrays((*key, "y"), kw["y"]),
                    "global_state": states(id(kw["global_state"]), kw["global_state"], pack=pack),
                    "broadcast": broadcasts(id(kw["broadcast"]), kw["broadcast"], pack=pack),
                    "client_state": runtime.put(pack(kw["client_state"])) if kw.get("client_state") else {},
                    "plugins": tuple(plugins),
                }
            )
            names.append(f"round {r} client {i} ({data.client_group[i]})")
            found = {
                f"{kind}_marker": str(folder / f"{kind}-round{r}.marker")
                for kind, (at, folder) in (fault or {}).items()
                if at == r and i == 0
            }
            if found:
                markers[j] = found
        named = task.with_options(task_run_name=f"round-{r:03d}-{len(calls)}-clients")
        named(
            calls=shipped,
            names=names,
            take=take,
            progress=RoundProgress(),
            num_gpus=num_gpus,
            markers=markers,
            threads=threads,
        )

    return submit_round
