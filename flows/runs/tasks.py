"""The Prefect tasks that run on Ray workers, and the paths and inputs they share with the flows.

Kept apart from ``flows.runs.federation`` so that a Ray worker unpickling a task imports only
Prefect, torch and fedcore: no MLflow, no matplotlib (about 2 s less per fresh worker). What
plain Ray tasks run (a block of arrivals, a round's client step) is lighter still: ``flows.runs.worker``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Tuple

import torch
from omegaconf import DictConfig
from prefect import task
from prefect.cache_policies import NO_CACHE

from fedcore.adapt import GRADIENT_METHODS
from fedcore.data import Partition
from fedcore.engine import ArrivalConfig, ModelSpec, RoundConfig, run_arrivals, run_rounds
from fedcore.tensors import to_tensor
from fedcore.types import ClientUpdate
from flows import systems
from flows.config import compose as C
from flows.reports.evaluations import round_inputs
from flows.runs.worker import train_step_or_fail, unpack, update_summary
from flows.services import integrity, runtime

# ------------------------------------------------------------------------------------ tasks


RERUN_WARNING = "client step re-run by Ray after its worker died: attempt %d"


def run_label(method: str, aggregator: str, form: str | None, seed: int) -> str:
    """An arrival run's name in the Prefect UI: ``<method>+<aggregator>[-<form>]-s<seed>`` (plain: no form)."""
    return f"{method}+{aggregator}{'' if form in (None, 'plain') else f'-{form}'}-s{seed}"


@task(name="run-cell", cache_policy=NO_CACHE)
def run_cell_task(
    cfg_dict: Dict[str, Any], acfg: ArrivalConfig, written: Mapping[str, str] | None = None
) -> Dict[str, Any]:
    """One whole sweep cell, in one worker: the plain driver over the fedcore steps.

    ``acfg``: the cell's settings as the flow built them; ``cfg_dict``: the resolved config, for the inputs,
    the paths and the flow settings. ``written``: md5s of inputs the calling flow wrote itself
    (:func:`flows.services.integrity.record`).
    """
    cfg = C.from_run(cfg_dict)  # with its plug-ins' methods and aggregators, in this worker too
    where = _placed(cfg)
    partition, spec, source = load_inputs(cfg, written=written)
    ckpt = ckpt_dir(cfg, cell_name(acfg))
    before = _stamps(ckpt)
    t0, started_ms = time.perf_counter(), int(time.time() * 1000)
    res = run_arrivals(
        partition, spec, source, acfg, checkpoint_dir=ckpt, resume=bool(cfg.flow.resume), stop_after=cfg.flow.stop_after
    )
    return {
        "method": acfg.method,
        "aggregator": acfg.aggregator,
        "seed": acfg.seed,
        "form": acfg.form,
        "result": res,
        "seconds": time.perf_counter() - t0,
        "started_ms": started_ms,
        "ended_ms": int(time.time() * 1000),
        "placement": where,
        # resumed from a checkpoint that already held every arrival: none ran, none was saved
        "already_finished": bool(cfg.flow.resume) and bool(before) and _stamps(ckpt) == before,
    }


CLIENT_LINES = 32  # rounds with up to this many clients log each client's end; larger ones, each tenth


@dataclass
class RoundProgress:
    """How far a round's results have been taken, kept across the round task's retries.

    A result taken is final: a retry reruns only the clients not yet taken (same seeds and inputs,
    so the same updates), and never hands the engine one it already folded in.
    """

    taken: int = 0
    broken: BaseException | None = None  # the engine's own error while taking: not retried


@task(name="train-round", cache_policy=NO_CACHE)
def train_round_task(
    *,
    calls: List[Dict[str, Any]],
    names: List[str],
    take: Callable[[int, ClientUpdate], None],
    progress: RoundProgress,
    num_gpus: float = 0.0,
    markers: Mapping[int, Mapping[str, str]] | None = None,
    threads: int = 1,
) -> None:
    """One round's client steps: a Prefect task in the driver that runs each client's step as a Ray task.

    ``take(j, update)`` is called once per call, in call order, as soon as that client and every
    one before it have finished, while the rest still train: the engine folds each update into the
    round's aggregate, and a client that finished early waits in Ray's object store, not in the driver.

    The clients train in parallel on the Ray workers; each one's completion is logged in a round of up
    to :data:`CLIENT_LINES` clients, each tenth of a larger round (the Prefect UI shows the round's progress). A client whose worker dies is rerun by Ray,
    and a warning on this task run says so;
    a client step that raises fails the round task once the round's other steps have finished (they
    are not cancelled: see ``runtime.ray_settle``), and a Prefect retry reruns the clients not yet
    taken (``progress``). An interrupt cancels them.
    Array and state arguments may be Ray ObjectRefs (put once, resolved by Ray on the worker).
    ``markers``: injected faults by call index (tests). ``threads``: CPUs (and torch threads) per
    client step: 1, except for a run with a single client (the CIFAR variant's source pretraining).
    """
    import ray
    from prefect import get_run_logger

    from flows.services import runtime

    if progress.broken is not None:  # taking failed in an earlier attempt: rerunning the clients cannot help
        raise progress.broken
    logger = get_run_logger()
    todo = range(progress.taken, len(calls))
    started = {
        j: runtime.ray_start_kept(
            train_step_or_fail,
            summary=update_summary,
            num_cpus=threads,
            num_gpus=num_gpus,
            threads=threads,
            **dict((markers or {}).get(j, {})),
            **calls[j],
        )
        for j in todo
    }
    refs = [started[j][0] for j in todo]
    ready: Dict[int, Any] = {}  # finished, not yet taken: the update's ObjectRef

    def rerun(n: int, attempt: int) -> None:  # Prefect sees one attempt that completed: say so here
        logger.warning("%s: " + RERUN_WARNING, names[todo[n]], attempt)

    # a line per client for a round of a few; beyond, one per tenth of the round (a line per client at 1,000
    # a round cost the driver its console formatting and locked the Prefect server's database with logs)
    every = 1 if len(calls) <= CLIENT_LINES else -(-len(calls) // 10)
    try:
        for done, (n, (examples, loss)) in enumerate(
            runtime.ray_as_completed(refs, on_rerun=rerun), progress.taken + 1
        ):
            j = todo[n]
            if every == 1:
                logger.info("%s done (%d/%d): %d examples, train loss %.4f", names[j], done, len(calls), examples, loss)
            elif done % every == 0 or done == len(calls):
                logger.info("%d of %d clients done (last: %s)", done, len(calls), names[j])
            ready[j] = started.pop(j)[1]
            while progress.taken in ready:
                update = unpack(ray.get(ready.pop(progress.taken)))
                try:
                    take(progress.taken, update)
                except Exception as exc:
                    progress.broken = exc
                    raise
                del update
                progress.taken += 1
    except Exception:
        runtime.ray_settle(refs)
        raise
    except BaseException:  # an interrupt: stop now
        runtime.ray_cancel(refs)
        raise


@task(name="round-cell", cache_policy=NO_CACHE)
def run_round_cell_task(
    cfg_dict: Dict[str, Any],
    system: str,
    grid_name: str,
    method: str,
    rcfg: RoundConfig,
    written: Mapping[str, str] | None = None,
) -> Dict[str, Any]:
    """One whole cell of a round-based grid, in one worker: the plain round driver.

    ``rcfg``: the cell's settings as the flow built them (``method`` is its name in the grid; the seed is
    ``rcfg.seed``); ``cfg_dict``: the resolved config, for the partition, the paths and the flow settings."""
    torch.set_num_threads(1)  # cells run side by side, one per CPU
    cfg = C.from_run(cfg_dict)  # with its plug-ins' systems, strategies and trainers, in this worker too
    where = _placed(cfg)
    seed = rcfg.seed
    part = load_domain_partition(cfg, system, grid_name, written=written)
    data, spec, evaluate = round_inputs(cfg, system, grid_name, part, rcfg, method=method)
    ckpt = round_cell_dir(cfg, system, grid_name, method, seed)
    before = _stamps(ckpt)
    t0, started_ms = time.perf_counter(), int(time.time() * 1000)
    res = run_rounds(
        data,
        spec,
        rcfg,
        evaluate=evaluate,
        checkpoint_dir=ckpt,
        resume=bool(cfg.flow.resume),
        stop_after=cfg.flow.stop_after,
    )
    return {
        "method": method,
        "seed": seed,
        "result": res,
        "seconds": time.perf_counter() - t0,
        "started_ms": started_ms,
        "ended_ms": int(time.time() * 1000),
        "spec": spec,
        "example": to_tensor(data.client_x[0][:2]).numpy(),  # the registered model's signature
        "placement": where,
        # resumed from a checkpoint that already held every round: no round ran, none was saved
        "already_finished": bool(cfg.flow.resume) and bool(before) and _stamps(ckpt) == before,
    }


def _placed(cfg: DictConfig) -> Dict[str, str]:
    """Where this cell runs (tags for its MLflow run); a GPU that torch cannot use is said in the task's log."""
    from prefect import get_run_logger

    where = runtime.placement()
    note = runtime.cpu_fallback_note(cfg.device, where)
    if note:
        get_run_logger().warning(note)
    return where


def _stamps(folder: Path) -> Dict[str, int]:
    """The files of a checkpoint folder with their modification times (every saved round rewrites them)."""
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} if folder.is_dir() else {}


# ------------------------------------------------------------------------------------ helpers


def load_domain_partition(
    cfg: DictConfig, system: str, grid_name: str | None = None, *, written: Mapping[str, str] | None = None
):
    """The grid's domain-silo partition; missing -> the DVC stage that builds it; changed since -> refused."""
    from fedcore.data.domains import DomainPartition

    name = str(cfg[system].grid if grid_name is None else grid_name)
    folder = C.domains_dir(cfg, system, name)
    integrity.verify(folder, written=written)
    stage = systems.get(system).partition_stage
    build = f"`dvc repro {stage}@{name}` (or `python -m flows.stages {stage} {system}.grid={name}`)"
    try:
        return DomainPartition.load(folder, build=build)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no {system} partition for grid {name!r} at {folder}. Build it with {build}."
        ) from None


def source_model_path(cfg: DictConfig) -> Path:
    return C.resolve_path(cfg.paths.models) / f"source-{cfg.data.name}-{cfg.model.name}-{cfg.model.norm}.pt"


def partition_dir(cfg: DictConfig) -> Path:
    return C.resolve_path(cfg.paths.partitions) / cfg.data.name


def prepared_path(cfg: DictConfig) -> Path:
    return C.resolve_path(cfg.paths.prepared) / f"{cfg.data.name}.npz"


def cell_name(acfg) -> str:
    """method-aggregator[-form]-s<seed>; the plain form keeps the short name."""
    form = "" if acfg.form == "plain" else f"-{acfg.form}"
    return f"{acfg.method}-{acfg.aggregator}{form}-s{acfg.seed}"


def ckpt_dir(cfg: DictConfig, cell: str) -> Path:
    return C.resolve_path(cfg.paths.checkpoints) / f"{cfg.data.name}-{cfg.model.name}-{cfg.model.norm}" / cell


def round_cell_dir(cfg: DictConfig, system: str, grid_name: str, method: str, seed: int) -> Path:
    """A round-based grid cell's checkpoint folder."""
    return C.resolve_path(cfg.paths.checkpoints) / system / grid_name / f"{method}-s{seed}"


def sweep_cells(cfg: DictConfig) -> List[Tuple[str, str, str, int]]:
    """The sweep's (method, aggregator, privacy form, seed) cells, in the order they are submitted.

    A method without gradients (source, bn) has no private form: it runs once, plain, as a reference.
    ``source`` sends θ_G back unchanged, so every aggregator keeps θ_G⁽⁰⁾: it runs with one
    aggregator only (``none`` when the sweep has it).
    """
    forms = list(cfg.sweep.get("privacy", None) or ["plain"])
    aggregators = [str(a) for a in cfg.sweep.aggregators]
    once = ["none"] if "none" in aggregators else aggregators[:1]
    return [
        (str(m), a, str(f), int(s))
        for s in cfg.sweep.seeds
        for m in cfg.sweep.methods
        for f in forms
        for a in (once if m == "source" else aggregators)
        if m in GRADIENT_METHODS or C.privacy_form(cfg, f).get("mode") == "off"
    ]


def arrival_checkpoints(cfg: DictConfig, cells: List[Tuple[str, str, str, int]] | None = None) -> Dict[Path, str]:
    """``{checkpoint folder: config fingerprint}`` of the arrival runs ``cells`` (default: the configured run)."""
    acfgs = (
        [C.arrival_config(cfg)]
        if cells is None
        else [C.arrival_config(cfg, method=m, aggregator=a, form=f, seed=s) for m, a, f, s in cells]
    )
    return {ckpt_dir(cfg, cell_name(a)): a.fingerprint() for a in acfgs}


def check_checkpoints(folders: Mapping[Path, str], *, resume: bool) -> None:
    """Read every checkpoint a run will read (``{folder: config fingerprint}``), before any service starts.

    The engines read them too, but only once Ray and Prefect are up and the run's task is under
    way (about 90 s in); here a bad one fails in a second. A checkpoint that does not match its
    sha256, or cannot be read, fails whether or not the run resumes (the engine never overwrites
    it); with ``resume``, so does one written by another config.

    Raises
    ------
    fedcore.engine.checkpoint.CheckpointError
        Naming the folder and the fix. The checkpoint is left untouched.
    """
    from fedcore.engine.checkpoint import CheckpointError, load_state

    for folder, fingerprint in folders.items():
        try:
            saved = load_state(folder)
        except CheckpointError as exc:
            raise CheckpointError(
                f"{exc} Found before starting Ray and Prefect. Delete {folder} (or move it away) "
                "to start that run afresh; rerunning with flow.resume=false does not skip it, since "
                "a checkpoint that fails its check is never overwritten."
            ) from exc
        if resume and saved is not None and saved.fingerprint != fingerprint:
            raise CheckpointError(
                f"flow.resume=true, but the checkpoint in {folder} was written by another config "
                f"({saved.fingerprint} != {fingerprint}). Found before starting Ray and Prefect. "
                "Rerun without flow.resume=true to start afresh (it is then overwritten), or with "
                "the config that wrote it."
            )


# What each BPFedCTTA step writes, as a function of the composed config: a missing input's error names the
# variant's stage that writes that very file (prepare -> partition -> pretrain).
_WRITES: Dict[str, Callable[[DictConfig], Path]] = {
    "prepare": lambda cfg: prepared_path(cfg),
    "partition": lambda cfg: partition_dir(cfg),
    "pretrain": lambda cfg: source_model_path(cfg),
}
_SETTINGS = {
    "prepare": "data and paths",
    "partition": "data, seed and paths",
    "pretrain": "data, model, pretrain and paths",
}


def build_hint(cfg: DictConfig, step: str) -> str:
    """The command that builds ``cfg``'s input of ``step`` (``prepare``, ``partition``, ``pretrain``): the DVC
    stage whose variant writes that very file, or the step with this run's own settings when no stage does
    (``model.norm=group`` on the default data is ``variant=private``'s model only if the paths agree too)."""
    import yaml

    path = _WRITES[step](cfg)
    try:
        stages = yaml.safe_load((C.project_root() / "dvc.yaml").read_text())["stages"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):  # no pipeline here (an installed deployment)
        stages = {}
    for name in stages.get(step, {}).get("foreach") or {}:  # the variants with a stage of their own for the step
        try:
            if _WRITES[step](C.load(C.project_root() / "params.yaml", [f"variant={name}"])) == path:
                return f"`dvc repro {step}@{name}` (or `python -m flows.stages {step} variant={name}`)"
        except (FileNotFoundError, ValueError):
            break  # no params.yaml, or one that no longer composes: say what always works
    example = ", e.g. variant=private for the GroupNorm one" if step == "pretrain" else ""
    return (
        f"`python -m flows.stages {step}` with this run's {_SETTINGS[step]} settings; no DVC stage writes "
        f"this file (each variant's: `dvc repro {step}@<variant>`{example})"
    )


def source_model_hint(cfg: DictConfig) -> str:
    """The command that builds ``cfg``'s source model (:func:`build_hint`)."""
    return build_hint(cfg, "pretrain")


def load_source(
    path: Path,
    spec: ModelSpec,
    *,
    written: Mapping[str, str] | None = None,
    build: Callable[[], str] = lambda: "`dvc repro pretrain@mnist` (or `python -m flows.stages pretrain`)",
) -> Dict[str, torch.Tensor]:
    """The source model's weights, checked against its writer's md5 first, then read as tensors only.

    Raises :class:`flows.services.integrity.IntegrityError` for a stage output changed since DVC (or
    the flow in ``written``) wrote it, and ``ValueError`` for anything but a fedcore source
    model of ``spec``.
    """
    if not path.is_file():
        raise FileNotFoundError(f"source model {path} is missing. Build it with {build()}.")
    integrity.verify(path, written=written)
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        state = blob["state"]
    except Exception as exc:
        raise ValueError(
            f"source model {path} is corrupt or not a fedcore checkpoint ({exc}); rebuild it with {build()}"
        ) from exc
    if blob.get("spec") != asdict(spec):
        raise ValueError(
            f"source model {path} was trained for {blob.get('spec')}, not {asdict(spec)}; rebuild it with {build()}"
        )
    return state


def load_partition(cfg: DictConfig, *, written: Mapping[str, str] | None = None) -> Partition:
    """The partition, refused if it changed since DVC (or the flow in ``written``) wrote it."""
    integrity.verify(partition_dir(cfg), written=written)
    return Partition.load(partition_dir(cfg), build=lambda: build_hint(cfg, "partition"))


def load_inputs(cfg: DictConfig, *, written: Mapping[str, str] | None = None):
    """(partition, spec, source weights), each checked against its writer's md5 before it is read."""
    spec = C.model_spec(cfg)
    partition = load_partition(cfg, written=written)
    return (
        partition,
        spec,
        load_source(source_model_path(cfg), spec, written=written, build=lambda: source_model_hint(cfg)),
    )
