"""What plain Ray tasks run on a worker: a block of arrivals, a round's client step.

Kept apart from ``flows.runs.tasks`` (Prefect tasks, config and paths) so that a fresh Ray worker
unpickling one of these imports torch and fedcore only: no Prefect, no OmegaConf, no MLflow.
A worker that starts cold pays its imports before its first arrival (9 s for ``flows.runs.tasks`` in a
Ray worker on this 2-core machine before bytecode was compiled, about 3 s for this module:
``python -X importtime -c "import flows.runs.worker"``).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, Tuple

import numpy as np
import torch

from fedcore.data import Partition
from fedcore.engine import ArrivalConfig, ModelSpec, ServerState, iter_arrivals, run_now, train_step
from fedcore.train import ClientUpdate


def _maybe_fail(fault_marker: str | None = None, crash_marker: str | None = None) -> None:
    """Injected faults for tests, on the first attempt only (a marker file remembers it).

    ``fault_marker``: the step raises (Prefect retries the task). ``crash_marker``: the worker
    process kills itself by PID with SIGKILL mid-task, as a dying node would (Ray reruns the task).
    """
    if crash_marker and not Path(crash_marker).exists():
        import os
        import signal

        Path(crash_marker).parent.mkdir(parents=True, exist_ok=True)
        Path(crash_marker).write_text(f"worker {os.getpid()} killed once\n")
        os.kill(os.getpid(), signal.SIGKILL)
    if fault_marker and not Path(fault_marker).exists():
        Path(fault_marker).parent.mkdir(parents=True, exist_ok=True)
        Path(fault_marker).write_text("failed once\n")
        raise RuntimeError(f"injected fault ({fault_marker}); Prefect should retry this task")


@contextlib.contextmanager
def torch_threads(threads: int):
    """Torch uses ``threads`` threads (the CPUs Ray gave the task) inside, and the worker's own count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def arrival_pass(
    *,
    partition: Partition,
    spec: ModelSpec,
    cfg: ArrivalConfig,
    start: ServerState,
    stop_at: int,
    threads: int = 1,
    faults: Mapping[int, Mapping[str, str]] | None = None,
    plugins: Sequence[str] = (),
) -> Iterator[ServerState]:
    """What a Ray worker runs for a block of arrivals: the plain loop from ``start`` up to ``stop_at``.

    A Ray generator: each arrival's state (its record is the last of ``state.records``) streams
    back to the driver as soon as it exists, while the worker goes on with the next client; the
    driver checkpoints and logs it. Arrivals are sequential, so the worker uses ``threads`` CPUs.
    ``faults``: arrival -> injected-fault markers (:func:`_maybe_fail`; tests), fired as that
    arrival's adaptation starts. ``plugins``: the run's plug-ins, imported here first.
    """
    load_plugins(plugins)
    faults = faults or {}

    def submit(fn, **kw):
        _maybe_fail(**faults.get(kw["arrival"], {}))
        return run_now(fn, **kw)

    with torch_threads(threads):
        for _, st, _ in iter_arrivals(partition, spec, cfg, start, submit=submit, stop_at=stop_at):
            yield st


def load_plugins(plugins: Sequence[str]) -> None:
    """The run's plug-ins, in this worker too: a plug-in's trainer, model or method is found by name here."""
    if plugins:
        from flows import systems

        systems.load_plugins(plugins)


class Packed:
    """A CPU tensor carried between processes as a numpy array.

    Ray pickles a numpy array's memory as one out-of-band buffer; a torch tensor pickles its storage
    as a small ``torch.save`` archive of its own, whose loading is about half the driver's work in a
    SCAFFOLD round of 100 clients (model, control variate and its change, about 30 tensors each).
    """

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self):
        return Packed, (self.array,)


_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8}
_NUMPY_DTYPES |= {torch.uint8, torch.bool}


def _map_leaves(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` with ``leaf`` applied to each value inside its dicts, lists, tuples and :class:`ClientUpdate`."""
    if isinstance(obj, dict):
        return {k: _map_leaves(v, leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_leaves(v, leaf) for v in obj)
    if isinstance(obj, ClientUpdate):
        parts = ("state", "client_state", "payload")
        return replace(obj, **{p: _map_leaves(getattr(obj, p), leaf) for p in parts})
    return leaf(obj)


def pack(obj: Any) -> Any:
    """``obj`` with every tensor in its dicts, lists, tuples and :class:`ClientUpdate` as a :class:`Packed` array.

    Other values (numpy arrays among them) pass untouched; a tensor numpy cannot hold stays a tensor.
    """

    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dtype in _NUMPY_DTYPES:
            return Packed(v.detach().cpu().numpy())
        return v

    return _map_leaves(obj, leaf)


def unpack(obj: Any) -> Any:
    """:func:`pack` undone: each array a tensor of its own memory (the same bits), never a view of Ray's store."""
    return _map_leaves(obj, lambda v: torch.from_numpy(np.array(v.array, copy=True)) if isinstance(v, Packed) else v)


def update_summary(update: ClientUpdate) -> Tuple[int, float]:
    """What the driver logs of a finished client step before fetching its update: examples and train loss."""
    return update.num_examples, float(update.metrics.get("train_loss", float("nan")))


def train_step_or_fail(
    *,
    fault_marker: str | None = None,
    crash_marker: str | None = None,
    threads: int = 1,
    plugins: Sequence[str] = (),
    **kw,
) -> ClientUpdate:
    """What the Ray worker runs for a driver-side client task (the injected faults fire in the worker).

    The states arrive and the update leaves :func:`pack`-ed; the driver unpacks it.
    """
    load_plugins(plugins)
    _maybe_fail(fault_marker, crash_marker)
    for key in ("global_state", "broadcast", "client_state"):
        if key in kw:
            kw[key] = unpack(kw[key])
    with torch_threads(threads):
        return pack(train_step(**kw))
