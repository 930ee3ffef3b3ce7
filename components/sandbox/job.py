"""What the sandbox runs and what it hands back.

A ``Job`` is files to lay into a fresh work folder plus the argv to run there. A
``JobResult`` is what came back: status, exit code, capped output, resource use, and the
JSON the job wrote to its result channel. Verdicts are computed from that JSON *outside*
the sandbox by the domain's verifier, never by code that ran inside it.

Result channel: either ``result_file`` (a file in the work folder; any code in the job
can overwrite it) or, preferred, an argv entry equal to ``RESULT_FD`` ("{result_fd}"):
the executor then opens a pipe, passes its write end to the job, replaces the entry with
the fd number and parses what arrives there as the result (``result_file`` is ignored).
A harness that closes that fd in the child running untrusted code gets a channel the
untrusted code cannot write to (see harness.py).

A ``SessionJob`` is a multi-step job: lay out ``files``, run each of ``steps`` (a bash
script) as its own command in one sandbox session (``session.run_session_job``), then
run ``check`` (a ``Job`` whose files are written just before it, so the steps cannot
have edited them) in the same work folder. Its result is the check's, with the steps'
exit codes and statuses added by the host under ``result["steps"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PYTHON = "{python}"
RESULT_FD = "{result_fd}"


@dataclass(frozen=True)
class Job:
    job_id: str
    files: dict[str, str]  # relative path -> text, written into the work folder
    argv: list[str]  # run inside the work folder; "{python}" is replaced by the job interpreter
    result_file: str = ""  # a file in the work folder the job writes JSON results to
    timeout_s: float | None = None  # None: the executor's default
    stdin: str = ""

    @property
    def uses_result_fd(self) -> bool:
        return RESULT_FD in self.argv

    @property
    def wants_result(self) -> bool:
        return self.uses_result_fd or bool(self.result_file)


@dataclass(frozen=True)
class SessionJob:
    job_id: str
    files: dict[str, str]  # laid out before the first step
    steps: list[str]  # bash scripts, one command each, run in order in the work folder
    check: Job  # runs last; its result channel is the SessionJob's result
    step_timeout_s: float | None = None  # per step; None: the executor's default


@dataclass(frozen=True)
class JobResult:
    status: str  # ok | failed | timeout | oom | killed | infra_error
    exit_code: int
    signal: int
    stdout: str
    stderr: str
    duration_s: float
    cpu_time_s: float
    peak_memory_mb: float
    result: Any = None  # parsed JSON from the result file, or None
    backend: str = ""
    isolation: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
