"""Strict mode: a fresh bubblewrap sandbox per job, its launch parked ahead of time.

Joining a job's cgroup (v1) costs one RCU grace period (several ms, the largest part of
a strict job's overhead here), and the fork/exec chain a few more. So while each job runs a
background thread *parks* the next launch for the same job shape (argv, file count,
result fd, limits): a fresh ``Lease`` (uid, cgroup, fds), the launch chain run up to
bwrap, which blocks reading its options (``--args``) before it creates any namespace.
The next job of that shape fills in its files and stdin and sends the options;
everything else (namespaces, mounts, seccomp, the program) happens per job. A job that
finds nothing parked launches the same way on the spot. Parked launches hold no job
data, and a launch is used for one job only.

Not covered: reusing anything between jobs (that is warm mode, pool.py); shapes other
than the last one seen are not parked (a new shape discards the old ones).
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass, replace

from components.core.errors import InfraError
from components.core.jobs import PYTHON, RESULT_FD, Job, JobResult
from components.sandbox import seccomp
from components.sandbox.background import SPAWNER
from components.sandbox.command import SandboxSpec, bwrap_options, host_argv, memfd_with, write_all
from components.sandbox.detect import Support, check_paths
from components.sandbox.limits import Lease, Limits
from components.sandbox.outcome import Observed, cannot_exec, exit_of, infra_error, not_utf8, nul_argument, to_result
from components.sandbox.supervise import job_streams, kill_tree, watch_process


@dataclass
class Launch:
    """A launch started ahead of its job: in its cgroup, rlimits set, uid dropped, bwrap
    exec'd and blocked reading its options from ``args_w``. Its lease holds empty memfds
    for the files and stdin (filled in by the job before the options go) and pipes;
    ``spec`` is the sandbox's, less the job's files."""

    key: tuple
    lease: Lease
    proc: subprocess.Popen
    spec: SandboxSpec
    args_w: int
    file_fds: list[int]
    stdin_fd: int
    status_r: int
    result_r: int | None

    def discard(self) -> None:
        kill_tree(self.proc.pid)
        with self.proc:  # leaving it closes its pipes and reaps it
            pass
        self.lease.release()


class StrictRunner:
    """A fresh sandbox per job; at most one launch parked, for the last job shape seen."""

    def __init__(self, support: Support, python: str, limits: Limits, isolation: str) -> None:
        self.support = support
        self.python = python
        self.limits = limits
        self.isolation = isolation
        self._parked: Launch | None = None
        self._parking = False  # a launch is being parked
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)  # remove a parked launch's cgroup on a normal exit

    # -- parking -------------------------------------------------------------------

    def _take(self, key: tuple) -> Launch | None:
        with self._lock:
            if self._parked is None or self._parked.key != key:
                return None
            launch, self._parked = self._parked, None
            return launch

    def _request(self, key: tuple) -> None:
        """Ask for a launch of this shape to be parked (drops one of another shape)."""
        with self._lock:
            if self._closed or self._parking or (self._parked is not None and self._parked.key == key):
                return
            stale, self._parked, self._parking = self._parked, None, True
        if stale is not None:
            stale.discard()
        # on SPAWNER's long-lived thread: setpriv's --pdeathsig fires when the thread that forked exits
        SPAWNER.submit(self._park, key)

    def _park(self, key: tuple) -> None:
        launch = None
        if not self._closed:
            try:
                launch = self._launch(key)
            except Exception:  # noqa: BLE001 - parking is an optimisation; the job launches on the spot
                launch = None
        with self._lock:
            self._parking = False
            if launch is not None and not self._closed:
                launch, self._parked = self._parked, launch
        if launch is not None:
            launch.discard()

    def _launch(self, key: tuple) -> Launch:
        """Start the chain up to bwrap, which then waits for its options; the lease is
        given back on any failure."""
        argv_t, n_files, uses_result_fd, limits = key
        lease = Lease(self.support.cgroup_v1, self.support.cgroup_v2, limits.memory_mb << 20, limits.pids_max,
                      limits.cpus)
        try:
            file_fds = [lease.keep(memfd_with(b"")) for _ in range(n_files)]
            argv = [self.python if a == PYTHON else a for a in argv_t]
            result_r = None
            if uses_result_fd:
                result_r, result_w = lease.pipe()
                argv = [str(result_w) if a == RESULT_FD else a for a in argv]
            status_r, status_w = lease.pipe()
            spec = SandboxSpec(uid=lease.uid, limits=limits, cmd=[], status_fd=status_w,
                               seccomp_fd=lease.give(seccomp.memfd("job")) if self.support.seccomp else None)
            args_r, args_w = os.pipe()
            lease.give(args_r)
            lease.keep(args_w)
            stdin_fd = lease.keep(memfd_with(b"", "posttrain-stdin"))
            launcher = SandboxSpec(uid=lease.uid, limits=limits, cmd=argv, cgroup_procs=lease.procs_files())
            host, env = host_argv(launcher, self.support.bwrap, self.support.setpriv, args_fd=args_r)
            proc = subprocess.Popen(host, env=env, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=lease.theirs + file_fds, start_new_session=True, cwd="/")
            lease.started()
            return Launch(key, lease, proc, spec, args_w, file_fds, stdin_fd, status_r, result_r)
        except BaseException:
            lease.release()
            raise

    def close(self) -> None:
        atexit.unregister(self.close)
        with self._lock:
            self._closed = True
            parked, self._parked = self._parked, None
        if parked is not None:
            parked.discard()

    # -- one job -------------------------------------------------------------------

    def run(self, job: Job, backend: str) -> JobResult:
        check_paths(job)
        if (refused := nul_argument(job, backend, self.isolation) or not_utf8(job, backend, self.isolation)) is not None:
            return refused
        limits = self.limits if job.timeout_s is None else self.limits.with_timeout(job.timeout_s)
        key = (tuple(job.argv), len(job.files), job.uses_result_fd, limits)
        launch = self._take(key)
        if launch is not None and launch.proc.poll() is not None:
            launch.discard()  # died while parked (killed from outside): launch on the spot
            launch = None
        self._request(key)  # the next job of this shape finds its launch parked
        if launch is not None:
            result = self._run(job, limits, launch, backend, None)
            if result is not None:
                return result  # else the parked launch was gone: launch on the spot
        start = time.monotonic()
        try:
            launch = self._launch(key)
        except OSError as exc:
            if exc.errno == errno.E2BIG:  # the job's argv, not the host: the program's failure, as in warm mode
                program = self.python if job.argv[0] == PYTHON else job.argv[0]
                return cannot_exec(program, os.strerror(errno.E2BIG), backend, self.isolation)
            return infra_error(f"could not start bwrap: {exc}", backend, self.isolation)
        except InfraError as exc:  # no uid free, no cgroup: the host's state, retried
            return infra_error(f"could not start bwrap: {exc}", backend, self.isolation)
        return self._run(job, limits, launch, backend, start) or infra_error(
            "sandbox did not start: bwrap closed its options pipe", backend, self.isolation)

    def _run(self, job: Job, limits: Limits, launch: Launch, backend: str, start: float | None) -> JobResult | None:
        """Fill in the job, send the options, watch the sandbox to its end; gives the
        lease back. None when the launch was gone before it got the options."""
        lease, proc = launch.lease, launch.proc
        try:
            files = []
            for fd, (rel, text) in zip(launch.file_fds, job.files.items()):
                write_all(fd, text.encode())
                os.lseek(fd, 0, os.SEEK_SET)
                files.append((fd, rel))
            write_all(launch.stdin_fd, job.stdin.encode())
            os.lseek(launch.stdin_fd, 0, os.SEEK_SET)
            options = bwrap_options(replace(launch.spec, files=files))
            start = time.monotonic() if start is None else start
            write_all(launch.args_w, options)
            lease.close(launch.args_w)  # EOF: bwrap reads its options to the end
        except BrokenPipeError:
            launch.discard()
            return None
        except BaseException:
            launch.discard()
            raise
        group = lease.group
        try:
            streams = job_streams(proc.stdout.fileno(), proc.stderr.fileno(), launch.result_r, limits)
            streams["status"] = (launch.status_r, 4096)
            seen, usage = watch_process(proc, streams, start + limits.timeout_s, lambda: kill_tree(proc.pid, group),
                                        limits.flood)
            duration = time.monotonic() - start
            if group:
                group.kill_all()  # anything still there outlived bwrap's pid namespace: kill it
            code, sig = exit_of(proc.returncode)
            if b"child-pid" not in seen.data["status"] and not seen.timed_out and not seen.flooded:
                why = bytes(seen.data["stderr"]).decode(errors="replace").strip()[-2000:]
                return infra_error(f"sandbox did not start (exit {code}): {why}", backend, self.isolation)
            if (refused := _exec_refused(seen, code, sig)) is not None:  # as warm mode's worker says it
                program = self.python if job.argv[0] == PYTHON else job.argv[0]
                return cannot_exec(program, refused, backend, self.isolation)
            extra = {"mode": "strict", "uid": lease.uid}
            cpu, oom, peak = usage.ru_utime + usage.ru_stime, 0, None
            if group:
                oom = group.oom_kills()
                group_cpu = group.cpu_time_s()
                if group_cpu is not None:
                    cpu = group_cpu  # includes processes killed before anyone reaped them
                peak = group.peak_memory_mb()
            # wait4's maxrss is the launch chain's: at least this host process's RSS when it forked
            # the chain, whatever the job used; the job's cgroup peak is the job's where there is one.
            obs = Observed(seen=seen, exit_code=code, signaled=sig, duration_s=duration, cpu_time_s=cpu,
                           peak_memory_mb=usage.ru_maxrss / 1024 if peak is None else peak, oom_kills=oom,
                           extra=extra, cgroup_peak_mb=peak, cpu_limit_s=limits.cpu_s)
            return to_result(obs, backend, self.isolation, limits.result_cap)
        finally:
            lease.release()  # kill stragglers, remove the group, then free the uid: off the critical path


BWRAP_EXEC_FAILED = re.compile(rb"bwrap: execvp [^\n]*?: ([^\n:]+)\n?", re.ASCII)
"""What bwrap writes, alone, when it cannot exec the job's program (exit 1)."""


def _exec_refused(seen, code: int, sig: int) -> str | None:
    """Why bwrap could not exec the job's program (a missing program, no execute bit), when
    that is all the job did: exit 1 with only bwrap's ``execvp`` line on stderr; else None.
    Warm mode's worker says ``cannot run PROGRAM: WHY`` and exits 127, and so does every
    mode now. A program that writes that very line and exits 1 gets the same status
    (``failed``), only exit 127 instead of 1."""
    if code != 1 or sig or seen.data["stdout"]:
        return None
    match = BWRAP_EXEC_FAILED.fullmatch(bytes(seen.data["stderr"]))
    return match[1].decode() if match else None
