"""The stage host: a second process that imports the stage libraries while ``posttrain
run`` starts Airflow, and then runs that run's stages.

``posttrain run`` runs every stage of an iteration in one process, one after the other
(``dag.test()``). Its first seconds were one core's work: the interpreter, MLflow, the
Airflow home, ``dag.test()``'s plan and bootstrap tasks, and then taskgen importing
transformers and torch, while the other core idled. ``StageHost.start()`` forks a child
as soon as the home is locked; the child imports torch, transformers, MLflow's stores,
Great Expectations, matplotlib and the stage modules (``imports()``, one after the other,
until the first stage is waiting) while the parent does its Airflow work. Every in-process stage task of that run then hands its stage to the child
(``run``: ``run_stage``'s arguments over a pipe) and waits for the reply, so the imports
never sit on the iteration's critical path.

What stays as it was:

- the stage code, its MLflow run, its manifest and its output lines (the child writes to
  the same terminal; the parent is blocked while a stage runs, so lines do not mix);
- errors: the child sends back the exception the stage raised, as itself (any other
  than ``UserError``, ``InfraError`` and ``DataQualityError`` with the child's traceback
  as a note; one that does not survive pickling as ``StageHostError`` with its type,
  message and traceback), and the task turns it into the same Airflow outcome as before
  (fail at once, retry, or terminated);
- SIGTERM to ``posttrain run``: the parent forwards it to the child, whose stage run ends
  KILLED, and then stops as before; SIGINT (Ctrl-C) does the same;
- a kill: the child holds the home's lock with its parent and dies with it
  (``PR_SET_PDEATHSIG``), so a rerun never meets a stage still writing.

``posttrain run`` as its own process starts one; ``run_local`` called inside a larger
process (the tests) does not, since a fork would hide the stages' effects on that
process from it. ``POSTTRAIN_STAGE_HOST=0`` turns it off (every stage runs in the
``posttrain run`` process, as under ``posttrain stage``). A child that died (the kernel's OOM killer) is
not restarted: the stage that was running fails as an outage (retried by Airflow), and
later stages run in the parent. Not covered: a real scheduler's tasks (each is its own
process already, and ``PreloadingLocalExecutor`` preloads them), container and pod
stages, and Windows or macOS (no ``fork`` with ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection, Pipe
from typing import Any

from components.core.errors import DataQualityError, InfraError, UserError

log = logging.getLogger("posttrain")

ENV = "POSTTRAIN_STAGE_HOST"
STOP_WAIT_S = 60.0  # how long a stopped parent waits for the child to end the stage's run KILLED
PR_SET_PDEATHSIG = 1


class StageHostError(Exception):
    """A stage in the host raised an exception that cannot cross the pipe as itself (its
    type, message and the host's traceback are in the text)."""


def enabled() -> bool:
    """``POSTTRAIN_STAGE_HOST``: on when unset, empty, ``1``, ``on`` or ``true``; off for
    ``0``, ``off`` or ``false``; anything else is a UserError."""
    from components.core.settings import env_text

    raw = env_text(ENV)
    value = raw.lower()
    if value in ("", "1", "on", "true"):
        return True
    if value in ("0", "off", "false"):
        return False
    raise UserError(ENV, raw, "is neither on (1) nor off (0)", f"export {ENV}=1 (the default) or {ENV}=0, or unset it")


_current: StageHost | None = None


@contextlib.contextmanager
def hosting(wanted: bool = True) -> Iterator[StageHost | None]:
    """A stage host for the block when ``wanted`` and ``enabled()``; stopped and reaped when it ends."""
    host = StageHost.start() if wanted and enabled() else None
    try:
        yield host
    finally:
        if host is not None:
            host.stop()


def current() -> StageHost | None:
    """The host of this process's ``posttrain run``, if one is serving (never in the child)."""
    return _current if _current is not None and _current.alive() else None


class StageHost:
    """The parent's handle on the child: ``run`` a stage there, ``stop`` it."""

    def __init__(self, pid: int, conn: Connection) -> None:
        self.pid = pid
        self.conn = conn
        self._lock = threading.Lock()
        self._dead = False

    @classmethod
    def start(cls) -> StageHost:
        """Fork the child (it starts importing at once) and make it ``current()``."""
        global _current
        parent_end, child_end = Pipe(duplex=True)
        for stream in (sys.stdout, sys.stderr):  # or the child would write the parent's buffered lines again
            stream.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            parent_end.close()
            _serve(child_end, parent)
        child_end.close()
        _current = cls(pid, parent_end)
        return _current

    def alive(self) -> bool:
        return not self._dead

    def run(self, stage: str, recipe: str, run_root: str, iteration: int, shard: str | None,
            orchestrator_run_id: str) -> dict[str, Any]:
        """``run_stage`` in the child; what the task returns (shard, digest, promoted), or the
        stage's exception raised here."""
        from components.core import runner, tracking

        with self._lock:
            try:
                reply = self._wait(runner, (stage, recipe, run_root, iteration, shard, orchestrator_run_id))
            except (EOFError, OSError) as exc:  # the child died (the OOM killer): an outage, retried
                self._dead = True
                if runner.stopping():  # a SIGTERM to the process group ended it: this process stops too
                    raise tracking.Terminated(f"stopped by {runner.stop_signal().name}") from None
                raise InfraError("the stage host", f"pid {self.pid}", f"it ended while running {stage} ({exc!r}); "
                                 "the retry runs the stage in the posttrain run process") from exc
        kind, payload = reply
        if kind == "ok":
            return payload
        if kind == "terminated":
            raise tracking.Terminated(payload)
        raise pickle.loads(payload)

    def _wait(self, runner, request: tuple) -> tuple[str, Any]:
        """Send ``request`` and return the child's reply. A SIGTERM here, the sending included
        (``runner.stopping()``, or ``Terminated`` raised in this thread), or a Ctrl-C goes on
        to the child, which ends the stage's run KILLED (an idle child just exits); then
        the parent stops as it would have."""
        forwarded = False
        try:
            self.conn.send(request)
            while not self.conn.poll(0.2):
                if runner.stopping() and not forwarded:
                    os.kill(self.pid, signal.SIGTERM)
                    forwarded = True
            return self.conn.recv()
        except BaseException as exc:
            if isinstance(exc, (EOFError, OSError)):  # the child is gone: run() says so
                raise
            with contextlib.suppress(EOFError, OSError):  # a child that is gone cannot be told, nor answer
                if not forwarded:
                    os.kill(self.pid, signal.SIGTERM)
                if self.conn.poll(STOP_WAIT_S):
                    self.conn.recv()
            raise

    def stop(self) -> None:
        """End the child (idle between stages, or importing) and reap it."""
        global _current
        if _current is self:
            _current = None
        self.conn.close()
        with contextlib.suppress(ProcessLookupError, ChildProcessError):  # already gone, or already reaped
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        self._dead = True


def _serve(conn: Connection, parent: int) -> None:
    """The child's life: import, serve requests until the pipe closes, exit without cleanup."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches it through the parent, as SIGTERM
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(0)
        from components.core import runner

        runner.stop_on_sigterm()  # SIGTERM raises Terminated inside the stage: its run ends KILLED
        for name in imports():  # until the first stage arrives; later, each stage imports what it lacks
            if conn.poll(0):
                break
            _import(name)
        while True:
            conn.send(_serve_one(conn.recv()))
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    except BaseException:  # a SIGTERM between two stages, or our own bug: the parent sees the pipe close
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def imports() -> list[str]:
    """What the child imports: the scheduler's preload list without Airflow's part (the
    parent has that), then the stage modules."""
    from components.core.stages import registered
    from dags.local import PRELOAD

    return [n for n in PRELOAD if not n.startswith("dags.")] + [s.module for s in registered()]


def _import(name: str) -> None:
    from dags.local import import_name

    try:
        import_name(name)
    except Exception as exc:  # the stage that needs it reports the problem in its own words
        log.debug("stage host: cannot import %s (%s)", name, exc)


def task_result(stage: str, m) -> dict[str, Any]:
    """What a stage task returns (its XCom) for the stage's manifest ``m``."""
    return {"stage": stage, "shard": m.shard, "digest": m.content_digest, "promoted": m.info.get("promoted")}


def _serve_one(request: tuple) -> tuple[str, Any]:
    from components.core import runner, tracking

    stage, recipe, run_root, iteration, shard, orchestrator_run_id = request
    try:
        m = runner.run_stage(stage, recipe, run_root, iteration, shard, orchestrator_run_id=orchestrator_run_id)
        return "ok", task_result(stage, m)
    except tracking.Terminated as exc:
        return "terminated", str(exc)
    except BaseException as exc:
        return "error", _dumps(exc)
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()


def _dumps(exc: BaseException) -> bytes:
    """The exception as itself when it survives pickling, else as ``StageHostError``."""
    text = "".join(traceback.format_exception(exc))
    if not isinstance(exc, (UserError, InfraError, DataQualityError)):  # a bug: its traceback is the report
        exc.add_note(f"in the stage host:\n{text[-8000:]}")
    try:
        data = pickle.dumps(exc)
        if type(pickle.loads(data)) is type(exc):
            return data
    except Exception:
        pass
    return pickle.dumps(StageHostError(f"{type(exc).__name__}: {exc}\nin the stage host:\n{text[-8000:]}"))
