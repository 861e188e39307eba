"""Prefect flows: source pretraining, sequential arrival, and the (method x aggregator x seed) sweep.

Thin by design: each task calls a fedcore step function, and each flow hands fedcore's driver
a ``submit`` that turns a step into a Prefect task on Ray. Tracking happens here, in the
driver process, never on a worker.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import mlflow
import numpy as np
import torch
from omegaconf import DictConfig
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed

from fedcore.data import Partition
from fedcore.engine import (
    ArrivalsResult,
    ModelSpec,
    RunInterrupted,
    ServerState,
    arrivals_result,
    initial_state,
    run_rounds,
    save_state,
    source_round_data,
)
from fedcore.evaluate.plots import plot_arrivals, plot_privacy
from fedcore.privacy.ledger import ledger_document
from flows.config import compose as C
from flows.reports import plot_data
from flows.runs.tasks import (  # noqa: F401 - the paths and loaders are part of this module's interface
    arrival_checkpoints,
    cell_name,
    check_checkpoints,
    ckpt_dir,
    load_inputs,
    load_partition,
    load_source,
    partition_dir,
    prepared_path,
    run_cell_task,
    run_label,
    source_model_path,
    sweep_cells,
)
from flows.services import model_registry, runtime, signals, tracking, ui
from flows.services.placement import faults, gpus


def _runner(cfg: DictConfig):
    """For tasks that are whole units of work (a sweep cell): a Prefect task on a Ray worker."""
    return runtime.make_task_runner(address=cfg.flow.ray_address, num_cpus=int(cfg.flow.num_cpus), root=C.ROOT)


def _driver_runner(cfg: DictConfig, *, warm_workers: int | None = None):
    """For sub-second client steps: Prefect tasks in driver threads whose bodies run the step on Ray."""
    return runtime.make_driver_runner(
        address=cfg.flow.ray_address, num_cpus=int(cfg.flow.num_cpus), root=C.ROOT, warm_workers=warm_workers
    )


# ------------------------------------------------------------------------------------ flows


def pretrain(cfg: DictConfig, *, written: Mapping[str, str] | None = None) -> Path:
    """FedAvg source pretraining on the round engine: a Prefect task per round, its clients as Ray tasks.

    Its input is checked here, before any service starts; :func:`source_pretraining` runs it.
    ``written``: md5s of inputs the calling flow wrote itself (:func:`flows.services.integrity.record`);
    otherwise the partition is checked against ``dvc.lock``.
    """
    load_partition(cfg, written=written)
    name = _pretrain_run_name(cfg)
    run = source_pretraining.with_options(task_runner=_driver_runner(cfg), flow_run_name=lambda: name)
    try:
        return Path(run(config=C.arrival_run(cfg), written=None if written is None else dict(written)))
    finally:
        runtime.shutdown_ray()


def _pretrain_run_name(cfg: DictConfig) -> str:
    return f"pretrain-{cfg.data.name}-{cfg.model.name}"


@flow(name="source-pretraining", log_prints=True, on_crashed=[signals.crash_open_task_runs])
def source_pretraining(config: Dict[str, Any], written: Dict[str, str] | None = None) -> str:
    """FedAvg on the source data, a Prefect task per round; returns the saved source model's path.

    ``config``: the resolved config it reads (:func:`flows.config.compose.arrival_run`)."""
    from flows.runs.rounds import round_submit

    cfg = C.from_run(config)
    logger = get_run_logger()
    partition = load_partition(cfg, written=written)
    run_name = _pretrain_run_name(cfg)
    spec, pcfg = C.model_spec(cfg), C.pretrain_config(cfg)
    tracking.setup(C.tracking_uri(cfg), cfg.flow.experiment)
    rounds_data = source_round_data(partition)
    # One source client (the CIFAR variant's) trains on every CPU of flow.num_cpus that a node has;
    # clients that train side by side take one each. The thread count changes the floats, so it
    # is the stage's param flow.num_cpus, not the machine, that sets it.
    threads = min(int(cfg.flow.num_cpus), runtime.largest_node_cpus()) if rounds_data.num_clients == 1 else 1
    submit_round = round_submit(
        rounds_data,
        retries=int(cfg.flow.retries),
        retry_delay_seconds=float(cfg.flow.retry_delay_seconds),
        num_gpus=gpus(cfg),
        threads=threads,
        plugins=list(cfg.get("plugins") or []),
    )

    with tracking.start_run(run_name):
        ui.link_runs()
        mlflow.set_tags(
            {
                **tracking.lineage_tags(seed=pcfg.seed, prepared=prepared_path(cfg), partition_dir=partition_dir(cfg)),
                "stage": "pretrain",
            }
        )
        # this run's settings: not the sweep's grid, nor the variants' definitions (the chosen one is laid over)
        mlflow.log_params(tracking.flatten({k: v for k, v in config.items() if k not in ("sweep", *C.not_arrival())}))
        log = tracking.BackgroundRoundLog()  # MLflow writes overlap the next round

        def on_round(record, state):
            logger.info(
                "round %d/%d train_loss=%.4f source_test=%.3f",
                record["round"] + 1,
                pcfg.rounds,
                record["train_loss"],
                record["acc.source_test"],
            )
            log(record)

        try:
            result = run_rounds(
                rounds_data,
                spec,
                pcfg,
                submit_round=submit_round,
                on_round=on_round,
                progress=bool(cfg.flow.progress),
                desc="FedAvg rounds",
            )
        except BaseException:
            log.close(raise_errors=False)
            raise
        log.close()
        state = result.final_state
        net = spec.build()
        net.load_state_dict(state)
        from fedcore.evaluate import accuracy

        acc = accuracy(net, partition.source_test_x, partition.source_test_y)
        mlflow.log_metric("source_test_acc", acc)
        out = source_model_path(cfg)
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"state": state, "spec": asdict(spec), "pretrain": asdict(pcfg), "source_test_acc": acc},
            out.with_suffix(".tmp"),
        )
        out.with_suffix(".tmp").replace(out)
        mlflow.log_artifact(str(out), artifact_path="checkpoints")
        logger.info("source model: clean test accuracy %.3f -> %s", acc, out)
    return str(out)


def _draw_plots(
    records: List[Dict[str, Any]], acc: np.ndarray, corruptions: List[str], out: Path, title: str, privacy: bool
) -> List[Path]:
    plots = plot_arrivals(records, acc, corruptions, out, title=title)
    if privacy:
        plots.append(plot_privacy(records, out))
    return plots


def _log_experiment(
    cfg: DictConfig,
    acfg,
    res: ArrivalsResult,
    *,
    spec: ModelSpec,
    partition: Partition,
    arrivals: "tracking.BackgroundLog | None" = None,
) -> None:
    """Everything about one finished experiment on the active MLflow run.

    ``arrivals``: the log that took the arrivals as they came back, closed here (so that what it
    still has to write overlaps the plots); without it the arrivals are logged here. The plots are
    drawn in a child process (:class:`flows.services.runtime.InChild`) while this one writes the rest.
    """
    records, acc = res.records, res.acc_matrix
    out = C.resolve_path(cfg.paths.results) / "cells" / cell_name(acfg)
    out.mkdir(parents=True, exist_ok=True)
    corruptions = [t.corruption for t in partition.targets]
    from fedcore.evaluate.plots import pyplot

    pyplot()  # pyplot imported once per process, here, rather than by every child (about 0.4 s each)
    drawing = runtime.InChild(
        _draw_plots, records, acc, corruptions, out, f"{acfg.method}+{acfg.aggregator} ({acfg.form})", bool(res.ledgers)
    )
    try:
        if arrivals is not None:
            arrivals.close()
        else:
            for rec in records:
                tracking.log_arrival(rec)
        mlflow.log_metrics(summary_metrics(res.summary))
        files = []
        if res.ledgers:
            (out / "privacy_ledger.json").write_text(
                json.dumps(ledger_document(delta=acfg.privacy_config().delta, clients=res.ledgers), indent=1) + "\n"
            )
            files.append(out / "privacy_ledger.json")
        np.savetxt(out / "accuracy_matrix.csv", acc, delimiter=",", fmt="%.4f")
        files += plot_data.write_arrival_tables(out, records, acc, corruptions)
        tracking.log_files(files + [out / "accuracy_matrix.csv"], artifact_path="plots")
        ckpt = ckpt_dir(cfg, cell_name(acfg))
        tracking.log_files([ckpt / "server_state.pt", ckpt / "server_state.sha256"], artifact_path="checkpoints")
        from fedcore.tensors import to_tensor

        example = to_tensor(partition.source_test_x[:2]).numpy()
        model_uri = tracking.log_model(spec, res.final_state, example=example)
        name = model_registry.model_name(cfg)
        if name and model_registry.wanted(
            cfg, (acfg.method, acfg.aggregator, acfg.form, acfg.seed), model_registry.configured_cell(cfg)
        ):
            metric = str(cfg.flow.champion_metric)
            model_registry.register(
                model_uri,
                name=name,
                run_id=mlflow.active_run().info.run_id,
                summary=summary_metrics(res.summary),
                metric=metric,
                aliases=list(cfg.flow.aliases),
                description=model_registry.describe(
                    f"{acfg.method}+{acfg.aggregator} ({acfg.form}), seed {acfg.seed}, on {cfg.data.name}",
                    summary_metrics(res.summary),
                    metric,
                ),
            )
    except BaseException:
        # the plots are still finished (no half-written PNG among the stage's outputs) and kept on the
        # run if they can be; the error that stopped the logging is the one reported
        with contextlib.suppress(Exception):
            tracking.log_files(drawing.result(), artifact_path="plots")
        drawing.cancel()
        raise
    tracking.log_files(drawing.result(), artifact_path="plots")


def summary_metrics(summary: Mapping[str, float]) -> Dict[str, float]:
    """A run's summary as MLflow metrics, each named once with ``final_`` (``final_avg_online_acc``,
    ``final_avg_holdout_acc``): the per-arrival series keep their plain names."""
    return {k if k.startswith("final_") else f"final_{k}": float(v) for k, v in summary.items()}


def run_name(acfg) -> str:
    """An arrival run's MLflow name: ``bpa+ugsa-s0``, ``tent+fedavg dp-eps8-s1``."""
    form = "" if acfg.form == "plain" else f" {acfg.form}"
    return f"{acfg.method}+{acfg.aggregator}{form}-s{acfg.seed}"


def _start_experiment_run(
    cfg: DictConfig, acfg, spec: ModelSpec, *, started_ms: int | None = None, checkpoint_dir: Path | None = None
):
    """The experiment's parent run, active. ``started_ms``: when the experiment began, for a run
    created after it ended (a sweep cell); its end time is set by the caller. ``checkpoint_dir``: an
    arrival run's checkpoints, where its MLflow run id is kept, so that a resume continues that run
    (its charts go on from the arrival it stopped at) instead of starting a second one."""
    run, earlier = tracking.resumable_run(
        run_name(acfg), resume=bool(cfg.flow.resume), checkpoint_dir=checkpoint_dir, started_ms=started_ms
    )
    with tracking.failing_run(run):
        _describe_experiment_run(run, cfg, acfg, earlier)
    return run


def _describe_experiment_run(run, cfg: DictConfig, acfg, earlier: str | None) -> None:
    ui.link_runs(run)
    # this run's settings only: not the other systems' grids, nor the variants' definitions (the
    # variant chosen is already laid over the root config)
    params = {
        k: v
        for k, v in C.to_dict(cfg).items()
        if k not in ("sweep", "method", "aggregator", "privacy", "private", *C.not_arrival())
    }
    params.update(
        {
            "method": {"name": acfg.method, **acfg.method_params},
            "aggregator": {"name": acfg.aggregator, **acfg.aggregator_params},
            "seed": acfg.seed,
            "privacy": {"form": acfg.form, **acfg.privacy},
        }
    )
    pcfg = acfg.privacy_config()
    if pcfg.mode == "dp":
        params["privacy"]["sigma"] = pcfg.sigma(acfg.uses_per_arrival)
        params["privacy"]["noise_source"] = pcfg.noise_source  # written out even where the default chose it
        params["privacy"]["gate_noise_multiplier"] = pcfg.gate_noise_multiplier
    flat = tracking.flatten(params)
    if earlier is not None:  # the checkpoint's fingerprint held the settings; flow.resume and the like differ
        logged = mlflow.MlflowClient().get_run(earlier).data.params
        flat = {k: v for k, v in flat.items() if k not in logged}
    mlflow.log_params(flat)
    mlflow.set_tags(
        {
            **tracking.lineage_tags(
                seed=acfg.seed,
                prepared=prepared_path(cfg),
                partition_dir=partition_dir(cfg),
                reads=[source_model_path(cfg)],
                extra={
                    "method": acfg.method,
                    "aggregator": acfg.aggregator,
                    "privacy_form": acfg.form,
                    "config_fingerprint": acfg.fingerprint(),
                    "source_model": str(source_model_path(cfg).name),
                },
            ),
            "stage": "adapt",
        }
    )
    src = source_model_path(cfg)
    if src.is_file():
        mlflow.set_tag("source_model_sha256", tracking.file_sha256(src))


class _NotAccepted(RuntimeError):
    """An arrival that came back after the flow stopped accepting them (:meth:`ArrivalPasses.stop_accepting`)."""


class ArrivalPasses:
    """The driver's side of a sequential-arrival flow: the run's state, and the blocks of arrivals that advance it.

    Every arrival still to run (up to ``flow.stop_after``) runs on one Ray worker as one generator
    (:func:`flows.runs.worker.arrival_pass`), started by :meth:`start` as soon as the state is known, so
    that the worker computes while Prefect creates the flow run and the flow opens its MLflow run
    and Prefect tasks. The worker
    holds the data and the model between arrivals and sends each arrival's state back as it is
    done. A block (a pass over the clients) is one Prefect task that takes its arrivals from that
    stream (:meth:`run`); the worker does not wait between blocks. Each state is checkpointed and
    handed to ``on_arrival`` (logs and MLflow). If the worker dies, the stream goes on from the last
    state received, on a new worker; an error the stream raises fails the block, and the Prefect
    retry starts a new stream from that same state. Either way the metrics are those of an
    uninterrupted run (arrivals are seeded by index, and a state holds everything that follows).
    """

    def __init__(
        self,
        st: ServerState,
        *,
        partition: Partition,
        spec: ModelSpec,
        acfg,
        checkpoint_dir: Path,
        threads: int,
        num_gpus: float,
        on_arrival: Callable[[Dict[str, Any], ServerState, Any], None] | None,
        faults: Mapping[str, Any] | None = None,
        max_restarts: int = 3,
        stop_after: int | None = None,
        plugins: Sequence[str] = (),
    ) -> None:
        self.st, self.spec, self.acfg, self.checkpoint_dir = st, spec, acfg, checkpoint_dir
        self.threads, self.num_gpus, self.on_arrival, self.max_restarts = threads, num_gpus, on_arrival, max_restarts
        self.num_clients = len(partition.targets)
        total = len(acfg.schedule(self.num_clients))
        self.last = total if stop_after is None else min(int(stop_after), total)
        self.partition = runtime.put(partition)  # to the object store once per run; a new stream gets the reference
        self.faults: Dict[int, Dict[str, str]] = {}
        for kind, (at, folder) in (faults or {}).items():
            self.faults.setdefault(int(at), {})[f"{kind}_marker"] = str(folder / f"{kind}-{at}.marker")
        self._stream = None
        self.plugins = tuple(plugins)
        self._accepting, self._closed = threading.Lock(), False

    def blocks(self) -> List[Tuple[int, int, int]]:
        """``(pass, first, end)`` of each block still to run: a pass over the clients, cut at ``stop_after``."""
        K = self.num_clients
        return [
            (p, max(p * K, self.st.done), min((p + 1) * K, self.last))
            for p in range(-(-self.last // K))
            if min((p + 1) * K, self.last) > max(p * K, self.st.done)
        ]

    def start(self) -> None:
        """The generator of every arrival from ``st.done`` to the last, on a Ray worker (once; again after a failure)."""
        from flows.runs.worker import arrival_pass

        if self._stream is None and self.st.done < self.last:
            self._stream = runtime.ray_stream(
                arrival_pass,
                num_cpus=self.threads,
                num_gpus=self.num_gpus,
                partition=self.partition,
                spec=self.spec,
                cfg=self.acfg,
                start=self.st,
                stop_at=self.last,
                threads=self.threads,
                faults=self.faults,
                plugins=self.plugins,
            )

    def run(self, end: int, logger) -> int:
        """Take arrivals ``st.done`` .. ``end`` - 1 from the worker's stream; returns how many are done."""
        import ray

        attempt = 1
        while self.st.done < end:
            self.start()
            try:
                while self.st.done < end:
                    self._accept(ray.get(next(self._stream)))
            except _NotAccepted:
                self.close()
                return self.st.done  # not an error to retry: the flow has already stopped
            except runtime.worker_deaths() as exc:
                self.close()  # a stream whose object was lost may still hold its worker
                attempt += 1
                if attempt > 1 + self.max_restarts:
                    raise
                logger.warning(
                    "the Ray worker running arrivals %d-%d died (%s); they go on from arrival %d on a "
                    "new worker: attempt %d",
                    self.st.done,
                    self.last - 1,
                    type(exc).__name__,
                    self.st.done,
                    attempt,
                )
            except BaseException:
                self.close()  # an error raised in the stream ends it; a retry starts a new one from self.st
                raise
        return self.st.done

    def close(self) -> None:
        """Stop the stream (a run cut short, or failed); the state received so far stays."""
        if self._stream is not None:
            runtime.ray_cancel([self._stream])
            self._stream = None

    def _accept(self, st: ServerState) -> None:
        if st.done != self.st.done + 1 or st.fingerprint != self.st.fingerprint:
            raise RuntimeError(f"the worker sent the state after arrival {st.done - 1}, expected {self.st.done}")
        # Checkpointed and handed to the log, or neither: this runs on a task thread while the flow's main
        # thread may be unwinding (a stop signal, an error); an arrival checkpointed after the log closed
        # would be one a resume skips and the charts never get.
        with self._accepting:
            if self._closed:  # the flow is unwinding: this block ends here, and a resume redoes the arrival
                raise _NotAccepted(f"arrival {st.done - 1} came back after the run stopped; resume redoes it")
            signals.check()  # an arrival that comes back after a stop is neither checkpointed nor logged
            save_state(self.checkpoint_dir, st.to_payload(), fingerprint=st.fingerprint)
            self.st = st
            self.on_arrival(st.records[-1], st, None)

    def stop_accepting(self) -> None:
        """No arrival is checkpointed or logged after this returns; one being accepted now finishes first."""
        with self._accepting:
            self._closed = True


@task(name="arrival-pass", cache_policy=NO_CACHE)
def arrival_pass_task(passes: ArrivalPasses, end: int) -> int:
    """One block of arrivals, run on a Ray worker from the flow's current state (a retry goes on from there)."""
    return passes.run(end, get_run_logger())


def arrival(cfg: DictConfig) -> ArrivalsResult:
    """Sequential arrival: a Prefect task per pass over the clients, each running its arrivals on one Ray
    worker; every arrival checkpointed and logged here as it comes back.

    Its inputs are checked here, before any service starts; :func:`sequential_arrival` runs it."""
    load_inputs(cfg)
    model_registry.check(cfg)
    check_checkpoints(arrival_checkpoints(cfg), resume=bool(cfg.flow.resume))
    acfg = C.arrival_config(cfg)
    name = run_label(acfg.method, acfg.aggregator, acfg.form, acfg.seed)
    # one worker runs every arrival, in sequence: warming a second would take a core from the first
    run = sequential_arrival.with_options(task_runner=_driver_runner(cfg, warm_workers=1), flow_run_name=lambda: name)
    try:
        return run(config=C.arrival_run(cfg))
    finally:
        runtime.shutdown_ray()


@flow(name="sequential-arrival", log_prints=True, on_crashed=[signals.crash_open_task_runs])
def sequential_arrival(config: Dict[str, Any]) -> ArrivalsResult:
    """One experiment's arrivals, a pass over the clients per Prefect task; each arrival checkpointed and
    logged to MLflow as it comes back. ``config``: the resolved config it reads
    (:func:`flows.config.compose.arrival_run`)."""
    cfg = C.from_run(config)
    partition, spec, source = load_inputs(cfg)
    acfg = C.arrival_config(cfg)
    ckpt = ckpt_dir(cfg, cell_name(acfg))
    schedule = acfg.schedule(len(partition.targets))
    st = initial_state(source, acfg, checkpoint_dir=ckpt, resume=bool(cfg.flow.resume))
    # Arrivals are sequential: the worker running them may use every CPU of a node. Their stream starts
    # here, so that the worker computes while the flow opens its MLflow run and its first pass task.
    passes = ArrivalPasses(
        st,
        partition=partition,
        spec=spec,
        acfg=acfg,
        checkpoint_dir=ckpt,
        threads=min(int(cfg.flow.num_cpus), runtime.largest_node_cpus()),
        num_gpus=gpus(cfg),
        on_arrival=None,
        faults=faults(cfg, ckpt),
        stop_after=cfg.flow.stop_after,
        plugins=list(cfg.get("plugins") or []),
    )
    bar = None
    try:
        passes.start()
        tracking.setup(C.tracking_uri(cfg), cfg.flow.experiment)
        if cfg.flow.progress:
            from tqdm.auto import tqdm

            bar = tqdm(
                desc=f"{acfg.method}+{acfg.aggregator} arrivals",
                unit="client",
                initial=passes.st.done,
                total=len(schedule),
            )

        def on_arrival(record, st, _):
            logger = get_run_logger()  # the pass task's: the UI shows each arrival under its pass
            if record.get("privacy_refused"):
                logger.warning(
                    "arrival %d: client %d refused a private update: its budget of epsilon=%g is "
                    "spent (%.3f used); it predicted with the global model, which stays as it was",
                    record["arrival"],
                    record["client_id"],
                    acfg.privacy_config().budget,
                    record["eps_client_total"],
                )
            logger.info(
                "arrival %d (%s): online %.3f, hold-out(seen) %.3f, w=%.3f",
                record["arrival"],
                record["corruption"],
                record["online_acc"],
                record["holdout_avg_seen"],
                record["weight"],
            )
            log(record)
            if bar is not None:
                bar.update(1)

        passes.on_arrival = on_arrival
        with _start_experiment_run(cfg, acfg, spec, checkpoint_dir=ckpt):
            # each arrival's numbers reach the run's charts as it comes back, beside the worker's next
            log = tracking.BackgroundArrivalLog(runs_at_end=cfg.flow.arrival_runs == "at_end")
            try:
                task = arrival_pass_task.with_options(
                    retries=int(cfg.flow.retries), retry_delay_seconds=float(cfg.flow.retry_delay_seconds)
                )
                for p, first, end in passes.blocks():
                    signals.check()
                    task.with_options(task_run_name=f"pass-{p}-arrivals-{first:03d}-{end - 1:03d}").submit(
                        passes=passes, end=end
                    ).result()
                if passes.st.done < len(schedule):
                    raise RunInterrupted(f"stopped after arrival {passes.st.done} as asked; resume to continue")
                res = arrivals_result(passes.st, schedule)
                _log_experiment(cfg, acfg, res, spec=spec, partition=partition, arrivals=log)
                signals.check()  # a stop that landed while it was logged: the run is not finished
            except BaseException:
                # what it holds is written; the run's own error is the one to report
                passes.stop_accepting()
                log.close(raise_errors=False)
                raise
    finally:
        passes.close()
        if bar is not None:
            bar.close()
    return res


def sweep(cfg: DictConfig, *, written: Mapping[str, str] | None = None) -> List[Dict[str, Any]]:
    """The (method x aggregator x seed) grid, cells running concurrently on Ray; logged as each ends.

    Its inputs are checked here, before any service starts; :func:`sweep_flow` runs it.
    ``written``: md5s of inputs the calling flow wrote itself (:func:`flows.services.integrity.record`);
    otherwise the partition and the source model are checked against ``dvc.lock``.
    """
    load_inputs(cfg, written=written)
    model_registry.check(cfg)
    check_checkpoints(arrival_checkpoints(cfg, sweep_cells(cfg)), resume=bool(cfg.flow.resume))
    name = f"sweep-{cfg.data.name}"
    run = sweep_flow.with_options(task_runner=_runner(cfg), flow_run_name=lambda: name)
    try:
        return run(config=C.arrival_run(cfg), written=None if written is None else dict(written))
    finally:
        runtime.shutdown_ray()


@flow(name="sweep", log_prints=True, on_crashed=[signals.crash_open_task_runs])
def sweep_flow(config: Dict[str, Any], written: Dict[str, str] | None = None) -> List[Dict[str, Any]]:
    """Every cell of ``sweep`` (methods x aggregators x privacy forms x seeds) as a task on a Ray worker, each
    logged to MLflow as it ends; returns the cells' summaries in grid order. ``config``: the resolved config
    it reads (:func:`flows.config.compose.arrival_run`)."""
    cfg = C.from_run(config)
    partition, spec, _ = load_inputs(cfg, written=written)
    logger = get_run_logger()
    tracking.setup(C.tracking_uri(cfg), cfg.flow.experiment)
    cells = sweep_cells(cfg)
    # each cell's config by the name its run carries (fails before any work on a bad cell); a result is
    # matched back through this, never by reading its form's name as a setting
    acfgs = {}
    for m, a, f, s in cells:
        acfg = C.arrival_config(cfg, method=m, aggregator=a, seed=s, form=f)
        acfgs[(m, a, acfg.form, s)] = acfg
    with runtime.task_resources(num_gpus=gpus(cfg)):
        futures = [
            run_cell_task.with_options(retries=int(cfg.flow.retries), task_run_name=run_label(*key)).submit(
                cfg_dict=config, acfg=acfg, written=written
            )
            for key, acfg in acfgs.items()
        ]
    results = []
    logged = tracking.finished_runs(str(cfg.flow.experiment), "adapt") if cfg.flow.resume else {}
    failed = tracking.failed_runs(str(cfg.flow.experiment), "adapt") if cfg.flow.resume else {}
    done = as_completed(futures)
    if cfg.flow.progress:
        from tqdm.auto import tqdm

        done = tqdm(done, total=len(futures), desc=f"sweep on {cfg.data.name}", unit="cell")
    for i, fut in enumerate(done, 1):
        res = fut.result()
        signals.check()  # a cell that came back after a stop signal is not logged
        acfg = acfgs[(res["method"], res["aggregator"], res["form"], res["seed"])]
        earlier = (
            tracking.logged_before(logged, run_name(acfg), acfg.fingerprint(), summary_metrics(res["result"].summary))
            if res["already_finished"]
            else None
        )
        if earlier is not None:  # resumed from a finished checkpoint: MLflow holds this cell's run already
            res["seconds"] = earlier.get("run_seconds", res["seconds"])
            logger.info("%s seed %d: finished and logged before; not logged again", acfg.method, acfg.seed)
        else:
            with _start_experiment_run(cfg, acfg, spec, started_ms=res["started_ms"]) as run:
                tracking.link_resumed(failed, run_name(acfg), acfg.fingerprint(), run.info.run_id)
                _log_experiment(cfg, acfg, res["result"], spec=spec, partition=partition)
                mlflow.log_metric("run_seconds", res["seconds"])
                mlflow.set_tags(res.get("placement", {}))
                signals.check()  # a stop that landed while it was logged (where Python may drop it): not finished
            tracking.end_run_at(run.info.run_id, res["ended_ms"])
        s = res["result"].summary
        logger.info(
            "[%d/%d] %s+%s %s seed %d: online %.3f, final hold-out %.3f, forgetting %+.3f (%.1fs)",
            i,
            len(cells),
            res["method"],
            res["aggregator"],
            res["form"],
            res["seed"],
            s["avg_online_acc"],
            s["final_avg_holdout_acc"],
            s["forgetting"],
            res["seconds"],
        )
        results.append(
            {
                "method": res["method"],
                "aggregator": res["aggregator"],
                "form": res["form"],
                "seed": res["seed"],
                "summary": s,
                "seconds": res["seconds"],
            }
        )
    order = {key: i for i, key in enumerate(acfgs)}
    return sorted(results, key=lambda r: order[(r["method"], r["aggregator"], r["form"], r["seed"])])


def audit(cfg: DictConfig) -> List[Dict[str, Any]]:
    """The canary audit on a real client's stream, one setting per ε (and dp0, the private step at σ = 0),
    logged to MLflow."""
    from fedcore.adapt import create_method
    from fedcore.privacy import PrivacySpec, calibrate_sigma, flatten_per_sample, per_sample_grads_functorch
    from fedcore.privacy.audit import canary_audit
    from fedcore.tensors import to_tensor

    a, dp = cfg.dptta.audit, C.privacy_form(cfg, "dp")
    partition, spec, source = load_inputs(cfg)
    pool = to_tensor(partition.targets[int(a.client)].stream_x)

    def build():
        m = spec.build()
        m.load_state_dict(source)
        return m

    # Audit where it is tight: a clip norm below every per-sample gradient norm, so each sample
    # (the canary too) contributes exactly C. The guarantee does not depend on C.
    probe = create_method("tent", build(), lr=float(a.lr))
    g = per_sample_grads_functorch(probe.model, dict(probe.params), probe.sample_loss, pool[:256], {})
    clip = 0.5 * float(flatten_per_sample(g).norm(dim=1).min())
    settings = [("dp0", PrivacySpec(mode="dp0", clip_norm=clip))] + [
        (
            f"dp-eps{e:g}",
            PrivacySpec(
                mode="dp",
                clip_norm=clip,
                noise_source=str(a.noise_source),
                noise_multiplier=calibrate_sigma(float(e), float(dp["delta"])),
            ),
        )
        for e in a.epsilons
    ]
    tracking.setup(C.tracking_uri(cfg), cfg.flow.experiment)
    rows = []
    with tracking.start_run("privacy-audit"):
        mlflow.set_tags(
            {
                **tracking.lineage_tags(
                    seed=int(cfg.seed),
                    prepared=prepared_path(cfg),
                    partition_dir=partition_dir(cfg),
                    reads=[source_model_path(cfg)],
                ),
                "stage": "audit",
                "source_model": source_model_path(cfg).name,
            }
        )
        mlflow.log_params(
            tracking.flatten({"audit": C.to_dict(cfg.dptta)["audit"], "delta": dp["delta"], "clip_norm": clip})
        )
        for i, (form, pspec) in enumerate(settings):
            res = canary_audit(
                build,
                pool,
                spec=pspec,
                delta=float(dp["delta"]),
                num_classes=spec.num_classes,
                lr=float(a.lr),
                stream_size=int(a.stream_size),
                trials=int(a.trials),
                seed=int(cfg.seed) + i,
                confidence=float(a.confidence),
                progress=bool(cfg.flow.progress),
            )
            row = {
                "form": form,
                "sigma": res.sigma,
                "epsilon_accountant": res.epsilon_accountant,
                "epsilon_lower": res.epsilon_lower,
                "auc": res.auc,
                "trials": res.trials,
                "clip_norm": clip,
            }
            rows.append(row)
            metrics = {f"{form}.eps_lower": res.epsilon_lower, f"{form}.auc": res.auc}
            if np.isfinite(res.epsilon_accountant):
                metrics[f"{form}.eps_accountant"] = res.epsilon_accountant
            mlflow.log_metrics(metrics)
            if res.epsilon_lower > res.epsilon_accountant:
                mlflow.set_tag("audit_violation", form)
                raise RuntimeError(
                    f"privacy audit: empirical ε lower bound {res.epsilon_lower:.3f} exceeds the "
                    f"accountant's ε {res.epsilon_accountant:.3f} for {form}: the DP step is broken"
                )
    return rows
