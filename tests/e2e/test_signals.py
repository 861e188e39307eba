"""SIGTERM and Ctrl-C stop a real run promptly, with a non-zero exit, nothing started after, and a resume that
gives the uninterrupted run's metrics (flows/services/signals.py).

SIGTERM goes to the driver by pid, as systemd, Kubernetes and ``timeout`` send it; SIGINT to the whole process
group, as a terminal sends Ctrl-C (the temporary Prefect server and Ray's processes get it too). Only the run
that is stopped starts as a user starts it; the uninterrupted reference and the resume run in the test's process.
``benchmarks/stop.py`` repeats both at random moments and reports the times to exit.
"""

from __future__ import annotations

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


def _finish(step: str, overrides: list[str], capsys) -> str:
    """A run to its end (the reference, the resume) in this process, on the tests' shared Ray and Prefect server;
    returns what it printed."""
    from flows.stages import main

    capsys.readouterr()
    code = main([step, *overrides])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    return out


def test_sigterm_stops_an_arrival_run_and_resume_continues_it(tiny, tmp_path, capsys):
    # Prepare: the session's tiny federation; the uninterrupted run in a folder of its own
    def overrides(folder: Path, *extra: str) -> list[str]:
        return tiny_overrides(tiny["tmp"]) + [
            "adapt.passes=6",
            "flow.experiment=signals",
            f"flow.tracking_uri=sqlite:///{folder}/mlruns.db",
            f"paths.checkpoints={folder}/checkpoints",
            *extra,
        ]

    clean = _summary(_finish("arrival", overrides(tmp_path / "clean"), capsys))
    db = tmp_path / "stopped" / "mlruns.db"

    def logged() -> int:
        rows = _query(db, f"select count(*) from metrics {PARENT} and key = 'online_acc'")
        return rows[0][0] if rows else 0

    # Execute: SIGTERM once two arrivals are on the run's charts, then resume
    proc = _start("arrival", overrides(tmp_path / "stopped"), tmp_path / "stopped.log")
    _, seconds = _stop_when(proc, lambda: logged() >= 2, signal.SIGTERM)
    at_signal_upper = logged()
    err = (tmp_path / "stopped.log").read_text()
    resumed = _summary(_finish("arrival", overrides(tmp_path / "stopped", "flow.resume=true"), capsys))

    # Assert: exit 143 within the bound; no arrival began after the signal (the two in flight may land);
    # the run was marked failed, not left running; the resume is one run with the clean run's numbers
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert seconds < EXIT_BOUND_S, f"took {seconds:.1f}s to exit"
    assert "SIGTERM: stopping" in err and "Exception ignored" not in err
    total = len(tiny["partition"].targets) * 6
    assert at_signal_upper < total, "the run had finished before the signal"
    runs = _query(db, "select run_uuid, status from runs where name = 'bpa+ugsa-s0'")
    assert len(runs) == 1 and runs[0][1] == "FINISHED", runs
    assert resumed == clean
    steps = sorted(s for (s,) in _query(db, f"select step from metrics {PARENT} and key = 'online_acc'"))
    assert steps == list(range(total)), "each arrival on the charts once, from arrival 0"


def test_ctrl_c_stops_a_grid_at_once_and_logs_no_cell_after(tmp_path, capsys):
    # Prepare: a four-cell FedPAD grid on tiny digit domains, and its uninterrupted run
    def overrides(folder: Path, *extra: str) -> list[str]:
        return [
            f"paths.domains={tmp_path}/domains",
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

    _finish("partition_domains", overrides(tmp_path / "clean"), capsys)
    _finish("fedpad", overrides(tmp_path / "clean"), capsys)
    db = tmp_path / "stopped" / "mlruns.db"

    def cells() -> list:
        return _query(db, "select name, status, start_time from runs")

    # Execute: Ctrl-C once the first cell is logged, then resume
    proc = _start("fedpad", overrides(tmp_path / "stopped"), tmp_path / "stopped.log")
    at_signal, seconds = _stop_when(proc, lambda: len(cells()) >= 1, signal.SIGINT, seen=cells)
    err = (tmp_path / "stopped.log").read_text()
    stopped = cells()
    _finish("fedpad", overrides(tmp_path / "stopped", "flow.resume=true"), capsys)

    # Assert: exit 130 within the bound; no cell run created after the signal, none left running; resumed,
    # every cell logged once and the same table as the uninterrupted grid's (timings aside)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert seconds < EXIT_BOUND_S, f"took {seconds:.1f}s to exit"
    # a cell run that was open at the signal ends failed; none is created or finishes after it
    assert {n for n, _, _ in stopped} <= {n for n, _, _ in at_signal}, (at_signal, stopped)
    open_at_signal = {n for n, status, _ in at_signal if status != "FINISHED"}
    assert not open_at_signal & {n for n, status, _ in stopped if status == "FINISHED"}, (at_signal, stopped)
    assert len(stopped) < 4 and all(status != "RUNNING" for _, status, _ in stopped), stopped
    names = sorted(name for name, status, _ in cells() if status == "FINISHED")
    assert names == sorted(f"{m}-s{s}" for m in ("fedavg", "fedpad") for s in range(2))

    def outputs(folder: Path) -> dict:  # the stage's outputs hold no timings, so the resumed run wrote the same bytes
        grid = folder / "results" / "fedpad" / "quick"
        return {f: (grid / f).read_bytes() for f in ("summary.json", "table.md", "scores.json")}

    assert outputs(tmp_path / "stopped") == outputs(tmp_path / "clean")
