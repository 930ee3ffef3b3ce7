"""The ``bwrap`` backend: each job in a bubblewrap sandbox, refusing weak isolation.

``sandbox.mode``: "strict" starts a fresh sandbox per job (strict.py; the launch for
the next job of the same shape is parked ahead of time); "warm" keeps one pre-started
sandboxed worker per concurrency slot that forks a child per job in fresh per-job
namespaces (pool.py); a ``SessionJob`` runs in a sandbox session (session.py: in warm
mode on a session worker kept by the executor and reset between sessions). All
record the isolation string from detect.py in every ``JobResult.isolation``.

On start the executor, like a session, probes the host (``host_support``). If a required
layer is missing it raises a ``UserError`` naming ``sandbox.allow_weak_isolation``; with
that flag set it runs with what there is (no seccomp, or the subprocess backend when
there are no namespaces) and says "WEAK" in the isolation string. A probe that could not
be set up for a reason of the moment (no free uid, no cgroup, no memory or fds) raises
``InfraError`` instead (detect.py), neither refused nor run weak.

Not covered: jobs that need the network, host folders, GPUs or a different root image;
interpreters outside /usr (the sandbox sees only /usr and a few /etc files; such a
``sandbox.python`` is refused when the recipe loads, a missing or unrunnable one before
``posttrain run`` does any work: ``dags.orchestrate.check_before_run``).
"""

from __future__ import annotations

import os

from components.core.jobs import Job, JobResult, SessionJob
from components.sandbox import cgroups
from components.sandbox.detect import DEFAULT_PYTHON, Support, probe, resolve_python
from components.sandbox.executor import Closing
from components.sandbox.limits import Limits
from components.sandbox.strict import StrictRunner
from components.sandbox.subprocess_backend import SubprocessExecutor


def host_support(config) -> tuple[str, Support]:
    """The job interpreter and what this host gives it, for the executor and for sessions
    (session.py): a ``UserError`` naming ``sandbox.python`` when the interpreter is at fault
    (``resolve_python``; or the probe sandbox fails with it but works with
    ``DEFAULT_PYTHON``), else one naming ``sandbox.allow_weak_isolation`` when a required
    layer is missing, unless the recipe allows weak isolation."""
    from components.core.errors import UserError
    from components.core.recipe import SANDBOX_PYTHON_FIX

    python = resolve_python(config)
    support = probe(python)
    if not support.namespaces_ok and support.bwrap and python != DEFAULT_PYTHON and os.path.exists(DEFAULT_PYTHON) \
            and probe(DEFAULT_PYTHON).namespaces_ok:
        # The host's sandbox works, with the default interpreter: this one fails inside it
        # (a library outside /usr, say). Blaming the host would advise weak isolation, and
        # with it allowed the jobs would run unsandboxed for an interpreter's sake.
        detail = "; ".join(support.problems)
        raise UserError("sandbox.python", python, "runs on the host but not inside the bwrap sandbox, where "
                        f"{DEFAULT_PYTHON} does" + (f" ({detail})" if detail else ""), SANDBOX_PYTHON_FIX)
    if support.missing and not getattr(config, "allow_weak_isolation", False):
        detail = "; ".join(support.problems)
        raise UserError(
            "sandbox.allow_weak_isolation", False,
            f"this host lacks {', '.join(support.missing)} for the bwrap sandbox" + (f" ({detail})" if detail else ""),
            "install what is missing (see 'Threat model' in components/sandbox/README.md), or set "
            "sandbox.allow_weak_isolation: true to run untrusted code with weaker isolation",
        )
    return python, support


class BwrapExecutor(Closing):
    """Executor protocol: ``name``, ``isolation``, ``run(job)``, ``close()``; a context manager."""

    name = "bwrap"

    def __init__(self, config) -> None:
        self.config = config
        self.python, self.support = host_support(config)
        self.mode = getattr(config, "mode", "strict")
        cgroups.sweep_stale()
        self.limits = Limits.from_config(config)
        self._fallback = self._runner = self._sessions = None
        if not self.support.bwrap or not self.support.namespaces_ok:
            self._fallback = SubprocessExecutor(config)
            self.isolation = self._fallback.isolation = self.support.isolation
            return
        self.isolation = self.support.isolation + f"+mode:{self.mode}"
        if self.mode == "warm":
            from components.sandbox.pool import WarmPool
            from components.sandbox.session import SessionPool

            self._runner = WarmPool(self.support, self.python, self.limits, int(config.concurrency), self.isolation)
            self._sessions = SessionPool(config, int(config.concurrency))
        else:
            self._runner = StrictRunner(self.support, self.python, self.limits, self.isolation)

    def run(self, job: Job | SessionJob) -> JobResult:
        if self._fallback is not None:
            return self._fallback.run(job)
        if isinstance(job, SessionJob):
            from components.sandbox.session import run_session_job

            return run_session_job(self.config, job, pool=self._sessions)
        return self._runner.run(job, self.name)

    def close(self) -> None:
        for part in (self._runner, self._sessions, self._fallback):
            if part is not None:
                part.close()
        cgroups.REAPER.drain()  # strict: a parked launch's group is removed on the reaper's thread
