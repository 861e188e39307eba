"""Time to exit after SIGTERM and Ctrl-C, at random moments of real runs (flows/services/signals.py).

    python benchmarks/stop.py               # 5 trials of each signal on each kind of run
    python benchmarks/stop.py --trials=10

Builds tiny inputs in a temporary folder first (digit domains for a FedPAD grid; prepared MNIST, a
partition and a source model for an arrival run), then, per trial, starts
``python -m flows.stages fedpad`` or ``python -m flows.stages arrival``, waits a random 0-4 s after its
first logged cell or arrival, and sends SIGTERM to the driver or SIGINT to its process group (as a
terminal's Ctrl-C). Prints, per kind and signal, the exit statuses and the time from the signal to
exit (median and worst), and counts a trial as wrong if the status is not 128 + the signal or an
MLflow run is left RUNNING.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stages(step: str, overrides: list[str], *, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, "-m", "flows.stages", step, *overrides],
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def build(step: str, overrides: list[str]) -> None:
    if stages(step, overrides).wait() != 0:
        raise SystemExit(f"`python -m flows.stages {step}` failed while building the inputs")


def query(db: Path, sql: str) -> list:
    if not db.is_file():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as con:
            return con.execute(sql).fetchall()
    except sqlite3.OperationalError:
        return []


def trial(step: str, overrides: list[str], db: Path, sig: int, log: Path) -> tuple[int, float, bool]:
    proc = stages(step, overrides, log=log)
    while not query(db, "select 1 from runs limit 1"):
        if proc.poll() is not None:
            raise SystemExit(f"the run ended before any record: see {log}")
        time.sleep(0.2)
    time.sleep(random.uniform(0, 4))
    t0 = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid, sig)
    code = proc.wait()
    seconds = time.monotonic() - t0
    left_running = bool(query(db, "select 1 from runs where status = 'RUNNING'"))
    return code, seconds, left_running


def main() -> None:
    trials = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--trials=")), 5)
    random.seed(0)
    with tempfile.TemporaryDirectory(prefix="fedcore-stop-") as tmp_s:
        tmp = Path(tmp_s)
        grid = [
            f"paths.domains={tmp}/domains",
            "flow.progress=false",
            "fedpad.grid=quick",
            "fedpad.grids.quick.rounds=6",
            "fedpad.grids.quick.seeds=[0,1]",
        ]
        arrival = [
            "data=digits",
            "pretrain.rounds=4",
            "adapt.passes=6",
            "flow.progress=false",
            f"paths.prepared={tmp}/prepared",
            f"paths.partitions={tmp}/partitions",
            f"paths.models={tmp}/models",
        ]
        print("building the inputs ...", flush=True)
        build("partition_domains", grid)
        for step in ("prepare", "partition", "pretrain"):
            build(step, arrival + [f"flow.tracking_uri=sqlite:///{tmp}/build.db"])
        kinds = {"fedpad": grid, "arrival": arrival}
        print("\n| run | signal | trials | exit statuses | seconds to exit: median | worst | wrong |")
        print("|---|---|---|---|---|---|---|")
        for step, base in kinds.items():
            for sig in (signal.SIGTERM, signal.SIGINT):
                codes, times, wrong = [], [], 0
                for i in range(trials):
                    run = tmp / f"{step}-{sig.name}-{i}"
                    overrides = base + [
                        f"flow.tracking_uri=sqlite:///{run}/mlruns.db",
                        f"paths.checkpoints={run}/ckpt",
                        f"paths.results={run}/results",
                    ]
                    run.mkdir()
                    code, seconds, left = trial(step, overrides, run / "mlruns.db", sig, run / "log.txt")
                    codes.append(code)
                    times.append(seconds)
                    wrong += code != 128 + sig or left
                statuses = ", ".join(f"{c}x{codes.count(c)}" for c in sorted(set(codes)))
                print(
                    f"| {step} | {sig.name} | {trials} | {statuses} | {statistics.median(times):.1f} | "
                    f"{max(times):.1f} | {wrong} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
