"""SIGTERM and Ctrl-C stop a real run promptly, with a non-zero exit, nothing started after, its MLflow and
Prefect records closed, and a resume that gives the uninterrupted run's metrics (flows/services/signals.py).

Each signal stops each kind of run (an arrival run, a round grid) twice: once, then again after the first resume
has made progress; the second resume runs to the end. SIGTERM goes to the driver by pid, as systemd, Kubernetes
and ``timeout`` send it; SIGINT to the whole process group, as a terminal sends Ctrl-C (Ray's processes get it
too; the temporary Prefect server, in a session of its own, does not). Only the run that is stopped starts as a
user starts it; the uninterrupted reference and the final resume run in the test's process.
``benchmarks/stop.py`` repeats the stops at random moments and reports the times to exit.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import tiny_overrides

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# the stop's bound on this 2-core machine: unwinding, Ray down, runs marked
EXIT_BOUND_S = 10.0
# the arrival run's own series (each arrival also has a nested run of its own)
PARENT = "where run_uuid in (select run_uuid from runs where name = 'bpa+ugsa-s0')"


def _start(step: str, overrides: list[str], log: Path) -> subprocess.Popen:
    """The run to stop, as a user starts it: its own temporary Prefect server and its own Ray, in its group."""
    log.parent.mkdir(parents=True, exist_ok=True)
    own = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_ADDRESS")}
    own["PREFECT_HOME"] = str(log.parent / "prefect-home")  # its server's database, not the shared server's
    with log.open("w") as out:  # a file, not a pipe: nothing blocks on a full pipe while the test waits
        return subprocess.Popen(
            [sys.executable, "-m", "flows.stages", step, *overrides],
            cwd=ROOT,
            env=own,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's job: Ctrl-C reaches all of it
        )


def _query(db: Path, sql: str) -> list:
    if not db.is_file():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as con:
        try:
            return con.execute(sql).fetchall()
        except sqlite3.OperationalError:  # the store is still being created
            return []


def _stop_when(proc: subprocess.Popen, ready, sig: int, timeout: float = 300, seen=lambda: None) -> tuple:
    """Send ``sig`` once ``ready()``; return (what ``seen()`` gave just after it was sent, seconds to exit)."""
    end = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "the run ended before it could be stopped"
        assert time.monotonic() < end, "the run never got going"
        time.sleep(0.2)
    t0 = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid, sig)
    at_signal = seen()
    proc.wait(timeout=120)
    return at_signal, time.monotonic() - t0


def _summary(stdout: str) -> dict:
    """The summary ``python -m flows.stages arrival`` prints last."""
    return json.loads(stdout[stdout.rfind("\n{") + 1 :])


def _finish(step: str, overrides: list[str]) -> str:
    """A run to its end (the reference, the resume) in this process, on the tests' shared Ray and Prefect server;
    returns what it printed."""
    from flows.stages import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([step, *overrides])
    assert code == 0, err.getvalue()[-3000:]
    return out.getvalue()


def _check_stopped(proc: subprocess.Popen, sig: int, seconds: float, folder: Path, log: Path) -> None:
    """What every stop leaves: 128 + the signal within the bound, the stop announced and no exception lost,
    no MLflow run left running, and the Prefect flow runs (in the database of the stopped run's own temporary
    server, which Ctrl-C does not reach) crashed, with none of their task runs left open."""
    err = log.read_text()
    assert proc.returncode == 128 + sig, err[-3000:]
    assert seconds < EXIT_BOUND_S, f"took {seconds:.1f}s to exit"
    assert f"{signal.Signals(sig).name}: stopping" in err and "Exception ignored" not in err, err[-3000:]
    assert not _query(folder / "mlruns.db", "select name from runs where status = 'RUNNING'")
    prefect_home = log.parent / "prefect-home"
    _gone(prefect_home)  # the run's temporary server (in a session of its own) went with it; its database is closed
    with sqlite3.connect(f"file:{prefect_home / 'prefect.db'}?mode=ro", uri=True) as con:
        flow_runs = con.execute("select name, state_type from flow_run").fetchall()
        task_runs = con.execute("select name, state_type from task_run").fetchall()
    assert flow_runs and all(state == "CRASHED" for _, state in flow_runs), flow_runs
    assert task_runs and all(state in ("COMPLETED", "CRASHED") for _, state in task_runs), task_runs


def _gone(prefect_home: Path, timeout: float = 10) -> None:
    """Wait until no process has ``prefect_home`` as its PREFECT_HOME (the stopped run's temporary server)."""
    mark = f"PREFECT_HOME={prefect_home}".encode()
    end = time.monotonic() + timeout
    while True:
        left = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if mark in environ.read_bytes().split(b"\0"):
                    left.append(environ.parent.name)
            except OSError:  # gone meanwhile, or not ours to read
                continue
        if not left:
            return
        assert time.monotonic() < end, f"processes of the stopped run still alive: {left}"
        time.sleep(0.2)


SIGNALS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="SIGINT")]


@pytest.fixture(scope="module")
def arrival_clean(tiny, tmp_path_factory):
    """The arrival run uninterrupted: its overrides (given a folder) and the summary it printed."""

    def overrides(folder: Path, *extra: str) -> list[str]:
        return tiny_overrides(tiny["tmp"]) + [
            "adapt.passes=6",
            "flow.experiment=signals",
            f"flow.tracking_uri=sqlite:///{folder}/mlruns.db",
            f"paths.checkpoints={folder}/checkpoints",
            *extra,
        ]

    clean = _summary(_finish("arrival", overrides(tmp_path_factory.mktemp("arrival-clean"))))
    return overrides, clean


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_signal_stops_an_arrival_run_twice_and_the_resume_continues_it(sig, tiny, arrival_clean, tmp_path):
    # Prepare: the uninterrupted run's numbers; the stopped run's own folder
    overrides, clean = arrival_clean
    folder = tmp_path / "stopped"
    db = folder / "mlruns.db"
    total = len(tiny["partition"].targets) * 6

    def logged() -> int:
        rows = _query(db, f"select count(*) from metrics {PARENT} and key = 'online_acc'")
        return rows[0][0] if rows else 0

    # Execute: stop once two arrivals are on the run's charts; resume and stop again once two more are; resume
    stops = []
    for attempt, extra in enumerate(([], ["flow.resume=true"])):
        before = logged()
        log = tmp_path / f"stop{attempt}" / "log.txt"
        proc = _start("arrival", overrides(folder, *extra), log)
        at_signal, seconds = _stop_when(proc, lambda before=before: logged() >= before + 2, sig, seen=logged)
        stops.append((proc, seconds, log, at_signal, logged()))
    resumed = _summary(_finish("arrival", overrides(folder, "flow.resume=true")))

    # Assert: each stop within the bound and closed; neither came after the run had finished; the resumed run
    # is the one MLflow run, with the clean run's numbers and each arrival on its charts once, from arrival 0
    for proc, seconds, log, at_signal, at_exit in stops:
        _check_stopped(proc, sig, seconds, folder, log)
        assert at_exit < total, "the run had finished before the signal"
        assert at_exit <= at_signal + 2, "arrivals logged after the signal (beyond the two being logged at it)"
    runs = _query(db, "select run_uuid, status from runs where name = 'bpa+ugsa-s0'")
    assert len(runs) == 1 and runs[0][1] == "FINISHED", runs
    assert resumed == clean
    steps = sorted(s for (s,) in _query(db, f"select step from metrics {PARENT} and key = 'online_acc'"))
    assert steps == list(range(total))


@pytest.fixture(scope="module")
def grid_clean(tmp_path_factory):
    """A four-cell FedPAD grid on tiny digit domains run uninterrupted: its overrides (given a folder) and the
    folder it wrote."""
    domains = tmp_path_factory.mktemp("grid-domains")

    def overrides(folder: Path, *extra: str) -> list[str]:
        return [
            f"paths.domains={domains}",
            f"paths.results={folder}/results",
            f"paths.checkpoints={folder}/ckpt",
            f"flow.tracking_uri=sqlite:///{folder}/mlruns.db",
            "flow.progress=false",
            "fedpad.grid=quick",
            "fedpad.grids.quick.max_per_domain=120",
            "fedpad.grids.quick.rounds=4",
            "fedpad.grids.quick.methods=[fedavg,fedpad]",
            "fedpad.grids.quick.seeds=[0,1]",
            *extra,
        ]

    clean = tmp_path_factory.mktemp("grid-clean")
    _finish("partition_domains", overrides(clean))
    _finish("fedpad", overrides(clean))
    return overrides, clean


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_signal_stops_a_grid_twice_and_logs_no_cell_after(sig, grid_clean, tmp_path):
    # Prepare: the uninterrupted grid; the stopped grid's own folder
    overrides, clean = grid_clean
    folder = tmp_path / "stopped"
    db = folder / "mlruns.db"

    def cells() -> list:  # (run id, cell, status): a stopped cell's failed run and its resumed one share a name
        return _query(db, "select run_uuid, name, status from runs")

    def finished() -> set:
        return {name for _, name, status in cells() if status == "FINISHED"}

    # Execute: stop once the first cell is being logged; resume and stop again once one more cell has finished;
    # resume to the end
    stops = []
    for attempt, extra in enumerate(([], ["flow.resume=true"])):
        done = finished()
        ready = (lambda: len(cells()) >= 1) if attempt == 0 else (lambda done=done: len(finished() - done) >= 1)
        log = tmp_path / f"stop{attempt}" / "log.txt"
        proc = _start("fedpad", overrides(folder, *extra), log)
        at_signal, seconds = _stop_when(proc, ready, sig, seen=cells)
        stops.append((proc, seconds, log, at_signal, cells()))
    _finish("fedpad", overrides(folder, "flow.resume=true"))

    # Assert: each stop within the bound and closed; no cell run created after a signal, and none open at it
    # finished after it; resumed, every cell logged once and the uninterrupted grid's outputs byte for byte
    for proc, seconds, log, at_signal, after in stops:
        _check_stopped(proc, sig, seconds, folder, log)
        assert {run for run, _, _ in after} <= {run for run, _, _ in at_signal}, (at_signal, after)
        open_at_signal = {run for run, _, status in at_signal if status != "FINISHED"}
        assert not open_at_signal & {run for run, _, status in after if status == "FINISHED"}, (at_signal, after)
    assert len({n for _, n, status in stops[-1][4] if status == "FINISHED"}) < 4, "the grid had finished at the signal"
    names = sorted(name for _, name, status in cells() if status == "FINISHED")
    assert names == sorted(f"{m}-s{s}" for m in ("fedavg", "fedpad") for s in range(2))

    def outputs(grid_folder: Path) -> dict:  # the stage's outputs hold no timings: a resume writes the same bytes
        grid = grid_folder / "results" / "fedpad" / "quick"
        return {f: (grid / f).read_bytes() for f in ("summary.json", "table.md", "scores.json")}

    assert outputs(folder) == outputs(clean)
