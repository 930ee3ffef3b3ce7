"""``posttrain kfp-local``: iterations of the Kubeflow pipeline on this machine (``kfp.local``).

The driver ``dags.orchestrate.run_local`` takes for ``posttrain kfp-local``: each
iteration is one run of ``pipelines/post_training_iteration.py`` under
``kfp.local.SubprocessRunner`` (each task a subprocess of this interpreter, no
containers). Everything around the runs is ``posttrain run``'s: the checks before any
work (a bad recipe, task file, run root or setting is one line and exit 2; handed to the
pipeline itself, KFP would retry it with backoff, a traceback per attempt, since it
cannot tell a user's mistake from an outage), the home's lock, the pipeline's writer
lease, the planner, and the eval table after each iteration. The pipeline's ``holder``
parameter is the run's own (``local:<home>``), so every task finds the iteration this
process leased, and a rerun after a failure resumes it.

A task's UserError (a mistake only a stage can see) or failed data-quality gate comes
back through the file ``POSTTRAIN_KFP_USER_ERROR`` names (``<home>/kfp/user-error.json``,
written by the component body): once KFP's retries of that task are spent, the command
ends with the task's line and exit 2 (3 for the gate), as ``posttrain run`` does.

Stopping: SIGTERM to this process alone is passed on to the task subprocess that runs
(kfp.local waits for it otherwise, however long its stage takes), whose stage ends its
MLflow run KILLED and writes no manifest; the command then says it was stopped (exit
143), and the same command resumes the iteration. Ctrl-C reaches the tasks as part of
the terminal's process group. Not covered: a task's own children other than the sandbox
(which dies with its parent).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from components.core.errors import final_error_from_json
from components.core.progress import say

NAME = "Kubeflow pipeline"
STAGES_IN_PROCESS = False
"""Each task is a subprocess of kfp.local: no stage host, torch threads as ``posttrain stage`` sets them."""

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
USER_ERROR_VAR = "POSTTRAIN_KFP_USER_ERROR"  # read by the component body, pipelines/post_training_iteration.py
_USER_ERROR_FILE: Path | None = None  # <home>/kfp/user-error.json, set by prepare()


def prepare(home: Path, sandbox_slots: int) -> None:
    """Point kfp.local at a pipeline root in the home (``<home>/kfp``); kfp.local has no
    sandbox pool (``sandbox_slots`` is the DAG's)."""
    import kfp.local

    global _USER_ERROR_FILE
    (home / "kfp").mkdir(parents=True, exist_ok=True)
    _USER_ERROR_FILE = home / "kfp" / "user-error.json"
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(home / "kfp"),
                   raise_on_error=True)


def final_errors() -> list[BaseException]:
    """Always empty: the tasks run in subprocesses, whose errors end the run as failed tasks."""
    return []


@contextlib.contextmanager
def process_state_restored() -> Iterator[None]:
    """Around a kfp.local run: it swaps the root logger's handlers per task, from several
    threads at once under a ParallelFor, and can leave one of its own behind; the same race
    leaves ``builtins.print`` wrapped in its ``indented_print`` (4 spaces before every
    print, to stdout even for ``file=sys.stderr``, 4 more per leaked wrap). Both are put
    back as they were."""
    root = logging.getLogger()
    handlers, level, printer = root.handlers[:], root.level, builtins.print
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        builtins.print = printer


def run_iteration(recipe_path: str, run_root: str, holder: str) -> str:
    """One pipeline run for the iteration ``holder`` has leased; "success" or "failed" (the
    failing task's log and kfp.local's line are printed above)."""
    from pipelines.post_training_iteration import post_training_iteration

    assert _USER_ERROR_FILE is not None, "prepare() first"
    error = _USER_ERROR_FILE
    error.unlink(missing_ok=True)  # only this run's tasks speak for its failure
    before = os.environ.get(USER_ERROR_VAR)
    os.environ[USER_ERROR_VAR] = str(error)  # the task subprocesses inherit it; put back after the run
    try:
        with process_state_restored(), _sigterm_reaches_the_tasks():
            post_training_iteration(recipe=recipe_path, run_root=run_root, holder=holder)
    except RuntimeError as exc:  # kfp.local's "Pipeline '...' finished with status FAILURE", in colour
        text = _COLOUR.sub("", str(exc)).strip()
        say(f"kfp.local: {text.splitlines()[0] if text else 'a task failed'}")
        if error.exists():
            raise final_error_from_json(error.read_text()) from None
        return "failed"
    finally:
        if before is None:
            os.environ.pop(USER_ERROR_VAR, None)
        else:
            os.environ[USER_ERROR_VAR] = before
    return "success"


@contextlib.contextmanager
def _sigterm_reaches_the_tasks():
    """While a pipeline runs, SIGTERM is first sent on to the task kfp.local waits for (the
    component's Python process, under the ``sh -c`` wrapper KFP runs it in, which would die
    at once and leave it running), and this process waits up to ``_TASK_STOP_S`` for the
    task to end its stage; then this process's own handler runs. Off the main thread, or
    where SIGTERM is ignored, nothing changes."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous == signal.SIG_IGN:
        yield
        return

    def forward(signum: int, frame) -> None:
        import psutil

        tasks = []
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.Error):
                tasks += child.children() if child.name() in _SHELLS else [child]
        for task in tasks:
            with contextlib.suppress(psutil.Error):
                task.send_signal(signum)
        psutil.wait_procs(tasks, timeout=_TASK_STOP_S)
        if callable(previous):
            previous(signum, frame)
        else:  # the default action: end this process, as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_SHELLS = {"sh", "dash", "bash"}
_TASK_STOP_S = 60  # a stage ends its MLflow run KILLED in well under a second
