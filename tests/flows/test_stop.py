"""The stop logic of flows/services/signals.py in one process (the real runs are in tests/e2e/test_signals.py)."""

from __future__ import annotations

import os
import signal
import sys
import time
import weakref
from pathlib import Path

import pytest

from flows.services import signals


@pytest.fixture
def stopping(monkeypatch):
    """flows.services.signals with its deadline thread and its process exit recorded instead of carried out."""
    exits: list[int] = []
    monkeypatch.setattr(signals, "_deadline", lambda signum: None)
    monkeypatch.setattr(signals, "exit_now", lambda code: exits.append(code))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    signals.reset()
    yield exits
    signals.reset()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def test_the_first_signal_stops_with_its_status_and_a_second_exits_at_once(stopping):
    assert signals.exit_status() == 0
    signals.check()  # nothing received: no error

    with pytest.raises(signals.Stopped):
        signals._handle(signal.SIGTERM, None)

    assert signals.STOP.is_set() and signals.exit_status() == 143 and signals.describe() == "SIGTERM"
    with pytest.raises(signals.Stopped, match="stopped by SIGTERM"):
        signals.check()  # every later check point raises too, even if the first exception was lost
    assert stopping == []
    with pytest.raises(signals.Stopped):
        signals._handle(signal.SIGINT, None)
    assert stopping == [128 + signal.SIGINT]  # the second signal: exit at once


def test_a_stop_lost_in_a_weakref_callback_is_not_printed_and_other_lost_errors_are(stopping, monkeypatch):
    # Prepare: the hook that install() puts in front of Python's own, which records what reaches it
    printed: list = []
    hook = signals._quiet_lost_stop(printed.append)

    class Holder:
        pass

    def lose(exc: BaseException) -> None:  # raised in a weakref callback, where Python discards it
        held = Holder()
        ref = weakref.ref(held, lambda _: _raise(exc))
        monkeypatch.setattr(sys, "unraisablehook", hook)
        del held  # the callback runs here
        assert ref() is None

    # Execute: an error before any signal, then a stop after one
    lose(RuntimeError("a real error"))
    with pytest.raises(signals.Stopped):
        signals._handle(signal.SIGTERM, None)
    lose(signals.Stopped(signal.SIGTERM))

    # Assert: the real error still reaches Python's hook; the lost stop does not, and check() raises it again
    assert [type(u.exc_value) for u in printed] == [RuntimeError]
    with pytest.raises(signals.Stopped):
        signals.check()


def _raise(exc: BaseException) -> None:
    raise exc


def test_prefects_own_resend_of_sigterm_is_the_same_stop(stopping, monkeypatch):
    import prefect.utilities.engine as engine
    from prefect.exceptions import TerminationSignal

    monkeypatch.setattr(engine, "_prefect_sigterm_handler", engine._prefect_sigterm_handler)
    signals.install()
    wrapped = engine._prefect_sigterm_handler
    assert getattr(wrapped, "notes_stop", False)
    signals.install()
    assert engine._prefect_sigterm_handler is wrapped  # installed twice, wrapped once

    with pytest.raises(TerminationSignal):
        wrapped(signal.SIGTERM, None)  # Prefect's handler during a flow run, as a SIGTERM lands
    assert signals.exit_status() == 143
    with pytest.raises(signals.Stopped):
        signals._handle(signal.SIGTERM, None)  # Prefect restores ours and sends the signal again
    assert stopping == []  # not taken for a second signal


@pytest.mark.parametrize("before", [signal.SIG_DFL, signal.SIG_IGN], ids=["terminal", "nohup"])
def test_a_closed_terminal_stops_a_run_unless_hangups_are_ignored(stopping, monkeypatch, before):
    import prefect.utilities.engine as engine

    monkeypatch.setattr(engine, "_prefect_sigterm_handler", engine._prefect_sigterm_handler)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    signal.signal(signal.SIGHUP, before)
    signals.install()
    assert getattr(sys.unraisablehook, "quiets_stop", False)  # a stop lost in a weakref callback stays quiet
    if before is signal.SIG_IGN:
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        return
    with pytest.raises(signals.Stopped):
        signal.getsignal(signal.SIGHUP)(signal.SIGHUP, None)
    assert signals.exit_status() == 128 + signal.SIGHUP and signals.describe() == "SIGHUP"


def test_a_stop_goes_on_when_stderr_is_gone(stopping, monkeypatch):
    """A closed terminal fails writes before its SIGHUP arrives (as a pipe whose reader has gone does): the stop
    is still raised and its deadline still set, though its line cannot be written."""
    # Prepare: stderr a pipe nobody reads
    started: list[int] = []
    monkeypatch.setattr(signals, "_deadline", started.append)
    read, write = os.pipe()
    os.close(read)
    saved = os.dup(2)

    # Execute
    try:
        os.dup2(write, 2)
        with pytest.raises(signals.Stopped):
            signals._handle(signal.SIGHUP, None)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write)

    # Assert
    for _ in range(50):
        if started:
            break
        time.sleep(0.02)
    assert started == [signal.SIGHUP] and signals.exit_status() == 128 + signal.SIGHUP


def test_the_deadline_knows_when_the_main_thread_has_left_the_flow_body():
    def grid_flow():
        return signals._in_flow_body()

    assert grid_flow() is True
    assert signals._in_flow_body() is False


def test_an_arrival_accepted_while_the_run_stops_is_checkpointed_and_logged_or_neither(monkeypatch, tmp_path):
    """Arrivals are accepted on a task thread while the flow's main thread may be unwinding: the flow stops
    accepting before it closes the log, and waits for the arrival being checkpointed to reach the log."""
    import threading
    import time
    from types import SimpleNamespace

    from flows.runs import federation as F
    from flows.services import runtime

    # Prepare: a run of 4 arrivals whose checkpoint write can be held, without Ray
    signals.reset()
    monkeypatch.setattr(runtime, "put", lambda value: value)
    saving, release = threading.Event(), threading.Event()

    def held_save(folder, payload, *, fingerprint):
        saving.set()
        assert release.wait(10)

    monkeypatch.setattr(F, "save_state", held_save)
    logged = []
    passes = F.ArrivalPasses(
        SimpleNamespace(done=0, fingerprint="f", records=[]),
        partition=SimpleNamespace(targets=[0, 1]),
        spec=None,
        acfg=SimpleNamespace(schedule=lambda k: list(range(4))),
        checkpoint_dir=tmp_path,
        threads=1,
        num_gpus=0,
        on_arrival=lambda record, st, _: logged.append(record["arrival"]),
    )

    def state(done):
        return SimpleNamespace(done=done, fingerprint="f", records=[{"arrival": done - 1}], to_payload=dict)

    # Execute: arrival 0 is being checkpointed on a task thread when the main thread stops accepting
    accepting = threading.Thread(target=passes._accept, args=(state(1),))
    accepting.start()
    assert saving.wait(10)
    stopping = threading.Thread(target=passes.stop_accepting)
    stopping.start()
    time.sleep(0.2)
    held = stopping.is_alive()
    release.set()
    accepting.join(10)
    stopping.join(10)

    # Assert: the stop waited for arrival 0 to reach the log; arrival 1, after it, is neither saved nor logged
    assert held and logged == [0] and passes.st.done == 1
    saving.clear()
    with pytest.raises(F._NotAccepted, match="came back after the run stopped"):
        passes._accept(state(2))
    assert logged == [0] and not saving.is_set() and passes.st.done == 1
    # the pass task that meets it ends without an error, so Prefect does not retry it
    passes._stream = iter([state(2)])
    monkeypatch.setattr(passes, "close", lambda: None)
    monkeypatch.setattr("ray.get", lambda value: value)
    assert passes.run(4, logger=None) == 1 and logged == [0]


def test_a_signal_in_a_deferred_block_is_noted_at_once_and_raised_when_the_block_ends(stopping):
    reached = []
    with pytest.raises(signals.Stopped, match="stopped by SIGINT"):
        with signals.deferred():
            signals._handle(signal.SIGINT, None)  # no exception here: the block is not cut in two
            reached.append(signals.exit_status())
    assert reached == [130] and stopping == []

    with pytest.raises(signals.Stopped):
        with signals.deferred():
            signals._handle(signal.SIGTERM, None)  # a second signal exits at once, held or not
    assert stopping == [128 + signal.SIGTERM]


def test_a_stop_while_a_run_is_made_active_ends_it_failed_and_leaves_nothing_active(stopping, tmp_path, monkeypatch):
    import mlflow

    from flows.services import tracking

    tracking.setup(f"sqlite:///{tmp_path}/mlruns.db", "stop-test")
    real = mlflow.start_run

    def interrupted(*args, **kwargs):
        active = real(*args, **kwargs)
        signals._handle(signal.SIGINT, None)  # Ctrl-C lands as the run becomes active
        return active

    monkeypatch.setattr(mlflow, "start_run", interrupted)
    with pytest.raises(signals.Stopped):
        tracking.start_run("cell-s0")

    runs = mlflow.search_runs(experiment_names=["stop-test"], output_format="list")
    assert [(r.info.run_name, r.info.status) for r in runs] == [("cell-s0", "FAILED")]
    assert mlflow.active_run() is None


def test_fail_active_runs_ends_every_open_run(tmp_path):
    import mlflow

    from flows.services import tracking

    tracking.setup(f"sqlite:///{tmp_path}/mlruns.db", "open-runs")
    parent = mlflow.start_run(run_name="parent")
    mlflow.start_run(run_name="child", nested=True)
    tracking.fail_active_runs()
    assert mlflow.active_run() is None
    statuses = {
        r.info.run_name: r.info.status for r in mlflow.search_runs(experiment_names=["open-runs"], output_format="list")
    }
    assert statuses == {"parent": "FAILED", "child": "FAILED"} and parent.info.run_id


def test_the_temporary_servers_guard_keeps_it_from_ctrl_c_and_ends_it_when_the_driver_has_gone():
    """The shim Prefect's server module starts its server with: a session of its own (a terminal's Ctrl-C does
    not reach it), and a guard that ends it once the pipe only the driver holds is closed, as it is however the
    driver ends (closed here by hand)."""
    # Prepare: a stand-in server, started as Prefect starts its own
    from flows.services import runtime

    guard = runtime._OwnSession().Popen(
        args=[sys.executable, "-c", "import time; time.sleep(120)"], env=dict(os.environ)
    )
    pipe = runtime._GUARD_PIPES[-1]
    try:
        deadline = time.monotonic() + 10
        while not _children(guard.pid):
            assert time.monotonic() < deadline, "the guard started no server"
            time.sleep(0.05)
        (server,) = _children(guard.pid)

        # Execute: the driver's end of the pipe closes
        assert os.getsid(guard.pid) != os.getsid(0) and os.getsid(server) == os.getsid(guard.pid)
        runtime._GUARD_PIPES.remove(pipe)
        os.close(pipe)

        # Assert: the guard ended the server and exited
        guard.wait(timeout=10)  # it waits for the server it ended, so both are gone
        assert not Path(f"/proc/{server}").exists()
    finally:
        if guard.poll() is None:
            guard.kill()
            guard.wait()


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
