"""Orchestration overhead: the default sequential experiment, plain loop vs Prefect + Ray + MLflow.

    python benchmarks/overhead.py [hydra overrides...]
    python benchmarks/overhead.py --cifar     # the CIFAR-10-C variant (`dvc repro pretrain@cifar10` first)

Needs the default experiment's inputs (`make run` or `dvc repro pretrain@mnist`). Prints wall time
and peak resident memory (driver plus every Ray/Prefect process it spawned) of each, and the
ratios, for the flow started cold and with its services (Prefect server, Ray) already up.
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


class Stopwatch:
    """Wraps ``obj.name`` so that the seconds spent in it add up in ``self.seconds``."""

    def __init__(self, obj, name: str) -> None:
        self.seconds, self._obj, self._name, self._fn = 0.0, obj, name, getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return self._fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(obj, name, timed)

    def reset(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def main(overrides: list[str]) -> None:
    import ray

    from fedcore.engine import run_arrivals
    from flows import federation as F
    from flows import runtime

    cifar = "--cifar" in overrides
    variant = ["variant=cifar10"] if cifar else []
    cfg = C.compose(["flow.progress=false", "flow.experiment=benchmark-overhead", *variant]
                    + [o for o in overrides if o != "--cifar"])
    if cifar:
        cfg.flow.experiment = "benchmark-overhead-cifar10"
    partition, spec, source = F.load_inputs(cfg)
    acfg = C.arrival_config(cfg)
    A = len(acfg.schedule(len(partition.targets)))
    print(f"default experiment: {acfg.method}+{acfg.aggregator}, {A} arrivals on {cfg.data.name}, "
          f"flow.num_cpus={cfg.flow.num_cpus}")

    with PeakRSS() as mem:
        t0 = time.perf_counter()
        plain = run_arrivals(partition, spec, source, acfg)
        t_plain = time.perf_counter() - t0
    rows = [("plain fedcore loop", t_plain, mem.peak, None)]
    final_logging = Stopwatch(F, "_log_experiment")

    def flowed(label: str) -> None:
        with PeakRSS() as m:
            t = time.perf_counter()
            res = F.arrival(cfg)
            rows.append((label, time.perf_counter() - t, m.peak, final_logging.reset()))
        if res.summary != plain.summary:
            raise SystemExit(f"{label}: the flow's metrics differ from the plain loop's: {res.summary} != {plain.summary}")

    # 1. Nothing running: the flow starts a temporary Prefect server and a local Ray.
    flowed("flow, cold (starts Prefect + Ray)")
    runtime.stop_prefect_api()
    # 2. A Prefect server is up (a deployment's), Ray still starts with the flow.
    url = runtime.ensure_prefect_api()
    flowed("flow, Prefect server up")
    # 3. Prefect and Ray both up (a long-lived Ray, as `ray start` or an earlier flow leaves it):
    #    the first run warms the workers, the second is measured.
    ray.init(**runtime.ray_init_kwargs(num_cpus=int(cfg.flow.num_cpus), prefect_api_url=url, root=C.ROOT))
    flowed("flow, Prefect + Ray up, cold workers")
    flowed("flow, Prefect + Ray up, warm workers")
    ray.shutdown()
    runtime.stop_prefect_api()

    print(f"{'':40s}{'wall s':>9s}{'ratio':>8s}{'peak RSS MiB':>15s}{'RSS ratio':>11s}{'final log s':>13s}")
    for label, t, rss, fin in rows:
        print(f"{label:40s}{t:9.1f}{t / t_plain:8.2f}{rss / 2**20:15.0f}{rss / rows[0][2]:11.2f}"
              + (f"{fin:13.1f}" if fin is not None else ""))
    warm = rows[-1][1]
    print(f"target: wall ratio <= 1.3. Warmest: overhead {warm - t_plain:.1f} s, of which final MLflow logging "
          f"(plots, checkpoint, model registry) {rows[-1][3]:.1f} s; per arrival {(warm - t_plain - rows[-1][3]) / A:.3f} s")
    print("every flow run's metrics equal the plain loop's")


if __name__ == "__main__":
    main(sys.argv[1:])
