"""Round overhead: FedAvg, 10 clients x 5 rounds x 1 local epoch, plain loop vs Prefect + Ray + MLflow.

    python benchmarks/rounds.py            # the issue's workload: LeNet (118k parameters), 4,000 MNIST digits
    python benchmarks/rounds.py --repeat 2 --skip-naive
    python benchmarks/rounds.py --skip-naive --paired 20   # twenty pairs, each median tested against its target

Every variant runs the same ``fedcore.engine.run_rounds`` loop in this process. The flows run each
client step on one Ray CPU, so they must give bit-identical weights to the plain loop run with one
torch thread, or the benchmark fails; the timing baseline is the plain loop with every CPU. Printed per
variant: total wall (start-up included), the start-up alone (until the first round starts), the mean
time of rounds 2-5, and both as ratios to the plain loop. Three designs are compared:

1. a Prefect task per client on prefect-ray's RayTaskRunner, arrays shipped with every task (naive);
2. a Prefect task per client in a driver thread whose body runs the step on Ray, data put once;
3. a Prefect task per round whose clients run as Ray tasks, data put once: what the flows use
   (``flows.runs.rounds.round_submit``), started cold and with Prefect and Ray already up.
Every flow logs each round to MLflow (a nested run and the round's metrics) on a background thread,
as the real flows do.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paired import median_summary  # noqa: E402  (this folder; opacus installs a package named benchmarks)

from fedcore.engine import ModelSpec, RoundConfig, RoundData, run_now, run_rounds, train_step  # noqa: E402

TARGET_TOTAL, TARGET_ROUND = 1.3, 1.10  # warm, services up


def workload() -> tuple[RoundData, ModelSpec, RoundConfig]:
    from fedcore.data.sources import load_mnist5k

    d = load_mnist5k()
    idx = np.random.default_rng(0).permutation(len(d.y))
    train, test = idx[:4000], idx[4000:]
    parts = np.array_split(train, 10)
    data = RoundData(
        client_x=[d.x[p] for p in parts],
        client_y=[d.y[p] for p in parts],
        client_group=["mnist"] * 10,
        eval_sets={"test": (d.x[test], d.y[test])},
    )
    cfg = RoundConfig(
        rounds=5,
        trainer="sgd",
        trainer_params={"lr": 0.05, "local_epochs": 1, "batch_size": 32},
        strategy="fedavg",
        seed=0,
    )
    return data, ModelSpec(name="lenet", in_channels=1, num_classes=10), cfg


def timed_run(data, spec, cfg, **kw):
    marks = []
    t0 = time.perf_counter()
    res = run_rounds(data, spec, cfg, on_round=lambda rec, st: marks.append(time.perf_counter()), **kw)
    per_round = float(np.mean(np.diff(marks))) if len(marks) > 1 else float("nan")  # rounds 2..R
    return res, time.perf_counter() - t0, per_round


def run_flow(kind: str, data, spec, cfg, tracking_uri: str):
    """One flow run; returns (result, total s, start-up s, mean s of rounds 2-R).

    Start-up is everything before the first round starts: Ray and a Prefect server when they are
    not up yet, the flow run's creation, the MLflow run.
    """
    import mlflow
    from prefect import flow

    from flows.config.compose import ROOT
    from flows.runs.rounds import round_submit
    from flows.services import runtime, tracking

    t0 = time.perf_counter()
    if kind == "naive":
        runner = runtime.make_task_runner(address=None, num_cpus=2, root=ROOT)
    else:
        runner = runtime.make_driver_runner(address=None, num_cpus=2, root=ROOT)

    @flow(name=f"bench-rounds-{kind}", task_runner=runner)
    def bench():
        tracking.setup(tracking_uri, "bench-rounds")
        submit, submit_round = run_now, None
        if kind == "naive":

            def submit(fn, **kw):
                return naive_task().submit(**kw)
        elif kind == "client":
            submit = client_task_submit(data)
        else:
            submit_round = round_submit(data)
        with mlflow.start_run(run_name=kind):
            startup = time.perf_counter() - t0
            res, per_round = _run_logged(data, spec, cfg, submit, submit_round)
        return res, startup, per_round

    try:
        res, startup, per_round = bench()
    finally:
        runtime.shutdown_ray()
    return res, time.perf_counter() - t0, startup, per_round


def naive_task():
    """Design 1, kept here for comparison: a Prefect task that runs on a Ray worker, arrays in its arguments."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    return task(name="train-client-on-ray", cache_policy=NO_CACHE)(train_step)


def client_task_submit(data):
    """Design 2, kept here for comparison: a Prefect task per client in a driver thread, whose body runs the
    step on Ray; data put once."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    from flows.runs.worker import train_step_or_fail, unpack
    from flows.services import runtime

    @task(name="train-client", cache_policy=NO_CACHE)
    def client_task(**kw):
        return unpack(runtime.ray_call(train_step_or_fail, **kw))

    arrays, states = runtime.PutOnce(), runtime.PutOnce(keep=1)

    def submit(fn, **kw):
        i = kw["client_id"]
        kw.update(
            x=arrays((i, "x"), kw["x"]),
            y=arrays((i, "y"), kw["y"]),
            global_state=states(id(kw["global_state"]), kw["global_state"]),
        )
        return client_task.with_options(task_run_name=f"round-{kw['round_index']:03d}-client-{i:02d}").submit(**kw)

    return submit


def _run_logged(data, spec, cfg, submit, submit_round):
    """As ``flows.runs.rounds.single`` does it: each round logged (a nested run) on a background thread."""
    from flows.services import tracking

    marks = []
    log = tracking.BackgroundRoundLog()

    def on_round(rec, st):
        log(rec)
        marks.append(time.perf_counter())

    res = run_rounds(data, spec, cfg, submit=submit, submit_round=submit_round, on_round=on_round)
    log.close()
    return res, float(np.mean(np.diff(marks)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--skip-naive", action="store_true", help="leave out the naive design's row (about a minute)")
    ap.add_argument(
        "--paired",
        type=int,
        default=5,
        metavar="N",
        help="then time N back-to-back (plain loop, flow) pairs with Prefect and Ray up (0: skip)",
    )
    args = ap.parse_args()
    import ray

    from flows.config.compose import ROOT
    from flows.services import runtime

    data, spec, cfg = workload()
    print(
        f"workload: FedAvg, {len(data.client_x)} clients x {cfg.rounds} rounds x 1 epoch, "
        f"{sum(p.numel() for p in spec.build().parameters()):,} parameters, {sum(map(len, data.client_y))} images"
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench-rounds-"))
    uri = f"sqlite:///{tmp}/mlruns.db"
    rows = []
    variants = (
        ("naive", "naive", "1. a Prefect task per client on Ray (RayTaskRunner), cold", False),
        ("client", "client", "2. a driver-side Prefect task per client that calls Ray, Prefect + Ray up", True),
        ("lean", "round", "3. a Prefect task per round, clients as Ray tasks (the flows), cold", False),
        ("up", "round", "3. the same, Prefect + Ray up, warm workers", True),
    )
    for rep in range(args.repeat):
        torch.set_num_threads(1)
        base, wall1, per_round1 = timed_run(data, spec, cfg)
        torch.set_num_threads(2)
        _, wall, per_round = timed_run(data, spec, cfg)
        rows.append(("plain loop", rep, wall, 0.0, per_round))
        rows.append(("plain loop, 1 thread (the reference weights)", rep, wall1, 0.0, per_round1))
        for key, kind, label, up in variants:
            if args.skip_naive and key == "naive":
                continue
            if up:  # a long-lived Ray and Prefect server, as a deployment has; one run warms the workers
                url = runtime.ensure_prefect_api()
                with runtime.loopback_ray():
                    ray.init(**runtime.ray_init_kwargs(num_cpus=2, prefect_api_url=url, root=ROOT))
                run_flow(kind, data, spec, cfg, uri)
            res, wall_f, startup, per_round_f = run_flow(kind, data, spec, cfg, uri)
            if up:
                runtime.stop_ray()
            for k in base.final_state:
                if not torch.equal(base.final_state[k], res.final_state[k]):
                    print(f"FAIL: {label} gave different weights ({k})")
                    return 1
            rows.append((label, rep, wall_f, startup, per_round_f))
            runtime.stop_prefect_api()  # the next cold run starts its own
    print("\n| run | repeat | total s | start-up s | per round s (2-5) | total ratio | per-round ratio |")
    print("|---|---|---|---|---|---|---|")
    for label, rep, wall, startup, per_round in rows:
        b = next(r for r in rows if r[0] == "plain loop" and r[1] == rep)
        print(
            f"| {label} | {rep} | {wall:.1f} | {startup:.1f} | {per_round:.2f} | {wall / b[2]:.2f} | "
            f"{per_round / b[4]:.2f} |"
        )
    if args.paired:
        # This machine's speed drifts by 20-40% over minutes, more than the effect measured: so the
        # deployment case is also timed as pairs (plain loop, then the flow, back to back) and each
        # pair gives one ratio.
        url = runtime.ensure_prefect_api()
        with runtime.loopback_ray():
            ray.init(**runtime.ray_init_kwargs(num_cpus=2, prefect_api_url=url, root=ROOT))
        run_flow("round", data, spec, cfg, uri)
        pairs = []
        for _ in range(args.paired):
            _, wall, per_round = timed_run(data, spec, cfg)
            _, wall_f, _, per_round_f = run_flow("round", data, spec, cfg, uri)
            pairs.append((wall_f / wall, per_round_f / per_round))
        runtime.stop_ray()
        runtime.stop_prefect_api()
        print(
            f"\npaired (Prefect + Ray up, warm workers; plain loop then flow, {args.paired} pairs): total ratio "
            + ", ".join(f"{t:.2f}" for t, _ in pairs)
            + f" (median {np.median([t for t, _ in pairs]):.2f}); "
            "per-round ratio "
            + ", ".join(f"{r:.2f}" for _, r in pairs)
            + f" (median {np.median([r for _, r in pairs]):.2f})"
        )
        print(f"total: {median_summary([t for t, _ in pairs], TARGET_TOTAL)}")
        print(f"per round: {median_summary([r for _, r in pairs], TARGET_ROUND)}")
    print("\nAll flow runs gave bit-identical weights to the one-thread plain loop.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
