"""Orchestration overhead: the default sequential experiment, plain loop vs Prefect + Ray + MLflow.

    python benchmarks/overhead.py [hydra overrides...]
    python benchmarks/overhead.py --cifar     # the CIFAR-10-C variant (`dvc repro pretrain@cifar10` first)
    python benchmarks/overhead.py --pairs=20  # more back-to-back triples (default 5) for a tighter median
    python benchmarks/overhead.py --cold=8    # only the cold flow, once in each of 8 fresh processes

Needs the default experiment's inputs (`make run` or `dvc repro pretrain@mnist`). Prints wall time
and peak resident memory (driver plus every Ray/Prefect process it spawned) of each, and the
ratios, for the flow started cold and with its services (Prefect server, Ray) already up; the CPU
time a cold start costs, summed over the processes; every fixed cost (the services' start-up, the
worker's start and imports, the first arrival's one-off costs, the teardown: Ray's shutdown) in seconds, and
each flow's ratio without it; and back-to-back triples with the services up,
each timing the plain loop, the flow as it is, and the flow with its MLflow calls stubbed out (the
orchestration and the files it writes: Prefect, Ray, checkpoints, plots), so that the costs are told
apart.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paired import median_summary  # noqa: E402  (this folder; opacus installs a package named benchmarks)

from flows.config import compose as C  # noqa: E402


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


def cpu_times() -> dict:
    """CPU time (user + system, reaped children's included) of this process and every live process it
    spawned (Ray's, Prefect's), by pid."""
    me, out = psutil.Process(), {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return out


def cpu_spent(before: dict) -> float:
    """CPU-s spent since ``before`` (:func:`cpu_times`) by the processes alive now; one that ended in
    between is not counted, so this is a lower bound."""
    return sum(max(0.0, t - before.get(pid, 0.0)) for pid, t in cpu_times().items())


@contextlib.contextmanager
def without_mlflow(F, tracking, model_registry):
    """The arrival flow with every MLflow call stubbed out, and nothing else: no tracking set-up, no run,
    no per-arrival records, no logged metrics, files or model, no registration. The plots, tables and
    checkpoints are still written."""
    import mlflow

    patches = [
        (F, "_start_experiment_run", lambda *a, **kw: contextlib.nullcontext()),
        (tracking, "setup", lambda *a, **kw: None),
        (tracking, "log_arrival", lambda *a, **kw: None),
        (tracking, "log_arrival_series", lambda *a, **kw: None),
        (tracking, "log_arrival_series_batch", lambda *a, **kw: None),
        (tracking, "log_arrival_run", lambda *a, **kw: None),
        (tracking, "log_files", lambda *a, **kw: None),
        (tracking, "log_model", lambda *a, **kw: "models:/x"),
        (mlflow, "log_metrics", lambda *a, **kw: None),
        (model_registry, "model_name", lambda cfg: None),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, stub in patches:
        setattr(obj, name, stub)
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


class Stopwatch:
    """Wraps ``obj.name`` so that the seconds spent in it add up in ``self.seconds``; ``self.ended``: when the
    last call returned (``time.perf_counter``)."""

    def __init__(self, obj, name: str) -> None:
        self.seconds, self.ended, self._obj, self._name, self._fn = 0.0, 0.0, obj, name, getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return self._fn(*a, **kw)
            finally:
                self.ended = time.perf_counter()
                self.seconds += self.ended - t0

        setattr(obj, name, timed)

    def reset(self) -> float:
        s, self.seconds, self.ended = self.seconds, 0.0, 0.0
        return s


PAIRS = 5
TARGET_WARM = 1.15
TARGET_COLD = 1.6
COLD_ONCE = "--cold-once"  # internal: one cold flow in this process, its figures as a JSON line after COLD_LINE
COLD_LINE = "cold-run-figures: "


def cold_runs(n: int, overrides: list[str]) -> None:
    """``n`` cold flows, each in a fresh process that starts its own Prefect server and Ray, as a nightly
    run on an idle machine would; a process gives one cold flow, so the cold row of one run is one sample."""
    import json
    import subprocess

    runs = []
    for i in range(n):
        try:
            proc = subprocess.run(
                [sys.executable, __file__, COLD_ONCE, *overrides], capture_output=True, text=True, timeout=900
            )
        except subprocess.TimeoutExpired as exc:
            raise SystemExit(
                f"cold run {i + 1} took longer than 900 s:\n{exc.stdout or ''}\n{exc.stderr or ''}"
            ) from None
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(COLD_LINE)]
        if proc.returncode != 0 or not lines:
            raise SystemExit(
                f"cold run {i + 1} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        run = json.loads(lines[-1][len(COLD_LINE) :])
        runs.append(run)
        print(
            f"cold run {i + 1}/{n}: plain loop {run['plain']:.1f} s, flow {run['wall']:.1f} s, ratio "
            f"{run['wall'] / run['plain']:.2f}; start-up {run['start']:.1f} s, fixed before the first arrival "
            f"{run['fixed_before']:.1f} s, teardown {run['teardown']:.1f} s, final logging {run['final']:.1f} s; "
            f"every fixed cost out {(run['wall'] - run['fixed_before'] - run['teardown']) / run['plain']:.2f}",
            flush=True,
        )
    ratio = [r["wall"] / r["plain"] for r in runs]
    after_start = [(r["wall"] - r["start"]) / r["plain"] for r in runs]
    after_first = [(r["wall"] - r["fixed_before"]) / r["plain"] for r in runs]
    after_fixed = [(r["wall"] - r["fixed_before"] - r["teardown"]) / r["plain"] for r in runs]
    print(f"cold, as it is: {median_summary(ratio, TARGET_COLD)}")
    print(f"cold, start-up taken out: {median_summary(after_start, TARGET_COLD)}")
    print(f"cold, the fixed costs before the first arrival taken out: {median_summary(after_first, TARGET_COLD)}")
    print(f"cold, every fixed cost taken out (the teardown included): {median_summary(after_fixed, TARGET_COLD)}")
    cols = {k: ", ".join(f"{r[k]:.1f}" for r in runs) for k in ("start", "fixed_before", "teardown")}
    print(
        f"start-up s: {cols['start']}; fixed before the first arrival s (until its state reaches the driver, less "
        f"one plain arrival): {cols['fixed_before']}; teardown s: {cols['teardown']}"
    )


def main(overrides: list[str]) -> None:
    cifar = "--cifar" in overrides
    given = next((o.split("=", 1)[1] for o in overrides if o.startswith("--pairs=")), str(PAIRS))
    if not given.isdigit():
        raise SystemExit(f"--pairs takes a whole number of back-to-back triples, e.g. --pairs=20 (got {given!r})")
    n_pairs = int(given)
    cold = next((o.split("=", 1)[1] for o in overrides if o.startswith("--cold=")), None)
    if cold is not None:  # the processes that run the flows import what they need; this one only waits
        if not cold.isdigit() or int(cold) < 1:
            raise SystemExit(f"--cold takes a number of fresh processes, e.g. --cold=8 (got {cold!r})")
        return cold_runs(int(cold), [o for o in overrides if not o.startswith(("--cold=", "--pairs="))])
    once = COLD_ONCE in overrides

    import ray

    from fedcore.engine import run_arrivals
    from flows.runs import federation as F
    from flows.services import model_registry, runtime, tracking

    variant = ["variant=cifar10"] if cifar else []
    # the cifar10 variant sets flow.experiment itself (an override of it would be refused), so it is set after
    cfg = C.compose(
        ["flow.progress=false", *variant]
        + [o for o in overrides if o not in ("--cifar", COLD_ONCE) and not o.startswith("--pairs=")]
    )
    cfg.flow.experiment = "benchmark-overhead-cifar10" if cifar else "benchmark-overhead"
    partition, spec, source = F.load_inputs(cfg)
    acfg = C.arrival_config(cfg)
    A = len(acfg.schedule(len(partition.targets)))
    print(
        f"default experiment: {acfg.method}+{acfg.aggregator}, {A} arrivals on {cfg.data.name}, "
        f"flow.num_cpus={cfg.flow.num_cpus}"
    )

    run_arrivals(partition, spec, source, acfg)  # warm-up: the first run in a process pays one-off costs
    plain_walls = []
    for _ in range(2):
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            plain = run_arrivals(partition, spec, source, acfg)
            plain_walls.append(time.perf_counter() - t0)
    t_plain = float(np.mean(plain_walls))
    print(
        f"plain loop: {' / '.join(f'{w:.1f}' for w in plain_walls)} s after one warm-up run; the baseline is their mean"
    )
    rows = [("plain fedcore loop", t_plain, mem.peak, None, None, None, None, None)]
    final_logging = Stopwatch(F, "_log_experiment")
    started: list = []
    started_cpu: dict = {}
    real_start = F.ArrivalPasses.start

    def marked_start(self):  # start-up ends when the flow, its services up, starts its arrivals' stream
        if not started:
            started.append((time.perf_counter(), cpu_spent(started_cpu)))
        return real_start(self)

    F.ArrivalPasses.start = marked_start
    received: list = []
    real_accept = F.ArrivalPasses._accept

    def marked_accept(self, st):  # the first arrival's state reaches the driver: the worker has started too
        received.append(time.perf_counter())
        return real_accept(self, st)

    F.ArrivalPasses._accept = marked_accept

    def same(label: str, res) -> None:
        if res.summary != plain.summary:
            raise SystemExit(
                f"{label}: the flow's metrics differ from the plain loop's: {res.summary} != {plain.summary}"
            )

    def flowed(label: str) -> None:
        started.clear()
        received.clear()
        with PeakRSS() as m:
            started_cpu.clear()
            started_cpu.update(cpu_times())
            t = time.perf_counter()
            res = F.arrival(cfg)
            end = time.perf_counter()
            teardown = end - final_logging.ended  # read before reset() clears it
            rows.append(
                (
                    label,
                    end - t,
                    m.peak,
                    final_logging.reset(),
                    started[0][0] - t,
                    started[0][1],
                    received[0] - t,
                    teardown,
                )
            )
        same(label, res)

    # 1. Nothing running: the flow starts a temporary Prefect server and a local Ray.
    flowed("flow, cold (starts Prefect + Ray)")
    runtime.stop_prefect_api()
    if once:
        import json

        _, wall, _, fin, start, _, first, teardown = rows[-1]
        print(
            COLD_LINE
            + json.dumps(
                {
                    "plain": t_plain,
                    "wall": wall,
                    "start": start,
                    "fixed_before": first - t_plain / A,
                    "teardown": teardown,
                    "final": fin,
                }
            )
        )
        return
    # 2. A Prefect server is up (a deployment's), Ray still starts with the flow.
    url = runtime.ensure_prefect_api()
    flowed("flow, Prefect server up")
    # 3. Prefect and Ray both up (a long-lived Ray, as `ray start` or an earlier flow leaves it):
    #    the first run warms the workers, the second is measured.
    with runtime.loopback_ray():
        ray.init(**runtime.ray_init_kwargs(num_cpus=int(cfg.flow.num_cpus), prefect_api_url=url, root=C.ROOT))
    flowed("flow, Prefect + Ray up, cold workers")
    flowed("flow, Prefect + Ray up, warm workers")
    # This machine's speed drifts by 20-40% over minutes, as much as the effect measured: time the
    # deployment case (services up, warm workers) also as back-to-back pairs, one ratio per pair.
    F.ArrivalPasses.start, F.ArrivalPasses._accept = real_start, real_accept
    pairs, bare = [], []
    for i in range(n_pairs):
        t0 = time.perf_counter()
        run_arrivals(partition, spec, source, acfg)
        base = time.perf_counter() - t0
        for with_mlflow in (True, False) if i % 2 == 0 else (False, True):  # alternate which runs nearer the loop
            with contextlib.nullcontext() if with_mlflow else without_mlflow(F, tracking, model_registry):
                t0 = time.perf_counter()
                same("paired flow", F.arrival(cfg))
                (pairs if with_mlflow else bare).append((time.perf_counter() - t0) / base)
            final_logging.reset()
    runtime.stop_ray()
    runtime.stop_prefect_api()

    print(
        f"{'':40s}{'wall s':>9s}{'ratio':>8s}{'start-up s':>12s}{'after it':>10s}{'CPU-s':>8s}"
        f"{'teardown s':>12s}{'all fixed s':>13s}{'after it':>10s}{'final log s':>13s}{'per arrival s':>15s}"
        f"{'peak RSS MiB':>15s}{'RSS ratio':>11s}"
    )
    for label, t, rss, fin, start, start_cpu, first, teardown in rows:
        if fin is None:
            extra = f"{'':12s}{'':10s}{'':8s}{'':12s}{'':13s}{'':10s}{'':13s}{'':15s}"
        else:
            fixed = first - t_plain / A + teardown
            extra = (
                f"{start:12.1f}{(t - start) / t_plain:10.2f}{start_cpu:8.1f}{teardown:12.1f}{fixed:13.1f}"
                f"{(t - fixed) / t_plain:10.2f}{fin:13.1f}{(t - start - fin - teardown - t_plain) / A:15.3f}"
            )
        print(f"{label:40s}{t:9.1f}{t / t_plain:8.2f}{extra}{rss / 2**20:15.0f}{rss / rows[0][2]:11.2f}")
    print(
        "start-up s: until the flow, its services up, starts its arrivals' stream; after it: the ratio with it taken out"
    )
    print(
        "teardown s: from the end of the final logging to the flow's return: almost all of it Ray's shutdown when "
        "the flow started Ray; the end of the MLflow and Prefect runs"
    )
    print(
        f"all fixed s: until the first arrival's state reaches the driver, less one plain arrival ({t_plain / A:.2f} s), "
        "plus the teardown: the services' start-up, the worker's start and imports, its first arrival's one-off costs "
        "and the teardown (these do not grow with the workload); after it: the ratio with them taken out"
    )
    print(
        "per arrival s: the flow's wall time over the plain loop's, start-up, final logging and teardown excluded, "
        "per arrival"
    )
    print(
        "CPU-s: the CPU time the processes (this one, Prefect's, Ray's) spent until the flow started its "
        f"arrivals' stream (a lower bound: one that ended before is not counted); on {psutil.cpu_count()} cores "
        f"it takes at least CPU-s / {psutil.cpu_count()} of wall, however the start-up overlaps"
    )
    if pairs:
        print(
            f"paired (Prefect + Ray up, warm workers; plain loop, then the flow and the flow without MLflow, "
            f"in turn first; "
            f"{len(pairs)} triples): wall ratio "
            + ", ".join(f"{r:.2f}" for r in pairs)
            + f" (median {np.median(pairs):.2f}); without MLflow "
            + ", ".join(f"{r:.2f}" for r in bare)
            + f" (median {np.median(bare):.2f})"
        )
        print(f"the flow: {median_summary(pairs, TARGET_WARM)}")
        print(f"without MLflow: {median_summary(bare, TARGET_WARM)}")
    print(f"targets: warm (Prefect + Ray up, warm workers) <= {TARGET_WARM}; cold <= {TARGET_COLD}")
    print("every flow run's metrics equal the plain loop's")


if __name__ == "__main__":
    main(sys.argv[1:])
