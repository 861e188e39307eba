"""Orchestration overhead: the default sequential experiment, plain loop vs Prefect + Ray + MLflow.

    python benchmarks/overhead.py [hydra overrides...]

Needs the default experiment's inputs (`make run` or `dvc repro pretrain`). Prints wall time
and peak resident memory (driver plus every Ray/Prefect process it spawned) of each, and the
ratios. The flow figure includes starting Ray and the temporary Prefect server.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows import config as C  # noqa: E402


class PeakRSS:
    """Samples the summed RSS of this process and all its descendants every 0.1 s."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(0.1)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def main(overrides: list[str]) -> None:
    from fedcore.engine import run_arrivals
    from flows import federation as F

    cfg = C.compose(["flow.progress=false", "flow.experiment=benchmark-overhead"] + overrides)
    partition, spec, source = F.load_inputs(cfg)
    acfg = C.arrival_config(cfg)
    A = len(acfg.schedule(len(partition.targets)))
    print(f"default experiment: {acfg.method}+{acfg.aggregator}, {A} arrivals on {cfg.data.name}")

    with PeakRSS() as mem:
        t0 = time.perf_counter()
        plain = run_arrivals(partition, spec, source, acfg)
        t_plain = time.perf_counter() - t0
    rss_plain = mem.peak

    from flows import runtime

    with PeakRSS() as mem:
        t0 = time.perf_counter()
        runtime.ensure_prefect_api()  # what a deployment with a running server does not pay
        t_server = time.perf_counter() - t0
        flowed = F.arrival(cfg)
        t_flow = time.perf_counter() - t0
    rss_flow = mem.peak
    with PeakRSS() as mem:  # again, with the Prefect server already up (Ray still starts afresh)
        t0 = time.perf_counter()
        F.arrival(cfg)
        t_warm = time.perf_counter() - t0
    runtime.stop_prefect_api()

    same = abs(plain.summary["final_avg_holdout_acc"] - flowed.summary["final_avg_holdout_acc"])
    print(f"{'':34s}{'wall s':>10s}{'peak RSS MiB':>15s}{'ratio':>8s}")
    print(f"{'plain fedcore loop':34s}{t_plain:10.1f}{rss_plain / 2**20:15.0f}{1:8.2f}")
    print(f"{'Prefect+Ray+MLflow, cold':34s}{t_flow:10.1f}{rss_flow / 2**20:15.0f}{t_flow / t_plain:8.2f}")
    print(f"{'  of which temp. Prefect server':34s}{t_server:10.1f}")
    print(f"{'Prefect+Ray+MLflow, server up':34s}{t_warm:10.1f}{mem.peak / 2**20:15.0f}{t_warm / t_plain:8.2f}")
    print(f"target: wall ratio <= 1.3. memory ratio (cold) {rss_flow / rss_plain:.2f}")
    print(f"overhead per arrival (server up): {(t_warm - t_plain) / A:.2f} s; "
          f"|final hold-out acc, flow - plain| = {same:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
