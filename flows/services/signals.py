"""Stopping a run on SIGTERM or SIGINT: promptly, with a non-zero exit, and nothing started or logged after.

systemd, Kubernetes and ``timeout`` stop a job with SIGTERM; a user presses Ctrl-C (SIGINT to the
whole process group, Ray's processes included; the temporary Prefect server runs in a session of its own,
so that the run can still close its records there). This is installed by
``python -m flows.stages`` (what ``dvc repro`` runs); a nightly deployment's run, started by a Prefect
worker, is cancelled through Prefect and handled by Prefect.
Three things made that unreliable:

* During a flow run Prefect swaps in its own SIGTERM handler, which raises ``TerminationSignal`` in
  whatever the main thread is running. If that is a weakref callback or a ``__del__``, Python prints
  "Exception ignored in ..." and discards it, and the run goes on to the end with exit status 0. (The
  same holds for the exception this module raises; a lost one is not printed, see below.)
* Had the temporary Prefect server stopped with the run (Ctrl-C reaches the whole process group), every
  API call the unwinding flow makes would wait out its retries (70 s and more), and the flow run would
  stay "running" in Prefect: the server is therefore started in its own session
  (``flows.services.runtime``), and stopped by the driver on the way out.
* A cell or arrival that came back just after the signal was still logged.

So the first signal sets :data:`STOP` and a deadline before anything is raised (Prefect's handler is
wrapped to do the same). Flows call :func:`check` before they start or log a cell, round or arrival,
which raises :class:`Stopped` there even when the first exception was lost; and if the process is
still alive :data:`GRACE_S` seconds later, a watchdog thread ends it with ``os._exit``. A second signal
ends it at once. The exit status is 128 + the signal's number (143 for SIGTERM, 130 for SIGINT). A closed
terminal's SIGHUP stops a run the same way (129), unless it is ignored (``nohup``): the temporary Prefect
server, in a session of its own, would not get it, so the run stops it.
Checkpoints are written atomically (:mod:`fedcore.engine.checkpoint`), so any of these exits leaves the
last completed arrival or round to resume from.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

GRACE_S = float(os.environ.get("FEDCORE_STOP_GRACE_S", "20"))  # unwinding: MLflow marks its run, Ray stops
REDELIVERY_S = 2.0  # Prefect sends its SIGTERM again once it has unwound: within this, the same stop
SETTLE_S = 3.0  # enough to close the MLflow runs and checkpoints of a run whose Prefect server is gone
STOP = threading.Event()
_received: dict = {}


class Stopped(KeyboardInterrupt):
    """The run was asked to stop by a signal. A KeyboardInterrupt, so ``except Exception`` does not catch
    it and Prefect marks the flow run crashed, MLflow its run failed."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


_HELD = [0]  # how many deferred() blocks the main thread is in


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold a stop signal's exception until the block ends, for a step that must not be cut in two
    (creating an MLflow run and making it active, so that whoever ends it can find it). The signal is
    noted at once (the flag, the deadline, the line on stderr), and :func:`check` raises when the block
    is left; a second signal still exits at once. Signals reach the main thread only, so elsewhere the
    block is run as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _HELD[0] += 1
    try:
        yield
    finally:
        _HELD[0] -= 1
    check()


def exit_status() -> int:
    """128 + the signal that stopped this run; 0 when none came."""
    return 128 + int(_received["signum"]) if STOP.is_set() else 0


def check() -> None:
    """Raise :class:`Stopped` if a stop signal has come. Call it before starting or logging a unit of work."""
    if STOP.is_set():
        raise Stopped(int(_received["signum"]))


def describe() -> str:
    """The stop signal's name ("SIGTERM"), or "" when none came."""
    return signal.Signals(int(_received["signum"])).name if STOP.is_set() else ""


def received_at() -> float | None:
    """When the stop signal came (``time.time()``), or None."""
    return _received.get("at")


def finishing() -> None:
    """The run has ended and the process is exiting: a signal now ends it at once, with 128 + its number
    (raised in an exit handler, the exception would be discarded and the exit status stay 0)."""
    _received["finishing"] = True


def exit_now(code: int) -> None:
    """End the process with ``code`` after a stop, skipping exit handlers: Prefect's and Ray's would wait on
    Ray processes the signal has already stopped, or retry a Prefect server that has died. The runs are
    marked by then, and every write is committed. The temporary Prefect server, which Prefect stops in an
    exit handler and which no signal to the run reaches (it has a session of its own), is sent SIGTERM here."""
    from flows.services import runtime

    runtime.stop_temporary_server_now()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed terminal or pipe: nothing to flush to
            stream.flush()
    os._exit(code)


_CRASHED_FLOW_RUNS: list = []


def crash_open_task_runs(flow: Any, flow_run: Any, state: Any) -> None:
    """A flow's ``on_crashed`` hook: its task runs still pending or running are marked crashed too.

    A stop signal ends the flow run on the driver, and Ray's workers are stopped with it before they
    can report their own task runs; without this the Prefect UI would show a crashed flow run holding
    running tasks. A worker may still report a state in the moment before Ray is down, so
    :func:`crash_task_runs_left` sweeps again once it is (``python -m flows.stages`` calls it)."""
    _CRASHED_FLOW_RUNS.append(flow_run.id)
    _crash_open_task_runs([flow_run.id])


def crash_task_runs_left() -> None:
    """After a stop, with Ray down: the crashed flow runs' task runs still open are marked crashed."""
    if _CRASHED_FLOW_RUNS:
        _crash_open_task_runs(list(_CRASHED_FLOW_RUNS))
        _CRASHED_FLOW_RUNS.clear()


def _crash_open_task_runs(flow_run_ids: list) -> None:
    """Mark the flow runs' open task runs crashed: once, with no client retries and a short timeout, and not
    past half the stop's grace time, so that a slow or unreachable Prefect server cannot hold up the rest
    of the stop (MLflow's runs are closed after this)."""
    from flows.services import runtime

    if runtime.temporary_server_gone():  # nothing to correct there, and the client would only retry
        return
    since = received_at()
    if since is not None and time.time() - since > GRACE_S / 2:
        return
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings
    from prefect.states import Crashed

    open_states = TaskRunFilterStateType(any_=[StateType.PENDING, StateType.SCHEDULED, StateType.RUNNING])
    try:
        with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}):
            with get_client(httpx_settings={"timeout": 5.0}, sync_client=True) as client:
                for _ in range(50):  # each pass marks what it read, so the next reads the rest
                    runs = client.read_task_runs(
                        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_run_ids)),
                        task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=open_states)),
                        limit=200,
                    )
                    for run in runs:
                        client.set_task_run_state(run.id, Crashed(message="its flow run crashed"), force=True)
                    if len(runs) < 200:
                        break
    except Exception as exc:  # a record left open is not worth failing the stop for
        logging.getLogger(__name__).warning("could not mark the crashed flow run's open task runs: %s", exc)


def _note(signum: int) -> None:
    """The first signal: the flag, the deadline and a line on stderr; a second: exit now."""
    if _received.get("finishing"):
        exit_now(128 + signum)
    if STOP.is_set():
        _say(f"\n{signal.Signals(signum).name} again: exiting now\n")
        exit_now(128 + signum)
    _received.update(signum=signum, at=time.time())
    STOP.set()
    threading.Thread(target=_deadline, args=(signum,), name="fedcore-stop-deadline", daemon=True).start()
    _say(
        f"\n{signal.Signals(signum).name}: stopping; no new cell, round or arrival starts or is logged. The run "
        f"is marked failed and exits within {GRACE_S:.0f} s (send it again to exit at once); resume with "
        "flow.resume=true\n"
    )


def _say(text: str) -> None:
    """A line on stderr, if there still is one: a closed terminal fails writes (EIO) before its SIGHUP
    arrives, and a pipe whose reader has gone fails them too (EPIPE); the stop goes on either way."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


def _deadline(signum: int) -> None:
    """Exit at the deadline; or sooner, once the run has had :data:`SETTLE_S` to mark its runs, if the
    temporary Prefect server it reports to has died: all that is left then is
    Prefect's client retrying a dead server, which took 70 s and more."""
    from flows.services import runtime

    start = time.monotonic()
    while time.monotonic() - start < GRACE_S:
        time.sleep(0.25)
        if time.monotonic() - start >= SETTLE_S and runtime.temporary_server_gone() and not _in_flow_body():
            _say("the temporary Prefect server has stopped: exiting\n")
            exit_now(128 + signum)
    _say(f"still running {GRACE_S:.0f} s after {signal.Signals(signum).name}: exiting\n")
    if os.environ.get("FEDCORE_STOP_TRACE"):  # where it was stuck, for a report
        import faulthandler

        with contextlib.suppress(OSError, ValueError):
            faulthandler.dump_traceback(all_threads=True)
    exit_now(128 + signum)


# The flows' own bodies (flows/runs/federation.py, flows/runs/rounds.py): while the main thread is in one, it is still
# closing its MLflow runs and checkpoints; once it has left them, only Prefect's reporting remains.
FLOW_BODIES = frozenset({"sequential_arrival", "sweep_flow", "grid_flow", "rounds_flow", "source_pretraining"})


def _in_flow_body() -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name in FLOW_BODIES:
            return True
        frame = frame.f_back
    return False


def _handle(signum: int, frame: Any) -> None:
    sent = _received.pop("redelivery", None)
    if sent is not None and sent[0] == signum and time.monotonic() - sent[1] < REDELIVERY_S:
        # Prefect's flow engine, having unwound its TerminationSignal, restores this handler and sends
        # the signal again: the same stop, not a second one
        if not _HELD[0]:
            raise Stopped(signum)
        return
    _note(signum)
    if not _HELD[0]:
        raise Stopped(signum)


def _quiet_lost_stop(previous: Any) -> Any:
    """``sys.unraisablehook`` that says nothing of a stop raised where Python discards exceptions (a weakref
    callback, a ``__del__``): the stop is noted already, and :func:`check` raises it again where it counts.
    Python's default would print "Exception ignored in ..." and a traceback that reads as if the stop failed."""
    from prefect.exceptions import TerminationSignal

    def hook(unraisable: Any) -> None:
        if STOP.is_set() and isinstance(unraisable.exc_value, (Stopped, TerminationSignal)):
            return
        previous(unraisable)

    hook.quiets_stop = True  # type: ignore[attr-defined]
    return hook


def install() -> None:
    """Handle SIGTERM, SIGINT and SIGHUP in this (the driver's main) thread, Prefect's flow-run handler included."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _handle)
    signal.signal(signal.SIGINT, _handle)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # a closed terminal; `nohup`'s ignore stands
        signal.signal(signal.SIGHUP, _handle)
    if not getattr(sys.unraisablehook, "quiets_stop", False):
        sys.unraisablehook = _quiet_lost_stop(sys.unraisablehook)
    import prefect.utilities.engine as engine

    prefect_handler = engine._prefect_sigterm_handler
    if getattr(prefect_handler, "notes_stop", False):
        return

    def noted(signum: int, frame: Any) -> None:
        _note(signum)
        if _HELD[0]:  # raised by check() when the deferred block ends
            return
        _received["redelivery"] = (signum, time.monotonic())
        prefect_handler(signum, frame)

    noted.notes_stop = True  # type: ignore[attr-defined]
    # capture_sigterm() installs and compares the module's handler by name at call time
    engine._prefect_sigterm_handler = noted


def reset() -> None:
    """Forget a received signal (tests)."""
    STOP.clear()
    _received.clear()
