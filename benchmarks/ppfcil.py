"""PP-FCIL's cost: one client's round against plain FedAvg on the same data, the compression step, the
private step, and the exemplar memory.

    python benchmarks/ppfcil.py              # the quick grid's data: 5,000 MNIST digits, 5 clients, 5 tasks
    python benchmarks/ppfcil.py --repeat 5

Every variant trains the same client (client 0) on its data of task 1 (its new digits plus the exemplars
of task 0, as in a real run), with one torch thread, in this process. Printed: the median seconds of a
round and its ratio to plain FedAvg (local SGD on a LeNet, the same epochs and batch size):

* ``fedavg``: the ``sgd`` trainer on a LeNet (118k parameters): the baseline;
* ``ppfcil, training round``: the dual model with L_C + L_D + L_S (two views);
* ``ppfcil, round with compression``: a task's last round, which trains as the others do and then distils
  the dual model into one branch (L_M) for as many epochs;
* ``ppfcil, LBDP round`` / ``classic DP round``: a first-task training round as DP-SGD (GroupNorm, rho = 0,
  Poisson rate 0.1), per-sample gradients with torch.func;
and the exemplar memory's bytes per client and in all, after the whole run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcore.engine import ModelSpec, RoundConfig, load_client_states, run_rounds  # noqa: E402
from fedcore.engine.rounds import train_step  # noqa: E402
from fedcore.engine.spec import init_state  # noqa: E402
from fedcore.incremental.evaluate import incremental_evaluate  # noqa: E402
from fedcore.incremental.exemplars import ExemplarMemory  # noqa: E402
from fedcore.incremental.schedule import incremental_view, make_schedule  # noqa: E402

TRAIN = {"lr": 0.05, "local_epochs": 2, "batch_size": 32, "momentum": 0.8, "weight_decay": 5e-4}


def workload():
    from fedcore.data.domains import build_domain_partition, load_domains

    ds = load_domains("digits_local", None, size=28, seed=0, domains=["mnist"])
    part = build_domain_partition(ds, clients_per_domain={"mnist": 1}, test_fraction=0.3, size_skew=0.0, seed=0)
    schedule = make_schedule(num_classes=10, tasks=5, seed=0)
    return incremental_view(
        part.client_x[0],
        part.client_y[0],
        part.test_x[0],
        part.test_y[0],
        schedule,
        num_clients=5,
        alpha=1.0,
        rounds_per_task=3,
        seed=0,
    )


def time_step(repeat: int, **kw) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        train_step(**kw)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = workload()
    dual = ModelSpec(name="dual-lenet", in_channels=3, num_classes=10)
    dual_gn = ModelSpec(name="dual-lenet", in_channels=3, num_classes=10, norm="group")
    # a real state at the start of task 1: run task 0 (3 rounds), keep client 0's memory
    cfg = RoundConfig(
        rounds=15,
        trainer="fcil",
        trainer_params={**TRAIN, "memory": 200, "per_class": 20},
        strategy="ppfcil",
        participation=0.6,
        seed=0,
    )
    states = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        full = run_rounds(
            data,
            dual,
            cfg,
            checkpoint_dir=tmp,
            evaluate=partial(
                incremental_evaluate, spec=dual, test=data.eval_sets["test"], task_classes=data.task_classes
            ),
            on_round=lambda rec, st: states.setdefault(rec["round"], st),
        )
        run_s = time.perf_counter() - t0
        clients = list(load_client_states(Path(tmp)).values())
    x, y = data.client_data(0, 3)  # task 1
    b = {
        "round": 3,
        "rounds": 15,
        "seed": 0,
        "participation": 0.6,
        "task": 1,
        "task_classes": data.task_classes,
        "rounds_per_task": 3,
    }
    # client 0's state after task 0 (its memory of task 0's classes): rerun its last task-0 round
    upd = train_step(
        global_state=states[1],
        spec=dual,
        x=data.client_data(0, 2)[0],
        y=data.client_data(0, 2)[1],
        trainer="fcil",
        trainer_params={**TRAIN},
        broadcast={**b, "round": 2, "task": 0},
        client_state={},
        seed=0,
    )
    cs = upd.client_state
    lenet = ModelSpec(name="lenet", in_channels=3, num_classes=10)
    mem = ExemplarMemory.from_state_dict(cs["memory"])
    mx, my = mem.data()
    xs, ys = np.concatenate([x, mx]), np.concatenate([y, my])
    common = dict(seed=1, device="cpu", client_state=cs)
    rows = [
        (
            "fedavg (sgd trainer, LeNet)",
            time_step(
                args.repeat,
                global_state=init_state(lenet, 0),
                spec=lenet,
                x=xs,
                y=ys,
                trainer="sgd",
                trainer_params=TRAIN,
                broadcast={},
                seed=1,
                client_state={},
            ),
        )
    ]
    rows.append(
        (
            "ppfcil, training round",
            time_step(
                args.repeat,
                global_state=states[2],
                spec=dual,
                x=x,
                y=y,
                trainer="fcil",
                trainer_params=TRAIN,
                broadcast=b,
                **common,
            ),
        )
    )
    rows.append(
        (
            "ppfcil, round with compression",
            time_step(
                args.repeat,
                global_state=states[4],
                spec=dual,
                x=x,
                y=y,
                trainer="fcil",
                trainer_params=TRAIN,
                broadcast={**b, "round": 5},
                **common,
            ),
        )
    )
    gn_state = init_state(dual_gn, 0)
    for name, form in (("ppfcil, LBDP round (task 0)", "lbdp"), ("ppfcil, classic DP round (task 0)", "dp")):
        rows.append(
            (
                name,
                time_step(
                    args.repeat,
                    global_state=gn_state,
                    spec=dual_gn,
                    x=x,
                    y=y,
                    trainer="fcil",
                    trainer_params={
                        **TRAIN,
                        "rho": 0.0,
                        "privacy": form,
                        "epsilon": 8.0,
                        "classifier_loss": "plain",
                        "exemplars": "random",
                    },
                    broadcast={**b, "round": 0, "task": 0},
                    seed=1,
                    device="cpu",
                    client_state={},
                ),
            )
        )
    base = rows[0][1]
    print(f"client 0, task 1: {len(y)} new samples + {len(my)} exemplars; one torch thread, median of {args.repeat}")
    print(f"{'variant':34s} {'s/round':>8s} {'x fedavg':>9s}")
    for name, sec in rows:
        print(f"{name:34s} {sec:8.3f} {sec / base:9.2f}")
    params = sum(v.numel() for k, v in full.final_state.items() if v.is_floating_point())
    single = sum(p.numel() for p in lenet.build().parameters())
    print(
        f"\nwhole run (15 rounds, 3 of 5 clients a round): {run_s:.1f} s; dual model state {params:,} numbers "
        f"({params * 4 / 2**20:.2f} MiB) against {single:,} for the LeNet"
    )
    sizes = [ExemplarMemory.from_state_dict(c["memory"]).nbytes for c in clients]
    print(
        f"exemplar memory after 5 tasks: {max(sizes) / 2**10:.0f} KiB per client at most "
        f"(capacity 200 samples of 28x28x3 uint8), {sum(sizes) / 2**20:.2f} MiB over 5 clients"
    )


if __name__ == "__main__":
    main()
