"""The contract between domains and the sandbox: what runs, and what came back.

A ``Job`` is files to lay into a fresh work folder plus the argv to run there. A
``JobResult`` is what came back: status, exit code, capped output, resource use, and the
JSON the job wrote to its result channel. Verdicts are computed from that JSON *outside*
the sandbox by the domain's verifier, never by code that ran inside it.

Result channel: an argv entry equal to ``RESULT_FD`` ("{result_fd}"). The executor opens
a pipe, passes its write end to the job, replaces the entry with the fd number and
parses what arrives there as the result. A harness that closes that fd in the child
running untrusted code gets a channel the untrusted code cannot write to (see
``components/sandbox/harness.py``).

A ``SessionJob`` is a multi-step job: lay out ``files``, run each of ``steps`` (a bash
script) as its own command in one sandbox session, then run ``check`` (a ``Job`` whose
files are written just before it, so the steps cannot have edited them) in the same work
folder. Its result is the check's, with the steps' exit codes and statuses added by the
host under ``result["steps"]``. ``flatten(job)`` is its one-process equivalent for
backends without sessions (the ``subprocess`` backend, trusted code only: there the
steps share the check's process tree and report no exit codes).

``Outcome`` is what a verifier reads: a status and the serialised result. Both a fresh
``JobResult`` and a stored ``Execution`` record are one, so a stored execution is
verified as it is, without converting it back. Not covered here: running jobs (that is
``components.sandbox``) and judging them (the domains' verifiers).
"""

from __future__ import annotations

import base64
import posixpath
import shlex
from dataclasses import dataclass, field
from typing import Any, Protocol

from components.core.records import Execution, ExecutionStatus, Rollout

PYTHON = "{python}"
RESULT_FD = "{result_fd}"


@dataclass(frozen=True)
class Job:
    job_id: str
    files: dict[str, str]  # relative path -> text, written into the work folder
    argv: list[str]  # run inside the work folder; "{python}" is replaced by the job interpreter
    timeout_s: float | None = None  # None: the executor's default
    stdin: str = ""

    @property
    def uses_result_fd(self) -> bool:
        return RESULT_FD in self.argv


@dataclass(frozen=True)
class SessionJob:
    job_id: str
    files: dict[str, str]  # laid out before the first step
    steps: list[str]  # bash scripts, one command each, run in order in the work folder
    check: Job  # runs last; its result channel is the SessionJob's result
    step_timeout_s: float | None = None  # per step; None: the executor's default


# Runs each step file in a subshell that cannot write to the result fd ($1), then writes
# the check's files afresh (from this script's own text, which no step can edit) and execs the check.
_FLAT = 'fd=$1; shift; for f in .steps/*.sh; do (if [ -n "$fd" ]; then eval "exec $fd>&-"; fi; bash "$f") </dev/null; done\n'


def never_starts(argv: list[str]) -> bool:
    """Whether a job of ``argv`` is refused before it starts or writes a file: an argument
    holds a NUL byte, which no program can be given (``execve`` takes C strings). Every
    backend reports such a job as ``failed``, exit 127; a session that sent its start files
    with it must send them again."""
    return any("\x00" in arg for arg in argv)


def flatten(job: SessionJob) -> Job:
    """The same steps and check as one process tree (no session, no per-step exit codes)."""
    script = _FLAT
    for rel, text in job.check.files.items():
        parent = posixpath.dirname(rel)
        encoded = base64.b64encode(text.encode()).decode()
        script += (f"mkdir -p -- {shlex.quote(parent)}; " if parent else "") + \
            f"rm -rf -- {shlex.quote(rel)}; printf %s {encoded} | base64 -d > {shlex.quote(rel)}\n"
    script += 'exec "$@"\n'
    files = {**job.files, **{f".steps/{i:03d}.sh": step for i, step in enumerate(job.steps)}}
    total = None  # the executor's default, unless the steps have their own limit (then the check keeps its time too)
    if job.step_timeout_s is not None:
        total = job.step_timeout_s * len(job.steps) + (job.check.timeout_s or 5.0)
    fd = RESULT_FD if job.check.uses_result_fd else ""
    return Job(job_id=job.job_id, files=files, argv=["bash", "-c", script, "flat", fd, *job.check.argv],
               timeout_s=total, stdin=job.check.stdin)


@dataclass(frozen=True)
class JobResult:
    status: ExecutionStatus
    exit_code: int
    signal: int
    stdout: str
    stderr: str
    duration_s: float
    cpu_time_s: float
    peak_memory_mb: float
    result: Any = None  # parsed JSON from the result channel, or None
    backend: str = ""
    isolation: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Outcome(Protocol):
    """What a verifier may read of an execution (a ``JobResult`` or an ``Execution``)."""

    @property
    def status(self) -> ExecutionStatus: ...

    @property
    def result(self) -> Any: ...


def to_execution(rollout: Rollout, result: JobResult) -> Execution:
    """The stored record of a rollout's job: the result is serialised once, here."""
    return Execution(
        rollout_id=rollout.rollout_id, task_id=rollout.task_id, domain=rollout.domain, backend=result.backend,
        isolation=result.isolation, status=result.status, exit_code=result.exit_code, signal=result.signal,
        stdout=result.stdout, stderr=result.stderr, duration_s=result.duration_s, cpu_time_s=result.cpu_time_s,
        peak_memory_mb=result.peak_memory_mb, result=result.result,
    )
