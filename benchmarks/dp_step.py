"""Cost of one private adaptation step against the plain step, per per-sample-gradient backend.

    python benchmarks/dp_step.py [--steps 20] [--batch 64] [--device cpu]

For each model (the default CNN on 28x28 greyscale, ResNet-20 on 32x32 colour, both with
GroupNorm) and each set of adapted parameters (norm affine only, as Tent; all), it times
Tent's whole step (predict, per-sample gradients, clip, step) in three forms:

* plain: the ordinary autograd step (the baseline, ratio 1.0);
* dp0 (the private form at sigma = 0) via Opacus: GradSampleModule hooks;
* dp0 via torch.func: vmap(grad(...)).

dp0 costs what DP costs, less the noise: one draw per parameter.

Timing: the three forms run in one process, interleaved (``--rounds`` rounds of ``--steps``
steps each, the median round per form), so that a busy machine slows them alike; the ratio
is to the plain step of the same round set. Memory: each form then runs alone in a fresh
process, so its peak (max RSS, or CUDA peak allocation) is its own.
Targets from the issue: DP/plain <= 1.5 with norm parameters, <= 2.5 with all.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {"cnn": (1, 28), "resnet20": (3, 32)}
FORMS = [("plain", None), ("dp0/opacus", "opacus"), ("dp0/torch.func", "functorch")]
TARGET = {"norm": 1.5, "all": 2.5}


def _build(model_name: str, which: str, backend: str | None, device: str):
    import torch

    from fedcore.adapt import create_method
    from fedcore.models import create_model
    from fedcore.privacy import PrivacySpec

    torch.manual_seed(0)
    cin, size = MODELS[model_name]
    dev = torch.device(device)
    model = create_model(model_name, in_channels=cin, num_classes=10, norm="group").to(dev)
    spec = None if backend is None else PrivacySpec(mode="dp0", clip_norm=1.0, backend=backend)
    method = create_method("tent", model, lr=0.01, adapt_params=which, privacy=spec)
    return method, torch.randn(64, cin, size, size, device=dev)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(model_name: str, which: str, batch: int, steps: int, rounds: int, device: str, out) -> None:
    import statistics

    built = {form: _build(model_name, which, backend, device) for form, backend in FORMS}
    for method, x in built.values():
        for _ in range(3):  # warm-up (first vmap traces, allocator growth)
            method(x[:batch])
    times = {form: [] for form in built}
    for _ in range(rounds):
        for form, (method, x) in built.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                method(x[:batch])
            _sync(device)
            times[form].append((time.perf_counter() - t0) / steps)
    out.put(
        {form: statistics.median(v) for form, v in times.items()}
        | {"n_params": sum(p.numel() for p in built["plain"][0].params.values())}
    )


def _memory(model_name: str, which: str, backend: str | None, batch: int, device: str, out) -> None:
    import torch

    method, x = _build(model_name, which, backend, device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for _ in range(5):
        method(x[:batch])
    _sync(device)
    out.put(
        torch.cuda.max_memory_allocated() / 2**20
        if device.startswith("cuda")
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )


def _child(target, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    res = q.get()
    p.join()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    rows = []
    print(
        f"one Tent step, batch {args.batch}, median of {args.rounds} interleaved rounds of {args.steps} steps, "
        f"device {args.device}"
    )
    print(f"{'model':9} {'params':6} {'form':16} {'ms/step':>8} {'ratio':>6} {'peak MiB':>9}  target")
    for m in args.models:
        for which in ("norm", "all"):
            t = _child(_time, m, which, args.batch, args.steps, args.rounds, args.device)
            base = t["plain"]
            for form, backend in FORMS:
                peak = _child(_memory, m, which, backend, args.batch, args.device)
                ratio = t[form] / base
                ok = "" if backend is None else ("ok" if ratio <= TARGET[which] else f"MISSED (<= {TARGET[which]})")
                print(f"{m:9} {which:6} {form:16} {t[form] * 1e3:8.2f} {ratio:6.2f} {peak:9.0f}  {ok}", flush=True)
                rows.append(
                    {
                        "model": m,
                        "params": which,
                        "form": form,
                        "n_params": t["n_params"],
                        "sec": t[form],
                        "ratio": ratio,
                        "peak_mib": peak,
                    }
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
