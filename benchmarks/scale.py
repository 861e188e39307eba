"""Scaling in clients: the cost of a round as the clients known (K) and the clients per round grow.

    python benchmarks/scale.py                       # K = 10, 100, 1,000: 10 and 100 a round; FedAvg and SCAFFOLD
    python benchmarks/scale.py --rows 1000:1000      # K:clients per round, as many as wanted
    python benchmarks/scale.py --rows 10000:100 --strategies scaffold --rounds 3 --resume

LeNet (118k parameters), 40 digits per client (windows of the embedded MNIST sample, shared between
clients past 125), one local epoch, checkpointing every round. Each row runs the plain loop (this
process, one torch thread: the reference weights), then the flow's round path (a Prefect task per
round, clients as Ray tasks, every round logged to MLflow) with Prefect and Ray already up and warm,
as a deployment runs it (``--pairs N``: N plain-then-flow pairs, the median ratio and its range). Printed
per row: seconds per round (rounds 2 on) of each and their ratio, the
bytes the checkpoint wrote per round and the seconds it took (plain loop), and how far the driver's
private memory rose above where it started (sampled every 50 ms). The flow must give the plain loop's
weights bit for bit, or the benchmark fails. ``--resume`` also runs the plain loop in a child
process, kills it (SIGKILL) once half the rounds are saved, wherever it then is, and resumes it
here: the weights must be the uninterrupted run's.

Targets: the flow's ratio at most 1.15 with 100 and 1,000 clients a round; the checkpoint's bytes and
seconds per round set by the clients trained that round, not by K; the driver's memory set by a few
model-sized sums, not by the clients per round (FedAvg; SCAFFOLD also keeps no client's variate in
memory between its rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcore.engine import ModelSpec, RoundConfig, RoundData, run_rounds  # noqa: E402

TARGET_RATIO = 1.15
SPEC = ModelSpec(name="lenet", in_channels=1, num_classes=10)
PER_CLIENT = 40


def workload(k: int) -> RoundData:
    """``k`` clients of 40 digits each: windows of one array (views, so K = 10,000 costs no copies)."""
    from fedcore.data.sources import load_mnist5k

    d = load_mnist5k()
    train_n = 4000
    starts = [(i * PER_CLIENT) % (train_n - PER_CLIENT) for i in range(k)]
    return RoundData(
        client_x=[d.x[s : s + PER_CLIENT] for s in starts],
        client_y=[d.y[s : s + PER_CLIENT] for s in starts],
        client_group=["mnist"] * k,
        eval_sets={"test": (d.x[train_n:], d.y[train_n:])},
    )


def config(strategy: str, k: int, per_round: int, rounds: int) -> RoundConfig:
    trainer = "scaffold" if strategy == "scaffold" else "sgd"
    return RoundConfig(
        rounds=rounds,
        trainer=trainer,
        trainer_params={"lr": 0.05, "local_epochs": 1, "batch_size": 20},
        strategy=strategy,
        participation=per_round / k,
        seed=0,
    )


class PeakRSS:
    """The highest private memory of this process while running, above where it was at the start.

    Private (anonymous) resident memory, not RSS: a driver that reads results from Ray's object
    store maps its shared pages, which RSS counts but which are the store's (bounded by its size,
    spilled to disk beyond), not the driver's.
    """

    def __enter__(self):
        with contextlib.suppress(OSError, AttributeError):  # hand freed heap back first: glibc keeps it resident
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.start = self.peak = self._private()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._private())

    @staticmethod
    def _private() -> int:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._private())

    @property
    def rise_mb(self) -> float:
        return (self.peak - self.start) / 2**20


class CheckpointMeter:
    """Bytes and seconds the round engine's checkpoint writes take, per round (the plain loop's)."""

    def __init__(self) -> None:
        import fedcore.engine.rounds as engine

        self.engine, self.save = engine, engine.save_state
        self.bytes, self.seconds = [0], [0.0]

        def timed(folder, payload, **kw):
            t0 = time.perf_counter()
            path = self.save(folder, payload, **kw)
            self.seconds[-1] += time.perf_counter() - t0
            self.bytes[-1] += path.stat().st_size
            return path

        engine.save_state = timed

    def next_round(self) -> None:
        self.bytes.append(0)
        self.seconds.append(0.0)

    def close(self) -> None:
        self.engine.save_state = self.save


def plain(data, cfg, folder: Path):
    torch.set_num_threads(1)
    marks, meter = [], CheckpointMeter()

    def on_round(rec, st):
        marks.append(time.perf_counter())
        meter.next_round()

    try:
        with PeakRSS() as mem:
            res = run_rounds(data, SPEC, cfg, checkpoint_dir=folder, on_round=on_round)
    finally:
        meter.close()
    written = meter.bytes[1:-1] or meter.bytes[:1]  # rounds 2 on, as the times
    seconds = meter.seconds[1:-1] or meter.seconds[:1]
    return res, float(np.mean(np.diff(marks))), float(np.mean(written)), float(np.mean(seconds)), mem.rise_mb


def flow(data, cfg, folder: Path, uri: str):
    import mlflow
    from prefect import flow as prefect_flow

    from flows.config.compose import ROOT
    from flows.runs.rounds import round_submit
    from flows.services import runtime, tracking

    runner = runtime.make_driver_runner(address=None, num_cpus=2, root=ROOT)

    @prefect_flow(name="bench-scale", task_runner=runner)
    def bench():
        tracking.setup(uri, "bench-scale")
        marks = []
        log = tracking.BackgroundRoundLog
        with mlflow.start_run(run_name=f"{cfg.strategy}-{len(data.client_x)}"):
            rounds_log = log()

            def on_round(rec, st):
                rounds_log(rec)
                marks.append(time.perf_counter())

            with PeakRSS() as mem:
                res = run_rounds(
                    data, SPEC, cfg, submit_round=round_submit(data), checkpoint_dir=folder, on_round=on_round
                )
            rounds_log.close()
        return res, float(np.mean(np.diff(marks))), mem.rise_mb

    return bench()


def killed(row: str, strategy: str, rounds: int, folder: Path) -> int:
    """Run the plain loop in a child process and SIGKILL it once half the rounds are saved.

    Returns the rounds its checkpoint held when the kill landed (the child may have been training
    the next round, or writing its checkpoint: either way a resume must continue exactly).
    """
    import signal
    import subprocess

    from fedcore.engine.checkpoint import CheckpointError, load_state

    half = max(1, rounds // 2)
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", row, strategy, str(rounds), str(folder)],
        stdout=subprocess.DEVNULL,
    )
    done = 0
    try:
        while done < half:
            ended = child.poll() is not None
            try:
                found = load_state(folder)
            except (CheckpointError, OSError):  # read while the child replaced it: look again
                found = None
            done = int(found.payload["done"]) if found is not None else done
            if ended and done < half:
                raise SystemExit(f"the run to be killed ended first (exit {child.returncode})")
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    found = load_state(folder)
    return int(found.payload["done"]) if found is not None else 0


def child(row: str, strategy: str, rounds: int, folder: str) -> int:
    k, per_round = (int(v) for v in row.split(":"))
    torch.set_num_threads(1)
    run_rounds(workload(k), SPEC, config(strategy, k, per_round, rounds), checkpoint_dir=folder)
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--child"]:  # the run --resume kills
        row, strategy, rounds, folder = sys.argv[2:6]
        return child(row, strategy, int(rounds), folder)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=["10:10", "100:10", "100:100", "1000:10", "1000:100"])
    ap.add_argument("--strategies", nargs="+", default=["fedavg", "scaffold"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--resume", action="store_true", help="also kill each plain run half-way and resume it")
    ap.add_argument("--plain-only", action="store_true", help="the plain loop alone (no services)")
    ap.add_argument(
        "--pairs", type=int, default=1, help="plain-then-flow pairs per row: the median ratio and its range"
    )
    args = ap.parse_args()
    import ray

    from flows.config.compose import ROOT
    from flows.services import runtime

    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    uri = f"sqlite:///{tmp}/mlruns.db"
    if not args.plain_only:
        url = runtime.ensure_prefect_api()
        with runtime.loopback_ray():
            ray.init(**runtime.ray_init_kwargs(num_cpus=2, prefect_api_url=url, root=ROOT))
    print(
        f"LeNet ({sum(p.numel() for p in SPEC.build().parameters()):,} parameters), {PER_CLIENT} digits a client, "
        f"{args.rounds} rounds; times are rounds 2-{args.rounds}\n"
    )
    print(
        "| K | clients/round | strategy | plain s/round | flow s/round | ratio | checkpoint MB/round | "
        "checkpoint s/round | driver +MB (plain, flow) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    failed = []
    try:
        if not args.plain_only:  # workers started and warm, as a deployment's are
            flow(workload(10), config("fedavg", 10, 10, 2), tmp / "warm", uri)
        for row in args.rows:
            k, per_round = (int(v) for v in row.split(":"))
            data = workload(k)
            for strategy in args.strategies:
                cfg = config(strategy, k, per_round, args.rounds)
                base, s_plain, written, ckpt_s, mem_plain = plain(data, cfg, tmp / f"plain-{k}-{per_round}-{strategy}")
                if args.resume:
                    folder = tmp / f"resume-{k}-{per_round}-{strategy}"
                    at = killed(row, strategy, args.rounds, folder)
                    again = run_rounds(data, SPEC, cfg, checkpoint_dir=folder, resume=True)
                    if not all(torch.equal(base.final_state[n], again.final_state[n]) for n in base.final_state):
                        failed.append(f"K={k}, {per_round} a round, {strategy}: resumed")
                    print(f"killed with {at} rounds saved; resumed", flush=True)
                if args.plain_only:
                    print(
                        f"| {k:,} | {per_round:,} | {strategy} | {s_plain:.3f} | - | - | "
                        f"{written / 2**20:.2f} | {ckpt_s:.3f} | {mem_plain:.0f}, - |",
                        flush=True,
                    )
                    continue
                s_plains, s_flows, mem_flow = [s_plain], [], 0.0
                for pair in range(args.pairs):
                    if pair:  # the plain loop again, just before its flow: the machine drifts between them
                        s_plains.append(plain(data, cfg, tmp / f"plain-{k}-{per_round}-{strategy}-{pair}")[1])
                    res, s_flow, mem = flow(data, cfg, tmp / f"flow-{k}-{per_round}-{strategy}-{pair}", uri)
                    s_flows.append(s_flow)
                    if not pair:  # the first flow's, as the plain loop's
                        mem_flow = mem
                    if not all(torch.equal(base.final_state[n], res.final_state[n]) for n in base.final_state):
                        failed.append(f"K={k}, {per_round} a round, {strategy}")
                ratios = [f / p for f, p in zip(s_flows, s_plains)]
                ratio = float(np.median(ratios))
                spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
                print(
                    f"| {k:,} | {per_round:,} | {strategy} | {np.median(s_plains):.3f} | {np.median(s_flows):.3f} | "
                    f"{ratio:.2f}{spread}"
                    f"{'' if per_round < 100 or ratio <= TARGET_RATIO else ' (over target)'} | "
                    f"{written / 2**20:.2f} | {ckpt_s:.3f} | {mem_plain:.0f}, {mem_flow:.0f} |",
                    flush=True,
                )
    finally:
        runtime.stop_ray()
        runtime.stop_prefect_api()
    if failed:
        print("FAIL: the flow's weights differ from the plain loop's: " + "; ".join(failed))
        return 1
    if not args.plain_only:
        print(f"\nThe flow gave the plain loop's weights bit for bit in every row (target ratio <= {TARGET_RATIO}).")
    if args.resume:
        print("Every plain run killed half-way and resumed gave the uninterrupted run's weights.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
