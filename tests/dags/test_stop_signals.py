"""How ``posttrain run`` holds on to SIGTERM and Ctrl-C around ``dag.test()``
(``dags/local.py``'s ``_signals_kept``, ``components/core/runner.py``): recorded between
tasks, raised inside a stage, and never replaced by Airflow's task runner's handler. The
process-level behaviour is in ``test_stagehost.py``."""

from __future__ import annotations

import os
import signal

import pytest

from components.core import runner, tracking
from dags.local import TASK_RUNNER, _signals_kept


@pytest.fixture
def fresh_stop_state(monkeypatch):
    monkeypatch.setattr(runner, "_stop_signals", [])
    before = {sig: signal.getsignal(sig) for sig in runner.STOP_SIGNALS}
    if not runner.stop_on_sigterm(sigint=True):  # as the CLI does for posttrain run
        pytest.skip("signal handlers can be installed in the main thread only")
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def _as_the_task_runner(handler) -> None:
    """``signal.signal(SIGTERM, handler)`` called from code whose module is Airflow's task runner."""
    exec("import signal\nsignal.signal(signal.SIGTERM, handler)", {"__name__": TASK_RUNNER, "handler": handler})


def test_the_task_runners_sigterm_handler_is_not_installed_and_a_signal_is_recorded(fresh_stop_state) -> None:
    called = []
    with _signals_kept():
        _as_the_task_runner(lambda signum, frame: called.append(signum))
        os.kill(os.getpid(), signal.SIGTERM)  # between two tasks: recorded, nothing raised
        assert runner.stopping() and runner.stop_signal() == signal.SIGTERM
    assert called == []
    assert signal.getsignal(signal.SIGTERM) is runner._terminate  # the CLI's handler is back afterwards
    with pytest.raises(tracking.Terminated):
        os.kill(os.getpid(), signal.SIGTERM)


def test_other_code_still_installs_its_handler(fresh_stop_state) -> None:
    def other(signum, frame):
        pass

    with _signals_kept():
        signal.signal(signal.SIGTERM, other)
        assert signal.getsignal(signal.SIGTERM) is other


def test_a_stage_raises_on_ctrl_c_and_sigterm_and_the_recording_resumes_after(fresh_stop_state) -> None:
    with _signals_kept():
        for sig in (signal.SIGINT, signal.SIGTERM):
            with pytest.raises(tracking.Terminated), runner.stop_signals_raised():
                os.kill(os.getpid(), sig)
            assert signal.getsignal(sig) is runner._record
        os.kill(os.getpid(), signal.SIGINT)  # recorded again
    assert runner._stop_signals == [signal.SIGINT, signal.SIGTERM, signal.SIGINT]


def test_a_recorded_stop_ends_dag_test_while_a_task_waits_for_its_retry(fresh_stop_state, monkeypatch) -> None:
    """dag.test() logs "No tasks to run" once a second while a task waits for its retry
    (minutes in docker mode without a Docker daemon): a recorded SIGTERM made the command
    wait that out; it now leaves dag.test() from there."""
    import logging

    from dags import wiring
    from dags.local import _after_a_failure

    monkeypatch.setattr(wiring, "FAILED_TASKS", [])  # as in a run where no task has failed for good (another
    monkeypatch.setattr(wiring, "FINAL_ERRORS", [])  # test's run in this process may have left some)
    record = logging.LogRecord("airflow.sdk.definitions.dag", logging.WARNING, __file__, 1,
                               "No tasks to run. unrunnable tasks: %s", ({"rollout"},), None)
    assert _after_a_failure(record) is True  # not told to stop: the wait goes on, and the line shows
    with _signals_kept():
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(tracking.Terminated, match="stopped by SIGTERM"):
            _after_a_failure(record)
