"""MLflow: where every number and model came from.

One parent run per experiment (a pretraining run, or one method x aggregator x seed cell),
a nested run per round or arrival, metrics with step = round / arrival index, the resolved
config as params, lineage as tags, plots and checkpoints as artifacts, and the final global
model in the Model Registry.

A registered model is data only: the network's spec and its weights
(:func:`fedcore.engine.save_network`), with their sha256s in the run's tags. Load a version
in any process with :func:`load_registered`; nothing in the artifact store is unpickled.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import queue
import re
import sqlite3
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

import mlflow
import numpy as np
import torch

from fedcore.data import sha256_file
from fedcore.engine import ModelSpec, load_network, save_network
from fedcore.engine.spec import SPEC_FILE, WEIGHTS_FILE
from flows.config.compose import ROOT
from flows.services import artifact_store, integrity

MODEL_NAME = "global_model"  # the logged model's name in its run
NETWORK_DIR = "network"  # the folder of spec + weights inside the logged model's data
MODEL_SHA256_TAG = "global_model.sha256."  # + file name: the run tag the registry loader checks


def setup(uri: str, experiment: str) -> None:
    """Track into ``uri`` under ``experiment``.

    In a local SQLite store a new experiment keeps its artifacts beside the database, addressed
    relative to it (:mod:`flows.services.artifact_store`), so a copied or moved project still opens them.
    """
    from mlflow.exceptions import MlflowException

    mlflow.set_tracking_uri(uri)
    if artifact_store.is_local_sqlite(uri):
        artifact_store.register()
        if mlflow.get_experiment_by_name(experiment) is None:
            try:
                mlflow.create_experiment(experiment, artifact_location=artifact_store.location(experiment))
            except MlflowException:  # another process created it first
                pass
        write_ahead_log(uri)
    exp = mlflow.set_experiment(experiment)
    if exp.tags.get(EXPERIMENT_KIND) != MODEL_DEVELOPMENT:
        # MLflow 3 opens an experiment without this tag on its GenAI overview (traces, of which we have
        # none); with it, on the runs table
        mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, MODEL_DEVELOPMENT)


EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_DEVELOPMENT = "custom_model_development"


def write_ahead_log(uri: str, *, timeout: float = 5.0) -> str:
    """Put a local SQLite tracking store in write-ahead-log mode, and return its journal mode.

    In SQLite's default rollback-journal mode every commit creates, syncs and deletes a journal
    file, and MLflow commits once per store call: an arrival's nested run is three of them
    (``create_run``, ``log_batch``, ``set_terminated``). In WAL mode a commit appends to one log,
    which costs less CPU, and readers (``mlflow ui``, another flow) do not block the writer
    (docs/benchmarks.md). SQLite keeps the mode in the file, so this changes a store
    once. The latest commits live in ``mlruns.db-wal`` until SQLite folds them into the database,
    which it does when the last connection closes cleanly: copy ``mlruns.db*`` together. ``""`` is
    returned, and the store left as it is (the next flow tries again), when it is not a file, or
    when it cannot be changed: another connection holds it for longer than ``timeout`` seconds, or
    it is read-only.
    """
    from sqlalchemy.engine import make_url

    path = make_url(uri).database or ""  # as MLflow's engine reads it: percent-escapes decoded, no query
    if not Path(path).is_file():  # in memory, or not created yet
        return ""
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=timeout)) as con:
            mode = con.execute("PRAGMA journal_mode").fetchone()[0]
            if mode.lower() != "wal":
                mode = con.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    except sqlite3.Error as exc:
        logging.getLogger(__name__).info("the tracking store %s stays in its journal mode (%s)", path, exc)
        return ""
    return str(mode).lower()


def start_run(run_name: str, *, started_ms: int | None = None) -> "mlflow.ActiveRun":
    """``mlflow.start_run``, but a run logged after its work ended may give the time the work began
    (``started_ms``, epoch milliseconds), so its duration in the UI is the experiment's.

    A stop signal cannot leave the run ``RUNNING`` with nothing holding it: creating the run and making
    it active is one step (:func:`flows.services.signals.deferred`), and a stop that came meanwhile
    ends the run as failed once it is active."""
    from mlflow.tracking.context import registry as context

    client = mlflow.MlflowClient()
    exp = mlflow.tracking.fluent._get_experiment_id()
    start = None if started_ms is None else int(started_ms)
    return _activated(
        lambda: client.create_run(exp, start_time=start, run_name=run_name, tags=context.resolve_tags({})).info.run_id
    )


RUN_ID_FILE = "mlflow_run_id"  # in a run's checkpoint folder: the MLflow run a resume continues


def run_to_continue(checkpoint_dir: Path | None) -> str | None:
    """The MLflow run an interrupted run (arrival or round run) wrote to, if this store holds it unfinished."""
    path = None if checkpoint_dir is None else checkpoint_dir / RUN_ID_FILE
    if path is None or not path.is_file():
        return None
    from mlflow.exceptions import MlflowException

    try:
        run = mlflow.MlflowClient().get_run(path.read_text().strip())
    except MlflowException:  # another store, or deleted: a new run
        return None
    if (
        run.info.status not in ("FAILED", "KILLED")  # finished, or still running in another process
        or run.info.lifecycle_stage != "active"  # deleted in the UI: start afresh
        or run.info.experiment_id != mlflow.tracking.fluent._get_experiment_id()
    ):
        return None
    return run.info.run_id


def resumable_run(
    name: str, *, resume: bool, checkpoint_dir: Path | None, started_ms: int | None = None
) -> Tuple["mlflow.ActiveRun", str | None]:
    """(the active run, the id of the run it continues or None): with ``resume``, the unfinished run whose id
    ``checkpoint_dir`` keeps, tagged ``resumed``; else a new run ``name``. Its id is kept in ``checkpoint_dir``
    so that a later resume continues it, and its charts go on from where it stopped."""
    earlier = run_to_continue(checkpoint_dir) if resume else None
    run = continue_run(earlier) if earlier is not None else start_run(name, started_ms=started_ms)
    with failing_run(run):
        if earlier is not None:
            mlflow.set_tag("resumed", "true")
        if checkpoint_dir is not None:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            (checkpoint_dir / RUN_ID_FILE).write_text(run.info.run_id)
    return run, earlier


def continue_run(run_id: str) -> "mlflow.ActiveRun":
    """An earlier run made active again (a resumed arrival run), as :func:`start_run` guards a new one."""
    return _activated(lambda: run_id)


def _activated(run_id_of: Callable[[], str]) -> "mlflow.ActiveRun":
    from flows.services import signals

    run_id = None
    try:
        with signals.deferred():
            run_id = run_id_of()
            active = mlflow.start_run(run_id=run_id)
        return active
    except BaseException:
        if run_id is not None:
            now = mlflow.active_run()
            if now is not None and now.info.run_id == run_id:
                mlflow.end_run("FAILED")
            else:
                mlflow.MlflowClient().set_terminated(run_id, "FAILED")
        raise


@contextlib.contextmanager
def failing_run(run: "mlflow.ActiveRun"):
    """Describe a run just started (params, tags, links) before the caller's ``with`` takes it over: if
    that fails, or a stop signal lands there, the run is ended as failed rather than left running."""
    try:
        yield run
    except BaseException:
        mlflow.end_run("FAILED")
        raise


def fail_active_runs() -> None:
    """End, as failed, every run this thread still holds open: a stop signal that lands between a run's
    creation and the ``with`` that would close it leaves nobody else to."""
    while mlflow.active_run() is not None:
        mlflow.end_run("FAILED")


def end_run_at(run_id: str, ended_ms: int) -> None:
    """Give a finished run the time its work ended (after ``with start_run(...)`` closed it)."""
    mlflow.MlflowClient().set_terminated(run_id, end_time=int(ended_ms))


_PARAM_KEY = re.compile(r"[^\w\-. /]")  # MLflow keys allow word characters, - . space and / only


def flatten(d: Mapping[str, Any], prefix: str = "") -> Dict[str, str]:
    """Nested settings as MLflow params: dotted keys, lists as JSON.

    A character MLflow refuses in a key becomes ``_`` (``fedpd++`` → ``fedpd__``), so a method
    may have any name in the config without failing the run that logs it.
    """
    out: Dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{_PARAM_KEY.sub('_', str(k))}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def file_sha256(path: Path) -> str:
    """sha256 of a file, computed once per (path, size, mtime): a sweep tags every cell with it."""
    st = Path(path).stat()
    return _file_sha256(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def git_commit() -> str:
    """The commit the work tree is based on, as ``git checkout`` takes it (``unknown`` outside git).

    Never suffixed ``-dirty``: a run rebuilds and records stages (``dvc repro`` rewrites ``dvc.lock``), so
    most runs happen in a changed tree, and a suffixed sha names nothing a user can check out. What
    differs from the commit is in :func:`git_changes`, and the exact inputs in the ``dvc.*`` md5 tags.
    """
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def git_changes(limit: int = 400) -> str:
    """The tracked files that differ from :func:`git_commit` (comma-separated; at most ``limit`` characters,
    then how many more), ``none`` for a clean tree, ``unknown`` outside git."""
    try:
        proc = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if proc.returncode != 0:
        return "unknown"
    files = [line[3:] for line in proc.stdout.splitlines() if line.strip()]
    listed, shown = "", 0
    for f in files:
        if len(listed) + len(f) + 2 > limit:
            break
        listed, shown = (f"{listed}, {f}" if listed else f), shown + 1
    return (listed + (f" and {len(files) - shown} more" if shown < len(files) else "")) or "none"


def dvc_lock_hashes(reads: Iterable[Path | None], *, root: Path | None = None) -> Dict[str, str]:
    """md5s DVC recorded (``dvc.lock``) for the stage outputs a run reads, so it names the exact data it used.

    ``reads``: the files and folders the run reads (absolute, or relative to ``root``). An output
    counts if it is one of them, lies inside one, or holds one (a partition folder, a file in it).
    Outputs of stages the run does not read (other systems' grids, other cells) are not its
    lineage: the lock holds hundreds. Paths are compared as written, links not followed: with
    DVC's ``symlink`` cache type an output resolves into the cache.
    """
    if isinstance(reads, (str, Path)):
        raise TypeError("reads is a list of paths, not one path")
    root = ROOT if root is None else root

    def normal(p) -> str:  # compared as strings: Path.parents over the lock's outputs took 64 ms (profiled)
        return os.path.abspath(os.path.join(root, p))

    def inside(a: str, b: str) -> bool:  # a strictly inside b; join(b, "") ends b with exactly one separator
        return a != b and a.startswith(os.path.join(b, ""))

    want = [normal(p) for p in reads if p is not None]
    tags = {}
    for o in integrity.lock_outs(root):
        path = normal(o.path)
        if any(path == w or inside(w, path) or inside(path, w) for w in want):
            tags[f"dvc.{o.stage.replace('@', ':')}.{Path(o.path).name}"] = o.md5
    return tags


def lineage_tags(
    *, seed: int, prepared: Path | None, partition_dir: Path, reads: Iterable[Path] = (), extra: Mapping[str, str] = ()
) -> Dict[str, str]:
    """Where a run's inputs came from: the commit and what differs from it, the seed, the data's and
    partition's sha256s, the sha256 of ``dvc.lock`` as the run found it, and the ``dvc.lock`` md5s of the
    stage outputs it reads (``prepared``, ``partition_dir`` and ``reads``)."""
    tags = {"git_commit": git_commit(), "git_changes": git_changes(), "seed": str(seed)}
    lock = ROOT / "dvc.lock"
    if lock.is_file():
        tags["dvc_lock_sha256"] = file_sha256(lock)
    if prepared is not None and prepared.is_file():
        tags["data_sha256"] = file_sha256(prepared)
    manifest = partition_dir / "manifest.json"
    if manifest.is_file():
        tags["partition_manifest_sha256"] = file_sha256(manifest)
        tags["partition_manifest"] = str(manifest.relative_to(ROOT) if manifest.is_relative_to(ROOT) else manifest)
    tags.update(dvc_lock_hashes([prepared, partition_dir, *reads]))
    tags.update(dict(extra))
    return tags


def log_arrival(
    record: Mapping[str, Any],
    *,
    parent: "mlflow.entities.Run | None" = None,
    client: "mlflow.MlflowClient | None" = None,
    at_ms: int | None = None,
) -> None:
    """A nested run for one arrival, plus the same numbers on the parent with step = arrival.

    Written with explicit run ids (one batch per run), so it may run on another thread than
    the one that started ``parent`` (default: the active run). ``at_ms``: when the arrival came
    back (default: now), the metrics' timestamp and the nested run's time.
    """
    parent = parent or mlflow.active_run()
    client = client or mlflow.MlflowClient()
    at_ms = _ms(at_ms)
    log_arrival_series(record, parent=parent, client=client, at_ms=at_ms)
    log_arrival_run(record, parent=parent, client=client, at_ms=at_ms)


def _ms(at_ms: int | None = None) -> int:
    """``at_ms``, or now, in MLflow's milliseconds."""
    return int(time.time() * 1000) if at_ms is None else at_ms


def _arrival_metrics(record: Mapping[str, Any], at_ms: int | None) -> list:
    from mlflow.entities import Metric

    step, at_ms = int(record["arrival"]), _ms(at_ms)
    return [
        Metric(k, float(v), at_ms, step) for k, v in record.items() if isinstance(v, (int, float)) and k != "arrival"
    ]


def log_arrival_series(
    record: Mapping[str, Any], *, parent: "mlflow.entities.Run", client: "mlflow.MlflowClient", at_ms: int | None = None
) -> None:
    """One arrival's numbers on the parent run, step = arrival: the run's charts, one batch."""
    log_arrival_series_batch([(record, _ms(at_ms))], parent=parent, client=client)


def log_arrival_series_batch(
    items: Sequence[Tuple[Mapping[str, Any], int]], *, parent: "mlflow.entities.Run", client: "mlflow.MlflowClient"
) -> None:
    """Several arrivals' numbers on the parent run, each at its own step and time, in as few batches as
    MLflow takes (a batch costs about 3 ms of CPU in a local store, nearly all of it per call)."""
    metrics = [m for record, at_ms in items for m in _arrival_metrics(record, at_ms)]
    for i in range(0, len(metrics), 900):  # MLflow takes at most 1000 metrics per batch
        client.log_batch(parent.info.run_id, metrics=metrics[i : i + 900])


@functools.lru_cache(maxsize=4)
def _context_tags(parent_run_id: str) -> Dict[str, str]:
    """MLflow's context tags (user, source, git commit) for the nested runs of one parent: resolved
    once, since each resolution probes for Databricks, Spark and IPython with imports that fail."""
    from mlflow.tracking.context import registry as context

    return dict(context.resolve_tags({}))


def log_arrival_run(
    record: Mapping[str, Any], *, parent: "mlflow.entities.Run", client: "mlflow.MlflowClient", at_ms: int | None = None
) -> None:
    """One arrival's nested run ``arrival-<a>-<corruption>``: its client, pass and numbers, timed
    ``at_ms`` (when the arrival came back; default now) however late it is written."""
    step = int(record["arrival"])
    tags = {
        "client_id": str(record["client_id"]),
        "corruption": record["corruption"],
        "pass": str(record["pass"]),
        "arrival": str(step),
        "mlflow.parentRunId": parent.info.run_id,
    }
    if "privacy_refused" in record:
        tags["privacy"] = (
            "REFUSED: client budget spent, no update merged" if record["privacy_refused"] else "private update"
        )
    at_ms = _ms(at_ms)
    child = client.create_run(
        parent.info.experiment_id,
        start_time=at_ms,
        run_name=f"arrival-{step:03d}-{record['corruption']}",
        tags={**_context_tags(parent.info.run_id), **tags},
    )
    client.log_batch(child.info.run_id, metrics=_arrival_metrics(record, at_ms))
    client.set_terminated(child.info.run_id, end_time=at_ms)


def finished_runs(experiment: str, stage: str) -> Dict[Tuple[str, str], Dict[str, float]]:
    """The finished runs of ``experiment`` tagged ``stage`` in the active tracking store: (run name, config
    fingerprint) -> metrics. A resumed grid or sweep logs a cell whose checkpoint was already complete only if
    no run of the same name, settings and numbers is here."""
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    runs = mlflow.MlflowClient().search_runs(
        [exp.experiment_id], f"tags.stage = '{stage}' and attributes.status = 'FINISHED'", max_results=50000
    )
    return {
        (r.info.run_name, r.data.tags.get("config_fingerprint", "")): dict(r.data.metrics)
        for r in runs
        if r.info.run_name
    }


def failed_runs(experiment: str, stage: str) -> Dict[Tuple[str, str], str]:
    """(run name, config fingerprint) -> the id of the latest FAILED run of ``experiment`` tagged ``stage``: a
    cell whose logging a stop signal cut short. The run that logs the cell on resume links to it
    (:func:`link_resumed`), so that the two show as one record's halves rather than two records."""
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    runs = mlflow.MlflowClient().search_runs(
        [exp.experiment_id],
        f"tags.stage = '{stage}' and attributes.status = 'FAILED'",
        order_by=["attributes.start_time ASC"],
        max_results=50000,
    )
    return {
        (r.info.run_name, r.data.tags.get("config_fingerprint", "")): r.info.run_id
        for r in runs
        if r.info.run_name and "superseded_by" not in r.data.tags  # linked already: not linked again
    }


def link_resumed(failed: Mapping[Tuple[str, str], str], name: str, fingerprint: str, run_id: str) -> None:
    """Tag ``run_id`` ``resumed_from`` the failed run of the same cell, and that one ``superseded_by`` it."""
    earlier = failed.get((name, fingerprint))
    if earlier is None or earlier == run_id:
        return
    client = mlflow.MlflowClient()
    client.set_tag(run_id, "resumed_from", earlier)
    client.set_tag(earlier, "superseded_by", run_id)


def logged_before(
    logged: Mapping[Tuple[str, str], Mapping[str, float]], name: str, fingerprint: str, metrics: Mapping[str, float]
) -> Dict[str, float] | None:
    """The metrics of the finished run ``(name, fingerprint)`` in ``logged`` if it holds ``metrics`` exactly."""
    earlier = logged.get((name, fingerprint))

    def same(a: float | None, b: float) -> bool:
        return a is not None and (a == b or (math.isnan(a) and math.isnan(b)))

    if earlier is None or not all(same(earlier.get(k), float(v)) for k, v in metrics.items()):
        return None
    return dict(earlier)


class BackgroundLog:
    """Logs records in order on one background thread, so the flow never waits on the tracking store.

    ``log_one(record, parent=..., client=..., at_ms=...)`` writes one record (:func:`log_arrival`,
    or :func:`log_round_record`) with explicit run ids, timed when the record was handed over.
    ``log_at_close``, if given, writes a second part of every record, all of them when :meth:`close`
    is called (the arrival flow's nested runs: see :func:`BackgroundArrivalLog`). ``log_batch``, if
    given, writes several records at once (``log_batch(items, parent=..., client=...)``, items
    ``(record, at_ms)``): the records that come in less than ``every`` seconds after the last write
    wait and go together, so a record is written at once when records are rare and at most
    ``every`` seconds late when they are frequent. Call the object
    with each record; :meth:`close` waits for the queue to drain and re-raises the first logging
    error (after the flow's own checkpoint is safe, so nothing computed is lost).
    """

    def __init__(
        self,
        log_one: Callable[..., None],
        *,
        log_at_close: Callable[..., None] | None = None,
        log_batch: Callable[..., None] | None = None,
        every: float = 0.0,
        what: str = "a record",
    ) -> None:
        self._log_one, self._log_at_close, self._what = log_one, log_at_close, what
        self._log_batch, self._every = log_batch, float(every)
        self._held: List[Tuple[Mapping[str, Any], int]] = []
        self._stopping = self._reported = False
        self._parent, self._client = mlflow.active_run(), mlflow.MlflowClient()
        self._queue: "queue.Queue[Tuple[Mapping[str, Any], int] | None]" = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlflow-records", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pending: List[Tuple[Mapping[str, Any], int]] = []
        last = -math.inf  # when the last batch was written (monotonic seconds)
        while True:
            wait = None if not pending else last + self._every - time.monotonic()
            if wait is not None and wait <= 0:  # due: what came in since the last batch, in one
                self._write_pending(pending)
                pending, last = [], time.monotonic()
                continue
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            if item is None:
                break
            pending.append(item)
            if self._log_at_close is not None:
                self._held.append(item)
        self._write_pending(pending)
        for item in self._held:
            self._write(self._log_at_close, *item)

    def _write_pending(self, pending: List[Tuple[Mapping[str, Any], int]]) -> None:
        if self._log_batch is not None and len(pending) > 1:
            self._guarded(self._log_batch, pending)
            return
        for item in pending:
            self._write(self._log_one, *item)

    def _write(self, log: Callable[..., None], record: Mapping[str, Any], at_ms: int) -> None:
        self._guarded(log, record, at_ms=at_ms)

    def _guarded(self, log: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """``log(*args, parent=..., client=..., **kwargs)`` unless an earlier write failed; its error is kept."""
        if self._error is None:
            try:
                log(*args, parent=self._parent, client=self._client, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - kept and re-raised by close()
                self._error = exc

    def __call__(self, record: Mapping[str, Any]) -> None:
        self._queue.put((dict(record), _ms()))

    def close(self, *, raise_errors: bool = True) -> None:
        """Write what is queued or held, then stop. A second call only waits for the writes (if the
        first was interrupted) and reports nothing again."""
        if not self._stopping:
            self._stopping = True
            self._queue.put(None)
        self._thread.join()
        if self._reported:
            return
        self._reported = True
        if self._error is not None:
            if raise_errors:
                raise RuntimeError(f"logging {self._what} to MLflow failed: {self._error}") from self._error
            logging.getLogger(__name__).warning("logging %s to MLflow failed: %s", self._what, self._error)


# The parent run's per-arrival numbers are written at most this late: arrivals that come back less than
# this after the last write go in one batch (sub-second arrivals: one write for several instead of one
# each, beside the worker; arrivals slower than this: each written as it comes back).
SERIES_EVERY_S = 1.0


def BackgroundArrivalLog(*, runs_at_end: bool = True) -> BackgroundLog:  # noqa: N802 - the arrival flow's logger
    """The arrival flow's logger: each arrival's numbers on the parent run as it comes back.

    Its nested run is written then too with ``runs_at_end=False`` (``flow.arrival_runs=live``);
    by default all the nested runs are written by :meth:`BackgroundLog.close`, once the worker has
    finished (docs/benchmarks.md: on 2 cores, about 10 ms of CPU per nested run while the worker
    computes cost the flow more than the same writes after it).
    """
    if runs_at_end:
        return BackgroundLog(
            log_arrival_series,
            log_at_close=log_arrival_run,
            log_batch=log_arrival_series_batch,
            every=SERIES_EVERY_S,
            what="an arrival",
        )
    return BackgroundLog(log_arrival, what="an arrival")


def BackgroundRoundLog() -> BackgroundLog:  # noqa: N802 - the round flows' logger
    return BackgroundLog(log_round_record, what="a round")


def log_round_record(
    record: Mapping[str, Any],
    *,
    parent: "mlflow.entities.Run | None" = None,
    client: "mlflow.MlflowClient | None" = None,
    at_ms: int | None = None,
) -> None:
    """One round: its metrics on the parent with step = round, and a nested run ``round-<r>`` that holds them.

    Explicit run ids, as :func:`log_arrival`: safe on another thread than the one that started ``parent``.
    """
    from mlflow.entities import Metric
    from mlflow.tracking.context import registry as context

    parent = parent or mlflow.active_run()
    client = client or mlflow.MlflowClient()
    step, now = int(record["round"]), _ms(at_ms)
    metrics = [Metric(k, v, now, step) for k, v in round_metrics(record).items()]
    for i in range(0, len(metrics), 900):  # MLflow takes at most 1000 metrics per batch
        client.log_batch(parent.info.run_id, metrics=metrics[i : i + 900])
    tags = {
        "round": str(step),
        "clients": json.dumps(record["clients"]),
        "refused_clients": json.dumps(record.get("refused", [])),
        "mlflow.parentRunId": parent.info.run_id,
    }
    child = client.create_run(parent.info.experiment_id, run_name=f"round-{step:03d}", tags=context.resolve_tags(tags))
    for i in range(0, len(metrics), 900):
        client.log_batch(child.info.run_id, metrics=metrics[i : i + 900])
    client.set_terminated(child.info.run_id)


def round_metrics(record: Mapping[str, Any]) -> Dict[str, float]:
    """The numeric fields of a round record, as MLflow metrics (lists such as ``clients`` are left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "round"
    }


def log_rounds(records: Iterable[Mapping[str, Any]]) -> None:
    """Every round's metrics on the active run with step = round, in batches (a nested run per round:
    :func:`log_round_record`)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    log_metric_batches([Metric(k, v, now, int(rec["round"])) for rec in records for k, v in round_metrics(rec).items()])


def log_metric_batches(metrics: List["mlflow.entities.Metric"]) -> None:
    """``metrics`` on the active run, 900 to a request (MLflow takes at most 1,000)."""
    run, client = mlflow.active_run(), mlflow.MlflowClient()
    for i in range(0, len(metrics), 900):  # MLflow takes at most 1000 metrics per batch
        client.log_batch(run.info.run_id, metrics=metrics[i : i + 900])


def log_client_lines(lines: Iterable[Tuple[int, int, Mapping[str, float]]]) -> None:
    """Per-client lines (step, client k, metrics) on the active run as ``<metric>.c<k>`` with that step, in
    batches: the privacy ledger of a round-based run (:func:`fedcore.privacy.ledger.round_ledger_lines`)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    log_metric_batches(
        [Metric(f"{name}.c{k}", float(v), now, int(step)) for step, k, line in lines for name, v in line.items()]
    )


def log_model(spec: ModelSpec, state: Dict[str, torch.Tensor], *, example: np.ndarray) -> str:
    """Log the final global model on the active run as data only; return its ``models:/`` URI.

    Registering a version is a separate step (:mod:`flows.services.model_registry`): a sweep logs every
    cell's model but registers only the ones its config names.

    The logged model is an MLflow pyfunc whose loader is this module (from the installed
    package, never from the artifact store) and whose data is the network's ``spec.json``
    and ``state_dict.pt``. Their sha256s go into the run's tags, where :func:`load_registered`
    checks them. ``example`` is one normalised input batch (N, C, H, W) for the signature.
    """
    from mlflow.models import infer_signature

    example = np.array(example)  # a writable copy: torch warns on a read-only array (a memory map)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_network(Path(tmp) / NETWORK_DIR, spec, state)
        mlflow.set_tags({MODEL_SHA256_TAG + f: sha256_file(folder / f) for f in (SPEC_FILE, WEIGHTS_FILE)})
        with torch.no_grad():
            logits = load_network(folder)(torch.as_tensor(example)).numpy()
        info = mlflow.pyfunc.log_model(
            name=MODEL_NAME,
            loader_module=__name__,
            data_path=str(folder),
            input_example=example,
            signature=infer_signature(example, logits),
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "fedcore"],
        )
    return info.model_uri


def load_registered(name: str, version: int | str = "latest", *, tracking_uri: str | None = None) -> torch.nn.Module:
    """A registered model version as a ``torch.nn.Module`` in eval mode, on the CPU.

    Parameters
    ----------
    name:
        The registered model, e.g. ``"bpfedctta-mnist5k"`` (:func:`flows.services.model_registry.model_name`).
    version:
        A version number, ``"latest"``, or an alias such as ``"champion"``.
    tracking_uri:
        The tracking server (registry) to ask; default: the one MLflow is set to.

    Raises
    ------
    flows.services.integrity.IntegrityError
        The stored spec or weights differ from the sha256s in the run's tags, or the version
        predates them (registered as a pickle): nothing was loaded.

    Examples
    --------
    >>> from flows.services.tracking import load_registered
    >>> model = load_registered("bpfedctta-mnist5k", "champion", tracking_uri="sqlite:///mlruns.db")
    >>> logits = model(x)  # x: (N, C, H, W), normalised like the training data
    """
    client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    mv = _model_version(client, name, version)
    tags = client.get_run(mv.run_id).data.tags
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=client.get_model_version_download_uri(name, mv.version),
                dst_path=tmp,
                tracking_uri=tracking_uri,
            )
        )
        folder = local / "data" / NETWORK_DIR
        for f in (SPEC_FILE, WEIGHTS_FILE):
            expected = tags.get(MODEL_SHA256_TAG + f)
            if expected is None:
                raise integrity.IntegrityError(
                    f"version {mv.version} of {name!r} (run {mv.run_id}) has no tag {MODEL_SHA256_TAG + f}: it was "
                    "registered before models were stored as data only (perhaps as a pickle), so it is not "
                    "loaded; register it again from a current run"
                )
            actual = sha256_file(folder / f) if (folder / f).is_file() else "missing"
            if actual != expected:
                raise integrity.IntegrityError(
                    f"{f} of version {mv.version} of {name!r} does not match the sha256 its run {mv.run_id} "
                    f"recorded (expected {expected}, found {actual}): the artifact store was changed after "
                    "registration, so it was not loaded"
                )
        return load_network(folder)


def _model_version(client: "mlflow.MlflowClient", name: str, version: int | str):
    if isinstance(version, int) or str(version).isdigit():
        return client.get_model_version(name, str(version))
    if version == "latest":
        versions = client.search_model_versions(f"name='{name}'")
        if not versions:
            raise ValueError(
                f"no registered model {name!r}; a sweep registers its configured cell as "
                f"<system>-<data> (or flow.register_model={name})"
            )
        return max(versions, key=lambda v: int(v.version))
    return client.get_model_version_by_alias(name, str(version))


class _Network:
    """What ``mlflow.pyfunc.load_model`` returns for a fedcore model: logits for a float array."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def predict(self, data: Any, params: Any = None) -> np.ndarray:
        with torch.no_grad():
            return self.model(torch.as_tensor(np.asarray(data, dtype=np.float32))).numpy()


def _load_pyfunc(data_path: str) -> _Network:
    """MLflow's loader hook (``loader_module``): rebuild the network from its spec; weights as tensors only."""
    return _Network(load_network(data_path))


def log_files(paths: Iterable[Path], artifact_path: str | None = None) -> None:
    for p in paths:
        if Path(p).exists():
            mlflow.log_artifact(str(p), artifact_path=artifact_path)


def summary_rows(results: List[Dict[str, Any]]) -> str:
    """A Markdown table of sweep results (privacy columns when any cell is private)."""
    private = any(r.get("form", "plain") != "plain" for r in results)
    head = "| method | aggregator | seed | avg online acc | final avg hold-out acc | worst hold-out | forgetting | source acc |"
    if private:
        head = head.replace("| seed |", "| form | seed |") + " ε per arrival | max client ε |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        s = r["summary"]
        form = f" {r.get('form', 'plain')} |" if private else ""
        line = (
            f"| {r['method']} | {r['aggregator']} |{form} {r['seed']} | {s['avg_online_acc']:.3f} | "
            f"{s['final_avg_holdout_acc']:.3f} | {s['final_worst_holdout_acc']:.3f} | "
            f"{s['forgetting']:+.3f} | {s['source_acc']:.3f} |"
        )
        if private:
            line += (
                f" {s['eps_per_arrival']:.2f} | {s['eps_max_client']:.2f} |" if "eps_max_client" in s else " – | – |"
            )
        lines.append(line)
    return "\n".join(lines)
