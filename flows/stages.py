"""Command line for the pipeline stages and flows.

    python -m flows.stages prepare|partition|pretrain|adapt [--params params.yaml] [overrides...]
    python -m flows.stages arrival method=tent aggregator=ugsa      # one experiment, Hydra overrides
    python -m flows.stages sweep 'sweep.methods=[bn,tent]' 'sweep.privacy=[plain,dp-eps5]'
    python -m flows.stages prepare variant=cifar10   # likewise partition, pretrain, adapt: CIFAR-10-C
    python -m flows.stages pretrain variant=private && python -m flows.stages adapt variant=private   # private-TTA grid
    python -m flows.stages audit variant=private     # canary membership audit of the private form
    python -m flows.stages stress bpfedctta.stress.cell=lr1e-1-p3 && python -m flows.stages stress_report
    python -m flows.stages stress_private dptta.stress.cell=lr1e-1-p3 && python -m flows.stages stress_private_report
    python -m flows.stages stress_cifar bpfedctta.stress_cifar.cell=lr1e-1-p1 && python -m flows.stages stress_cifar_report
    python -m flows.stages partition_domains fedpad.grid=digits && python -m flows.stages fedpad fedpad.grid=digits
    python -m flows.stages rounds trainer=proto strategy=fedpad     # one FedPAD run, a Prefect task per round
    python -m flows.stages partition_fedpd fedpd.grid=digits && python -m flows.stages fedpd fedpd.grid=digits
    python -m flows.stages rounds_fedpd trainer=proser strategy=fedpd   # one FedPD++ run, a Prefect task per round
    python -m flows.stages partition_ppfcil ppfcil.grid=mnist && python -m flows.stages ppfcil ppfcil.grid=mnist

With ``--params`` the stage reads the file DVC tracks; without it, conf/ is composed with the
overrides. Either way the selected ``variant`` (mnist, the default, cifar10 or private) is laid over the
config. ``adapt`` is the sweep over ``sweep.*`` that writes results/ for DVC.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from functools import partial
from typing import Any, Callable, Dict

from flows import systems
from flows.config import compose as C
from flows.runs import steps
from flows.services import signals


def stress(cfg, protocol: str = "bpfedctta") -> None:
    """A stress cell of ``protocol`` (``bpfedctta``, ``dptta``: the variant whose inputs it reads)."""
    from flows.runs.stress import run_cell

    print(f"figure -> {run_cell(cfg, protocol)}")


def stress_report(cfg, protocol: str = "bpfedctta") -> None:
    """The report of every cell that ran; for a protocol with an lr × passes grid, that grid at a glance."""
    from flows.runs import stress_grid
    from flows.runs.stress import report

    print(report(cfg, protocol))
    if protocol in stress_grid.PROTOCOLS:
        print(stress_grid.write(cfg, protocol))


ARRIVAL_STEPS = {
    "prepare": steps.prepare,
    "partition": steps.partition,
    "pretrain": steps.pretrain,
    "adapt": steps.adapt,
    "sweep": steps.adapt,
    "arrival": steps.arrival,
    "audit": steps.audit,
}


def _resolve(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def stage_system(step: str) -> str | None:
    """The system a step runs (its config block is the one checked), ``"arrivals"`` for the arrival
    pipeline's steps, ``None`` for a step no system declares."""
    if step in ARRIVAL_STEPS:
        return "arrivals"
    for system in systems.all_systems():
        own = (
            {str(system.partition_stage), system.name, f"rounds_{system.name}"} if system.engine == "rounds" else set()
        )
        if step in own or step in system.extra_steps:
            return system.name
    return None


def stage_steps() -> Dict[str, Callable[[Any], Any]]:
    """Every step of the command line: the arrival pipeline's (the selected variant's), and for each registered
    round-based system ``<partition_stage>``, ``<name>`` (its grid) and ``rounds_<name>`` (one run), plus what
    each system declares in ``extra_steps``."""
    out: Dict[str, Callable[[Any], Any]] = dict(ARRIVAL_STEPS)
    owner = {name: "the arrival pipeline" for name in out}

    def add(step: str, fn: Callable[[Any], Any], system: str) -> None:
        if step in out:
            raise ValueError(
                f"system {system!r} declares step {step!r}, which {owner[step]} already has; "
                "rename the system or the step"
            )
        out[step], owner[step] = fn, f"system {system!r}"

    for system in systems.all_systems():
        if system.engine == "rounds":
            add(str(system.partition_stage), partial(steps.partition_domains, system=system.name), system.name)
            add(system.name, partial(steps.run_grid, system=system.name), system.name)
            add(f"rounds_{system.name}", partial(steps.single_run, system=system.name), system.name)
        for step, (target, kwargs) in system.extra_steps.items():
            add(step, partial(_resolve(target), **kwargs), system.name)
    return out


def _load_named_plugins(argv) -> None:
    """Import the plug-ins that conf/config.yaml, a ``plugins=[...]`` override or the ``--params`` file name,
    before the command line is parsed, so that their steps are valid choices; a bad one is an error, with its
    name, and exit status 2 as every other error here."""
    import yaml

    args = list(argv)
    params = [a.split("=", 1)[1] for a in args if a.startswith("--params=")]
    params += [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--params"]
    try:
        systems.configured_plugins([a for a in args if not a.startswith("-")])
        for path in params:
            if os.path.isfile(path):
                systems.load_plugins((yaml.safe_load(open(path)) or {}).get("plugins") or [])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _prefect_warnings_only(record: logging.LogRecord) -> bool:
    """A terminal filter: Prefect's records at WARNING and above, everyone else's as they come."""
    return record.levelno >= logging.WARNING or not record.name.startswith("prefect")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flows.stages", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _load_named_plugins(argv if argv is not None else sys.argv[1:])  # a plug-in's steps are valid choices
    known = stage_steps()
    ap.add_argument("stage", choices=sorted(known))
    ap.add_argument("--params", default=None, help="read this params file (DVC) instead of composing conf/")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. method=tent adapt.passes=1")
    args = ap.parse_intermixed_args(argv)  # overrides may follow --params (as the DVC stages write them)
    terminal = logging.StreamHandler()
    terminal.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if "PREFECT_LOGGING_LEVEL" not in os.environ:
        # Flow and task logs go to the Prefect API at INFO (the UI's Logs tab, flows/services/runtime.py);
        # the terminal keeps showing Prefect's warnings only, not a line per task run.
        terminal.addFilter(_prefect_warnings_only)
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")  # Prefect's own handler, Ray workers
    logging.basicConfig(level=logging.INFO, handlers=[terminal])
    for noisy in ("httpx", "mlflow.store.db.utils", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from fedcore.engine.checkpoint import CheckpointError

    signals.install()
    try:
        cfg = C.load(args.params, args.overrides, system=stage_system(args.stage))  # that system's settings checked
        known[args.stage](cfg)
    except (ValueError, FileNotFoundError, CheckpointError, HydraException, OmegaConfBaseException) as exc:
        if not signals.STOP.is_set():
            print(f"error: {exc}", file=sys.stderr)
            return 2
        # the stop is the cause: an error it led to is not the one to report
    except BaseException:  # signals.Stopped, or Prefect's TerminationSignal, once a stop signal came
        if not signals.STOP.is_set():
            raise
    if signals.STOP.is_set():
        if "mlflow" in sys.modules:  # a run the stop unwound past, still open, ends failed
            from flows.services import tracking

            tracking.fail_active_runs()
        if "prefect" in sys.modules:
            signals.crash_task_runs_left()
        with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) or pipe: the stop stands without the line
            print(f"stopped by {signals.describe()}; resume with flow.resume=true", file=sys.stderr)
    return signals.exit_status()


if __name__ == "__main__":
    code = main()
    if signals.STOP.is_set():
        signals.exit_now(code)
    signals.finishing()
    sys.exit(code)
