"""Turn what the host observed about a finished job into a ``JobResult``.

One place decides the status class (ok, failed, timeout, oom, killed, infra_error) for
every backend mode, from: the job's exit code or signal, whether the host hit the wall
clock, whether output flooded, the cgroup's OOM-kill count and the captured streams.
It also parses the result channel (JSON, size-capped) outside the sandbox.

Not covered: verdicts. Whether the job's *answer* is right is the domain verifier's job.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field
from typing import Any

from components.core.jobs import JobResult, never_starts
from components.sandbox.supervise import Watched


@dataclass
class Observed:
    seen: Watched  # the job's streams, and whether the host hit the wall clock or saw a flood
    exit_code: int  # as a shell reports it: 128+N when killed by signal N
    duration_s: float
    cpu_time_s: float
    peak_memory_mb: float
    signaled: int = 0  # signal number when known to be a signal, else 0
    oom_kills: int = 0
    timed_out: bool = False  # the job's own clock ran out (the warm worker's), besides the host's
    extra: dict[str, Any] = field(default_factory=dict)
    cgroup_peak_mb: float | None = None  # the job's cgroup memory peak, where one was measured
    cpu_limit_s: float = 0.0  # the job's RLIMIT_CPU (0: unknown), which a real SIGXCPU means it used up

    def text(self, name: str) -> str:
        """The stream as text, saying how many bytes the cap cut."""
        data, total = bytes(self.seen.data[name]), self.seen.total[name]
        text = data.decode("utf-8", errors="replace")
        return text + f"\n...[{total - len(data)} bytes cut]" if total > len(data) else text


def exit_of(returncode: int) -> tuple[int, int]:
    """(exit code as a shell reports it, signal) from a ``Popen.returncode`` (-N: signal N)."""
    return (128 - returncode, -returncode) if returncode < 0 else (returncode, 0)


def parse_result(raw: bytes, total: int, cap: int) -> tuple[Any, str]:
    """(parsed JSON or None, problem or ''). Whatever the job wrote gives one of the two:
    nesting too deep for the parser and integers past Python's digit limit are problems
    too, not exceptions (the job's result, not the sandbox, is at fault)."""
    if total == 0:
        return None, "no result written"
    if total > cap:
        return None, f"result larger than {cap} bytes"
    try:
        return json.loads(raw.decode("utf-8")), ""
    except RecursionError:
        return None, "result is not JSON we read: nested too deep"
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer past the digit limit
        return None, f"result is not JSON: {str(exc)[:200]}"


def status_of(obs: Observed) -> tuple[str, int]:
    """(status, signal).

    What the host knows for certain decides first: its wall clock, the cgroup's OOM
    kills, an output flood. Past that a job's own exit code can pass for a signal: bwrap
    (strict mode) reports a job killed by signal N as exit 128+N, its ``--json-status-fd``
    too, so an exit code 128+N reads as signal N in every mode (warm mode, which sees the
    real wait status, reads it the same way, so the modes agree). Two cheap checks narrow
    what a program can pick: 152 is ``SIGXCPU`` (``timeout``) only when the job's CPU time
    reached its ``RLIMIT_CPU`` (``cpu_limit_s``), else it is an exit code (``failed``, signal
    0), whether the job exited 152 or sent itself ``SIGXCPU``; and a ``MemoryError`` is an
    ``oom`` only as the last line of the kept stderr (a traceback's end), not anywhere in it.
    Not covered: ``exit 137`` reads as ``killed`` by ``SIGKILL`` (as ``kill -9 $$`` does),
    and a program can still print ``MemoryError`` as its last line and exit 1 (``oom``);
    no status is a verdict (the domain's verifier decides that)."""
    sig = obs.signaled or (obs.exit_code - 128 if 128 < obs.exit_code < 128 + 65 else 0)
    if sig == signal.SIGXCPU and obs.cpu_limit_s and obs.cpu_time_s < obs.cpu_limit_s - 0.5:
        sig = 0  # the job never used its CPU limit: an exit code, not the kernel's SIGXCPU
    if obs.timed_out or obs.seen.timed_out or sig == signal.SIGXCPU:
        return "timeout", sig
    if obs.oom_kills > 0:
        return "oom", sig
    if obs.seen.flooded or sig:
        return "killed", sig
    if obs.exit_code != 0 and last_line(obs.seen.data["stderr"]).startswith(b"MemoryError"):
        return "oom", 0
    return ("ok" if obs.exit_code == 0 else "failed"), 0


def last_line(data: bytes | bytearray) -> bytes:
    """The last line of ``data`` that is not blank, stripped (b"" when there is none)."""
    return bytes(data).rstrip().rsplit(b"\n", 1)[-1].strip()


def to_result(obs: Observed, backend: str, isolation: str, result_cap: int) -> JobResult:
    """The one place a ``JobResult`` is built from a finished job (every backend); the
    result channel is parsed when the job had one (a ``result`` stream)."""
    status, sig = status_of(obs)
    extra = dict(obs.extra)
    if obs.cgroup_peak_mb is not None:
        extra["cgroup_peak_memory_mb"] = round(obs.cgroup_peak_mb, 1)
    result = None
    if "result" in obs.seen.data:
        result, problem = parse_result(bytes(obs.seen.data["result"]), obs.seen.total["result"], result_cap)
        if problem:
            extra["result_problem"] = problem
    if obs.seen.flooded:
        extra["reason"] = "output flood"
    return JobResult(
        status=status, exit_code=obs.exit_code, signal=int(sig), stdout=obs.text("stdout"),
        stderr=obs.text("stderr"), duration_s=obs.duration_s, cpu_time_s=obs.cpu_time_s,
        peak_memory_mb=obs.peak_memory_mb, result=result, backend=backend, isolation=isolation, extra=extra,
    )


def infra_error(why: str, backend: str, isolation: str) -> JobResult:
    return JobResult(status="infra_error", exit_code=-1, signal=0, stdout="", stderr=why, duration_s=0.0,
                     cpu_time_s=0.0, peak_memory_mb=0.0, backend=backend, isolation=isolation)


def session_setup_failed(stderr: str, duration_s: float, backend: str, isolation: str) -> JobResult:
    """A session's later job (a step, an episode's action, the final check) that could not
    be set up in ``/work`` (its files not written, no way in): the session's own earlier
    commands left ``/work`` so (``chmod 000``, filled it), which is the policy's doing, so
    status ``failed``, exit 126 as a shell's "cannot execute", not an ``infra_error``
    (retried, then left out of training: a policy could drop its own bad episodes so).
    The first job of a session lays out a fresh ``/work``; its setup failing stays an
    ``infra_error``."""
    why = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or ["job setup failed"]
    return JobResult(status="failed", exit_code=126, signal=0, stdout="",
                     stderr=f"cannot set the job up in /work, as the session's earlier commands left it: {why[0][:500]}\n",
                     duration_s=duration_s, cpu_time_s=0.0, peak_memory_mb=0.0, backend=backend, isolation=isolation)


NUL_ARGUMENT = "NUL byte in an argument"


def nul_argument(job, backend: str, isolation: str) -> JobResult | None:
    """The result of a job with a NUL byte in an argument, which no program can be given
    (``execve`` takes C strings): status ``failed``, exit 127 and why, as a shell reports a
    command it cannot run, in every mode, without starting anything. None for any other
    job (``jobs.never_starts``). (A session step or episode action the policy wrote can
    hold a NUL.)"""
    if not never_starts(job.argv):
        return None
    index = next(i for i, arg in enumerate(job.argv) if "\x00" in arg)
    program = job.argv[0].replace("\x00", "\\0")[:200]
    return JobResult(status="failed", exit_code=127, signal=0, stdout="",
                     stderr=f"cannot run {program}: argument {index} holds a NUL byte, which no program can be given\n",
                     duration_s=0.0, cpu_time_s=0.0, peak_memory_mb=0.0, backend=backend, isolation=isolation,
                     extra={"reason": NUL_ARGUMENT})


NOT_UTF8 = "text that is not UTF-8"


def _surrogate(text: str) -> str | None:
    """``U+XXXX`` for the first code point of ``text`` that UTF-8 cannot encode (a surrogate,
    such as ``"\\ud800"``); None when all of it can."""
    if text.isascii():
        return None
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        return f"U+{ord(text[exc.start]):04X}"
    return None


def not_utf8(job, backend: str, isolation: str) -> JobResult | None:
    """The result of a job whose argument, file name, file contents or stdin holds a code
    point UTF-8 cannot encode (a lone surrogate, ``"\\ud800"``), which cannot reach the
    sandbox as bytes: status ``failed``, exit 127 and where, as ``nul_argument`` says it,
    in every mode, without starting anything. (Before, strict mode raised
    ``UnicodeEncodeError`` out of ``run`` and warm mode gave an ``infra_error``: retried as
    an outage, then left out.) None for any other job."""
    def texts():
        for index, arg in enumerate(job.argv):
            yield f"argument {index}", arg
        for rel, text in job.files.items():
            yield f"file name {rel}", rel
            yield f"file {rel}", text
        yield "stdin", job.stdin

    for where, text in texts():
        if (found := _surrogate(text)) is not None:
            program, where = (shown.encode(errors="backslashreplace").decode()[:200] for shown in (job.argv[0], where))
            return JobResult(status="failed", exit_code=127, signal=0, stdout="",
                             stderr=f"cannot run {program}: {where} holds {found}, a surrogate, which is not UTF-8 text\n",
                             duration_s=0.0, cpu_time_s=0.0, peak_memory_mb=0.0, backend=backend, isolation=isolation,
                             extra={"reason": NOT_UTF8})
    return None


def refused(result: JobResult) -> bool:
    """Whether ``result`` is that of a job refused before anything started (``nul_argument``,
    ``not_utf8``): it wrote none of its files (a session sends them again with its next job)."""
    return result.extra.get("reason") in (NUL_ARGUMENT, NOT_UTF8)


def cannot_exec(program: str, why: str, backend: str, isolation: str) -> JobResult:
    """The result of a job whose program ``execve`` refused before it ran for a reason of
    the job's own (E2BIG: an argument past 128 KiB, or argv past ``ARG_MAX``): status
    ``failed``, exit 127, ``cannot run PROGRAM: WHY`` on stderr, as the warm worker says
    when its exec fails (zygote.py's ``job_main``), so every mode gives the same result."""
    return JobResult(status="failed", exit_code=127, signal=0, stdout="",
                     stderr=f"cannot run {program[:200]}: {why}\n", duration_s=0.0,
                     cpu_time_s=0.0, peak_memory_mb=0.0, backend=backend, isolation=isolation)
