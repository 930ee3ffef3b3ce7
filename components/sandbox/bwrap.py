"""The ``bwrap`` backend: each job in a bubblewrap sandbox, refusing weak isolation.

``sandbox.mode``: "strict" starts a fresh sandbox per job (strict.py; the launch for
the next job of the same shape is parked ahead of time); "warm" keeps one pre-started sandboxed worker per concurrency slot that forks a child
per job in fresh per-job namespaces (pool.py); a ``SessionJob`` runs in a sandbox
session (session.py). All record the isolation string from
detect.py in every ``JobResult.isolation``.

On start the executor probes the host. If a required layer is missing it raises a
``UserError`` naming ``sandbox.allow_weak_isolation``; with that flag set it runs with
what there is (no seccomp, or the subprocess backend when there are no namespaces) and
says "WEAK" in the isolation string.

Not covered: jobs that need the network, host folders, GPUs or a different root image;
interpreters outside /usr (the sandbox sees only /usr and a few /etc files).
"""

from __future__ import annotations

from components.core.jobs import Job, JobResult, SessionJob
from components.sandbox import cgroups
from components.sandbox.detect import probe, require, resolve_python
from components.sandbox.executor import Closing
from components.sandbox.limits import Limits
from components.sandbox.strict import StrictRunner
from components.sandbox.subprocess_backend import SubprocessExecutor


class BwrapExecutor(Closing):
    """Executor protocol: ``name``, ``isolation``, ``run(job)``, ``close()``; a context manager."""

    name = "bwrap"

    def __init__(self, config) -> None:
        self.config = config
        self.python = resolve_python(config)
        self.mode = getattr(config, "mode", "strict")
        self.support = probe(self.python)
        require(self.support, bool(getattr(config, "allow_weak_isolation", False)))
        cgroups.sweep_stale()
        self.limits = Limits.from_config(config)
        self._fallback = self._pool = self._strict = None
        if not self.support.bwrap or not self.support.namespaces_ok:
            self._fallback = SubprocessExecutor(config)
            self.isolation = self._fallback.isolation = self.support.isolation
            return
        self.isolation = self.support.isolation + f"+mode:{self.mode}"
        if self.mode == "warm":
            from components.sandbox.pool import WarmPool

            self._pool = WarmPool(self.support, self.python, self.limits, int(config.concurrency), self.isolation)
        self._strict = StrictRunner(self.support, self.python, self.limits, self.support.seccomp, self.isolation)

    def run(self, job: Job | SessionJob) -> JobResult:
        if self._fallback is not None:
            return self._fallback.run(job)
        if isinstance(job, SessionJob):
            from components.sandbox.session import run_session_job

            return run_session_job(self.config, job)
        if self._pool is not None:
            return self._pool.run(job, self.name)
        return self._strict.run(job, self.name)

    def close(self) -> None:
        if self._strict is not None:
            self._strict.close()
        cgroups.REAPER.drain()
        if self._pool is not None:
            self._pool.close()
        if self._fallback is not None:
            self._fallback.close()
