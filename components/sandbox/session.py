"""Multi-turn sandbox sessions: one sandbox kept alive across several commands.

``SandboxSession(config)`` starts one warm worker (pool.Worker) in session mode: /work
and /tmp persist between commands, so an agent episode can write a file in one turn
and run it in the next. Each ``exec(cmd)`` runs in its own pid/mount/ipc namespace
under a job's rlimits, seccomp filter and wall clock, in the session worker's cgroup
(one group for the whole session, sized as a worker starts: ``memory_mb`` + ``work_mb``
+ ``tmp_mb`` + 128 MiB; a warm job's group is fitted to ``memory_mb``); processes it
starts die when it returns. The session is closed by ``close()``, by leaving its
``with`` block, or when ``session_timeout_s`` runs out (later ``exec`` calls then
return a ``timeout`` result without running anything). A command that takes the
session's sandbox down with it (an output flood, a wall-clock backstop kill) closes it
too: later ``exec`` calls return ``killed`` (``infra_error`` when that command's was one),
with ``extra.reason`` what killed it and ``extra.killed_with_command`` that command's
number, without running anything. A session whose worker cannot start (it did not come
up in time, no fds) is an ``InfraError`` from ``SessionPool.open()`` and
``SandboxSession()``, as a warm job's is an ``infra_error``.

``run_session_job(config, job)`` runs a ``SessionJob`` (core/jobs.py) in one session:
the setup files, each step as its own ``exec``, then the check (backends without
sessions run ``core.jobs.flatten(job)`` instead). A warm executor passes its
``SessionPool``: the session then runs on a kept worker, reset between sessions, instead
of a sandbox started for it. ``SessionPool.open()`` hands out such a session directly:
the rollout stage's multi-turn episodes take theirs that way (found by backend name in
``components.core.sessions.SESSIONS``).

Not covered: background processes that outlive one command (use one ``exec`` for a
server and its client), network access, sessions that survive the host process.
"""

from __future__ import annotations

import atexit
import threading
import time
from dataclasses import replace

from components.core.errors import InfraError
from components.core.jobs import Job, JobResult, SessionJob
from components.sandbox.bwrap import host_support
from components.sandbox.detect import Support
from components.sandbox.executor import Closing
from components.sandbox.limits import Limits
from components.sandbox.outcome import infra_error, refused
from components.sandbox.pool import Worker, WorkerDied

DEFAULT_SESSION_TIMEOUT_S = 600.0


def session_support(config) -> tuple[str, Support]:
    """``host_support``, refusing hosts without bubblewrap namespaces (``UserError``)."""
    from components.core.errors import UserError

    python, support = host_support(config)
    if not support.bwrap or not support.namespaces_ok:
        raise UserError("sandbox.backend", "bwrap", "sessions need bubblewrap namespaces, which this host lacks",
                        "install bubblewrap and allow unprivileged user namespaces (see components/sandbox/README.md)")
    return python, support


def start_worker(support: Support, python: str, limits: Limits, isolation: str) -> Worker:
    """A started session worker; ``InfraError`` when it could not start (``WorkerDied``: it did
    not come up in time or died starting; ``OSError``: no fds, no memfd), as a warm job
    whose worker cannot start is an ``infra_error`` (``WarmPool._new``): the rollout stage's
    and the eval suite's episodes end on it with "unreachable" and exit status 1 (retried),
    not a traceback. ``InfraError`` from the worker's lease (no uid, no cgroup) passes as is."""
    try:
        return Worker(support, python, limits, isolation, session=True)
    except (WorkerDied, OSError) as exc:
        raise InfraError("sandbox session", isolation, str(exc)) from exc


class SessionPool:
    """Session workers kept between sessions, at most ``size`` idle (a warm executor's
    ``SessionJob``s). A worker given back is reset (fresh ``/work`` and ``/tmp``) before it
    waits for the next session, so an idle worker holds no session's files; one that is
    dead or fails the reset is closed. Workers start on demand."""

    def __init__(self, config, size: int) -> None:
        self.config = config
        self.python, self.support = session_support(config)
        self.isolation = self.support.isolation + "+mode:session"
        self.limits = Limits.from_config(config)
        self.size = size
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)  # as WarmPool: idle workers' leases and cgroups go at exit too

    def take(self) -> Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return start_worker(self.support, self.python, self.limits, self.isolation)

    def open(self, session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S) -> SandboxSession:
        """A session on a worker of this pool (given back, reset, when the session closes)."""
        return SandboxSession(self.config, session_timeout_s=session_timeout_s, pool=self)

    def __enter__(self) -> SessionPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def give_back(self, worker: Worker) -> None:
        if worker.alive and not self._closed and worker.reset():
            with self._lock:
                if not self._closed and len(self._idle) < self.size:
                    self._idle.append(worker)
                    return
        worker.close()

    def close(self) -> None:
        atexit.unregister(self.close)
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()


class SandboxSession(Closing):
    name = "bwrap"

    def __init__(self, config, session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S,
                 pool: SessionPool | None = None) -> None:
        """``pool``: take the session's worker from it and give it back (reset) on close,
        instead of starting and stopping a sandbox of its own."""
        self.config = config
        self.limits = Limits.from_config(config)
        self._pool = pool
        if pool is not None:
            self.isolation = pool.isolation
            self._worker: Worker | None = pool.take()
        else:
            python, support = session_support(config)
            self.isolation = support.isolation + "+mode:session"
            self._worker = start_worker(support, python, self.limits, self.isolation)
        self._lock = threading.Lock()
        self._expires = time.monotonic() + session_timeout_s
        self._timer = threading.Timer(session_timeout_s, self.close)
        self._timer.daemon = True
        self._timer.start()
        self.commands = 0
        self._killed: dict | None = None  # command, reason, status: why the sandbox died under a command

    @property
    def closed(self) -> bool:
        return self._worker is None

    def exec(self, cmd: str | list[str], timeout_s: float | None = None, files: dict[str, str] | None = None,
             stdin: str = "") -> JobResult:
        """Run ``cmd`` (a bash command line, or an argv list) in the session's /work."""
        left = self._expires - time.monotonic()
        with self._lock:
            if self._killed is not None:  # what killed it, not a timeout the session never reached
                command, reason, status = self._killed["command"], self._killed["reason"], self._killed["status"]
                closed = infra_error(f"sandbox session is closed: its sandbox was killed with command {command} "
                                     f"({reason})", self.name, self.isolation)
                return replace(closed, status=status, extra={"reason": reason, "killed_with_command": command})
            if self._worker is None or left <= 0:
                self._close_locked()
                closed = infra_error("sandbox session is closed (ended or ran out of time)", self.name, self.isolation)
                return replace(closed, status="timeout")
            self.commands += 1
            argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
            timeout = min(timeout_s if timeout_s is not None else float(self.config.timeout_s), left)
            job = Job(job_id=f"session-{self.commands}", files=dict(files or {}), argv=argv, stdin=stdin,
                      timeout_s=timeout)
            result = self._worker.run(job, self.name)
            if not self._worker.alive:
                reason = result.extra.get("reason") or result.status  # "output flood", "timeout", "killed"...
                # the host's failure stays one for later commands (retried); anything else was the policy's doing
                status = "infra_error" if result.status == "infra_error" else "killed"
                self._killed = {"command": self.commands, "reason": reason, "status": status}
                self._close_locked()
            return result

    def _close_locked(self) -> None:
        if self._worker is not None:
            if self._pool is not None:
                self._pool.give_back(self._worker)
            else:
                self._worker.close()
            self._worker = None

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._close_locked()


def run_session_job(config, job: SessionJob, session_timeout_s: float | None = None,
                    pool: SessionPool | None = None) -> JobResult:
    """Steps then check, in one sandbox session; the host adds each step's exit code and
    status to the check's result (``result["steps"]``), so nothing inside can forge them.
    ``pool``: the session runs on a pooled worker (see ``SessionPool``)."""
    budget = session_timeout_s or (len(job.steps) + 2) * float(job.step_timeout_s or config.timeout_s) + 30.0
    done: list[JobResult] = []
    laid_out = False  # a step refused before it starts (a NUL, text not UTF-8) writes no file: the next one takes them
    with SandboxSession(config, session_timeout_s=budget, pool=pool) as session:
        for step in job.steps:
            argv = ["bash", "-c", step]
            done.append(session.exec(argv, timeout_s=job.step_timeout_s, files=None if laid_out else job.files))
            laid_out = laid_out or not refused(done[-1])
            if done[-1].status == "infra_error":
                return done[-1]
        check = job.check
        final = session.exec(list(check.argv), timeout_s=check.timeout_s,
                             files={**({} if laid_out else job.files), **check.files}, stdin=check.stdin)
    steps = [{"exit": r.exit_code, "status": r.status} for r in done]
    result = {**final.result, "steps": steps} if isinstance(final.result, dict) else final.result
    done.append(final)
    return replace(final, duration_s=sum(r.duration_s for r in done), cpu_time_s=sum(r.cpu_time_s for r in done),
                   peak_memory_mb=max(r.peak_memory_mb for r in done), result=result, isolation=session.isolation)
