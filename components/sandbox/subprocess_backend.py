"""The ``subprocess`` backend: process-level containment only, for trusted code.

Each job gets a fresh temp work folder, its own session (so a timeout kills the whole
tree), rlimits for CPU time, address space, file size and open files, capped output,
the result pipe (``{result_fd}``); the job's argv runs as given (the domains' Python
jobs pass ``-I`` themselves). It is watched and turned into
a ``JobResult`` exactly as a bwrap job is (``supervise.watch_process``,
``outcome.to_result``). A ``SessionJob`` runs flattened (``core.jobs.flatten``).

It is NOT isolation from the host: the job can read what the user can read and reach
the network, so it refuses to start unless ``sandbox.allow_weak_isolation`` is set.
Not covered: cgroups, namespaces, seccomp (that is the bwrap backend).
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from components.core.jobs import PYTHON, RESULT_FD, Job, JobResult, SessionJob, flatten
from components.sandbox.command import memfd_with
from components.sandbox.detect import DEFAULT_PYTHON, check_paths
from components.sandbox.executor import Closing
from components.sandbox.limits import Limits
from components.sandbox.outcome import Observed, cannot_exec, exit_of, infra_error, not_utf8, nul_argument, to_result
from components.sandbox.supervise import job_streams, kill_tree, watch_process


class SubprocessExecutor(Closing):
    name = "subprocess"
    isolation = "process+rlimits"

    def __init__(self, config) -> None:
        from components.core.errors import UserError

        # Process-level containment only: refuse untrusted code unless the recipe says so.
        if not getattr(config, "allow_weak_isolation", False):
            raise UserError("sandbox.allow_weak_isolation", False,
                            "backend 'subprocess' gives no namespace isolation (weaker than the 'bwrap' backend)",
                            "use sandbox.backend: bwrap, or set sandbox.allow_weak_isolation: true for trusted code")
        self.python = config.python or (DEFAULT_PYTHON if os.path.exists(DEFAULT_PYTHON) else shutil.which("python3") or "python3")
        self.limits = Limits.from_config(config)

    def run(self, job: Job | SessionJob) -> JobResult:
        if isinstance(job, SessionJob):
            job = flatten(job)
        check_paths(job)
        if (refused := nul_argument(job, self.name, self.isolation) or not_utf8(job, self.name, self.isolation)) is not None:
            return refused
        limits = self.limits if job.timeout_s is None else self.limits.with_timeout(job.timeout_s)

        rlimits = ((resource.RLIMIT_AS, limits.memory_mb << 20), (resource.RLIMIT_CPU, limits.cpu_s),
                   (resource.RLIMIT_FSIZE, limits.fsize_mb << 20), (resource.RLIMIT_NOFILE, limits.nofile))

        def set_limits() -> None:  # in the child, before exec
            for which, value in rlimits:
                resource.setrlimit(which, (value, value))

        with tempfile.TemporaryDirectory(prefix="posttrain-job-") as work:
            for rel, text in job.files.items():
                path = Path(work) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            argv = [self.python if a == PYTHON else a for a in job.argv]
            stdin = memfd_with(job.stdin, "posttrain-stdin")
            result_r = result_w = None
            if job.uses_result_fd:  # the write end keeps its number in the child (pass_fds)
                result_r, result_w = os.pipe()
                argv = [str(result_w) if a == RESULT_FD else a for a in argv]
            start = time.monotonic()
            try:
                proc = subprocess.Popen(argv, cwd=work, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True, preexec_fn=set_limits,
                                        env={"PATH": "/usr/bin:/bin", "HOME": work},
                                        pass_fds=[result_w] if result_w is not None else [])
            except OSError as exc:
                if result_r is not None:
                    os.close(result_r)
                if exc.errno == errno.E2BIG:  # the job's argv: the program's failure, as in the bwrap backend
                    return cannot_exec(argv[0], os.strerror(errno.E2BIG), self.name, self.isolation)
                return infra_error(f"could not start {argv[0]}: {exc}", self.name, self.isolation)
            finally:
                for fd in (stdin, result_w):
                    if fd is not None:
                        os.close(fd)
            kill = lambda: kill_tree(proc.pid)  # noqa: E731 - the job's whole session

            try:
                streams = job_streams(proc.stdout.fileno(), proc.stderr.fileno(), result_r, limits)
                seen, usage = watch_process(proc, streams, start + limits.timeout_s, kill, limits.flood)
            finally:
                if result_r is not None:
                    os.close(result_r)
            kill()  # what the job left behind in its session
            code, sig = exit_of(proc.returncode)
            obs = Observed(seen=seen, exit_code=code, signaled=sig,
                           duration_s=time.monotonic() - start, cpu_time_s=usage.ru_utime + usage.ru_stime,
                           peak_memory_mb=usage.ru_maxrss / 1024, cpu_limit_s=limits.cpu_s)
            return to_result(obs, self.name, self.isolation, limits.result_cap)
