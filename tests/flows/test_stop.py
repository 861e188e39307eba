"""The stop logic of flows/signals.py in one process (the real runs are in tests/e2e/test_signals.py)."""

from __future__ import annotations

import signal

import pytest

from flows import signals


@pytest.fixture
def stopping(monkeypatch):
    """flows.signals with its deadline thread and its process exit recorded instead of carried out."""
    exits: list[int] = []
    monkeypatch.setattr(signals, "_deadline", lambda signum: None)
    monkeypatch.setattr(signals, "exit_now", lambda code: exits.append(code))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
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


def test_the_deadline_knows_when_the_main_thread_has_left_the_flow_body():
    def grid_flow():
        return signals._in_flow_body()

    assert grid_flow() is True
    assert signals._in_flow_body() is False


def test_a_signal_inside_a_deferred_section_is_raised_when_the_section_ends(stopping, monkeypatch):
    import prefect.utilities.engine as engine

    called = []
    monkeypatch.setattr(engine, "_prefect_sigterm_handler", lambda signum, frame: called.append(signum))
    signals.install()
    # ours, and Prefect's as during a flow run: either one, landing between the checkpoint and the log entry
    for handler in (signals._handle, engine._prefect_sigterm_handler):
        signals.reset()
        done = []
        with pytest.raises(signals.Stopped, match="SIGTERM"):
            with signals.deferred():
                handler(signal.SIGTERM, None)
                done.append("checkpointed and logged")
        assert done == ["checkpointed and logged"]  # both steps ran, then the stop was raised
        assert signals.exit_status() == 143 and stopping == []
    assert called == []  # Prefect's raise was held back too

    with pytest.raises(ValueError):  # an error inside is the one raised; the section ends all the same
        with signals.deferred():
            raise ValueError("the checkpoint could not be written")
    with pytest.raises(signals.Stopped):
        signals._handle(signal.SIGINT, None)  # outside any section: raised where it lands (a second: exit)
    assert stopping == [128 + signal.SIGINT]
