"""Warm mode: pre-started sandboxed workers (zygote.py) that fork a fresh child per job.

A ``Worker`` is one bwrap sandbox running zygote.py, with its own uid and cgroup,
talking to the host over a SEQPACKET socket. It serves one job at a time; per job the
host passes memfd/pipe fds, the worker forks a child in fresh pid/mount/ipc namespaces
and reports the exit status, CPU time and peak RSS. ``WarmPool`` keeps ``size``
workers (one per concurrency slot) and replaces any that die.

The worker enforces each job's wall clock itself; the host kills the whole worker one
second later as a backstop (the job is then a timeout and the worker is replaced).

A job must leave nothing behind for the next job on its worker. Its processes, mounts
and IPC objects die with its namespaces; what could outlive them is a unix socket kept
in an ``SCM_RIGHTS`` cycle (with memfds, abstract names, ... in it) in the worker's
network namespace and cgroup, which every later job shares. After each job the worker
reports itself dirty when its namespace still holds a unix socket (zygote.py's
``Leftovers``), and the host checks that the memory the group cannot reclaim (anonymous
and shmem) is back within ``LEFTOVER_SLACK_MB`` of what the worker held when it was
fitted (``left_memory``: one read of the group's usage while that is within the same
slack). Either way the worker is replaced, as after an output flood; the job's own
result stands. A session worker is checked for sockets when it is reset between two
sessions (its memory is not fitted: the last session's files stay charged for a while)
and closed if dirty.

Not covered: per-job cgroups (the worker's cgroup covers one job at a time; its memory
peak is reset per job where the kernel allows, else no per-job cgroup peak is
reported); jobs that need a different interpreter than the worker's (they still run,
exec'd, without the warm speed-up).
"""

from __future__ import annotations

import atexit
import json
import marshal
import os
import select
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import replace
from pathlib import Path

from components.core.errors import InfraError
from components.core.jobs import Job, JobResult
from components.sandbox import seccomp
from components.sandbox.background import SPAWNER
from components.sandbox.command import SandboxSpec, host_argv, memfd_with
from components.sandbox.detect import Support, check_paths
from components.sandbox.limits import Fds, Lease, Limits
from components.sandbox.outcome import Observed, exit_of, infra_error, not_utf8, nul_argument, session_setup_failed, to_result
from components.sandbox.supervise import job_streams, kill_tree, watch

ZYGOTE_SOURCE = Path(__file__).with_name("zygote.py")
START_TIMEOUT_S = 15.0
BACKSTOP_S = 1.0
WORKER_OVERHEAD_MB = 128
WIRE_VERSION = 4  # marshal format of header and spec for zygote.py (readable by every Python 3.4+)
LEFTOVER_SLACK_MB = 8  # memory above the fitted worker's that a warm worker may keep after a job


def plain_str(value) -> str:
    """``value`` as an exact ``str`` (marshal writes only exact types: a str subclass such
    as numpy's ``str_`` would fail or travel as something else)."""
    return value if type(value) is str else str(value)


def plain_limits(limits: dict) -> dict:
    return {key: float(value) if isinstance(value, float) else int(value) for key, value in limits.items()}


class WorkerDied(RuntimeError):
    pass


class Worker:
    """One warm sandbox. ``session=True`` keeps /work and /tmp across jobs (SandboxSession)."""

    def __init__(self, support: Support, python: str, limits: Limits, isolation: str, session: bool = False) -> None:
        self.support = support
        self.python = python
        self.limits = limits
        self.isolation = isolation
        self.session = session
        self.lease: Lease | None = None
        self.group = None
        self.proc: subprocess.Popen | None = None
        self.ctl: socket.socket | None = None
        self.alive = False
        self.jobs = 0
        self.floor: tuple[int, int] | None = None  # (usage, pinned) bytes of the fitted worker (``fit_memory``)
        self.session_jobs = 0  # jobs since the session's fresh /work (a session worker's reset)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        lim = self.limits
        worker_limits = replace(lim, cpu_s=7 * 86400, memory_mb=lim.memory_mb + WORKER_OVERHEAD_MB,
                                nproc=lim.nproc + 8)
        memory = (lim.memory_mb + lim.work_mb + lim.tmp_mb + WORKER_OVERHEAD_MB) << 20
        self.lease = lease = Lease(self.support.cgroup_v1, self.support.cgroup_v2, memory, lim.pids_max + 8, lim.cpus)
        self.uid, self.group = lease.uid, lease.group
        self.ctl, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        child_fd = lease.give(child.detach())
        zygote_fd = lease.give(memfd_with(ZYGOTE_SOURCE.read_bytes(), "posttrain-zygote"))
        # The job's filter stacks on the worker's ("zygote"); without seccomp on this host (a recipe that
        # allows weak isolation) both are left out, and an empty job filter tells the worker so.
        weak = not self.support.seccomp
        bpf_fd = lease.give(memfd_with(b"" if weak else seccomp.bpf("job-on-zygote"), "posttrain-job-bpf"))
        cmd = [self.python, "-I", "-S", "/sandbox/zygote.py", str(child_fd), "/sandbox/job.bpf", self.python]
        spec = SandboxSpec(uid=self.uid, limits=worker_limits, cmd=cmd + (["session"] if self.session else []),
                           cgroup_procs=lease.procs_files(),
                           seccomp_fd=None if weak else lease.give(seccomp.memfd("zygote")),
                           system_files=[(zygote_fd, "/sandbox/zygote.py"), (bpf_fd, "/sandbox/job.bpf")],
                           worker=True)
        argv, env = host_argv(spec, self.support.bwrap, self.support.setpriv)
        try:
            self.proc = SPAWNER.call(subprocess.Popen, argv, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=lease.theirs,
                                     start_new_session=True, cwd="/")
        finally:
            lease.started()
        ready, _, _ = select.select([self.ctl], [], [], START_TIMEOUT_S)
        msg = self.ctl.recv(65536) if ready else b""
        if not msg:
            self.proc.kill()
            err = self.proc.stderr.read(4000).decode(errors="replace") if self.proc.stderr else ""
            raise WorkerDied(f"warm sandbox worker did not start: {err.strip()}")
        self.proc.stderr.close()
        if not self.session:
            self.fit_memory()
        self.alive = True

    def fit_memory(self) -> None:
        """Give the worker's jobs the memory a strict job gets: the group's limit becomes
        what the started worker holds now plus ``memory_mb``, so a job's tmpfs files count
        against ``memory_mb`` as in strict mode (the group starts with room for the
        worker's start-up). Not for session workers, in either mode: the files of a
        pooled worker's last session stay charged to its group for a while after the
        reset, so they keep the room of the start. Not covered: what the worker itself
        allocates later beyond ``LEFTOVER_SLACK_MB`` (``left_memory`` then retires it)."""
        group = self.group
        used = group.memory_bytes() if group is not None else None
        if group is not None and used is not None:
            group.limit_memory(used + (self.limits.memory_mb << 20))
            pinned = group.pinned_bytes()
            if pinned is not None:
                self.floor = (used, pinned)

    def left_memory(self) -> bool:
        """Whether the group holds, after a job, memory reclaim cannot free (anonymous,
        shmem) more than ``LEFTOVER_SLACK_MB`` above the fitted worker's: the next job
        would have that much less than ``memory_mb``. One read of the usage while that
        is within the slack (page cache counts there, and is reclaimed under pressure)."""
        if self.floor is None or self.group is None:
            return False
        slack = LEFTOVER_SLACK_MB << 20
        used = self.group.memory_bytes()
        if used is None or used <= self.floor[0] + slack:
            return False
        pinned = self.group.pinned_bytes()
        return pinned is None or pinned > self.floor[1] + slack

    def run(self, job: Job, backend: str) -> JobResult:
        assert self.alive and self.ctl is not None
        check_paths(job)
        if (refused := nul_argument(job, backend, self.isolation) or not_utf8(job, backend, self.isolation)) is not None:
            return refused
        limits = self.limits if job.timeout_s is None else self.limits.with_timeout(job.timeout_s)
        wire_limits = plain_limits(limits.as_dict())
        spec = {"argv": [plain_str(a) for a in job.argv], "stdin": plain_str(job.stdin), "limits": wire_limits,
                "files": {plain_str(rel): plain_str(text) for rel, text in job.files.items()}}
        fds = Fds()
        try:
            fds.give(memfd_with(marshal.dumps(spec, WIRE_VERSION), "posttrain-spec"))
            out_r, _ = fds.pipe()
            err_r, _ = fds.pipe()
            result_r = fds.pipe()[0] if job.uses_result_fd else None
            job_key = uuid.uuid4().hex
            header = {"op": "run", "id": job_key, "limits": wire_limits}
            if self.group:
                self.group.reset_peak()
            oom_before = self.group.oom_kills() if self.group else 0
            cpu_before = self.group.cpu_time_s() if self.group else None
            start = time.monotonic()
            try:
                socket.send_fds(self.ctl, [marshal.dumps(header, WIRE_VERSION)], fds.theirs)
            except OSError as exc:
                self._die()
                return infra_error(f"warm worker gone: {exc}", backend, self.isolation)
            fds.started()
            report: dict = {}

            def on_message() -> bool:
                try:
                    msg = self.ctl.recv(65536)
                except OSError:
                    msg = b""
                if not msg:
                    report["worker_died"] = True
                    return True
                got = json.loads(msg)  # from inside the sandbox: a parser safe on any input
                if got.get("id") == job_key:
                    report.update(got)
                    return True
                return False

            seen = watch(job_streams(out_r, err_r, result_r, limits), self.ctl.fileno(), on_message,
                         start + limits.timeout_s + BACKSTOP_S, self._die, limits.flood)
            duration = time.monotonic() - start
            if seen.flooded and self.alive:
                self._die()  # the flood kill took the worker down with the job
            self.jobs += 1
            earlier, self.session_jobs = self.session_jobs, self.session_jobs + 1
            if report.get("error"):
                return infra_error(f"warm worker could not start the job: {report['error']}", backend, self.isolation)
            died = report.get("worker_died") or not report
            if died:
                self._die()
            elif not self.session and (report.get("dirty") or self.left_memory()):
                self._die()  # the job left something its worker's next job would inherit: replace the worker
            status = report.get("status")
            timed_out = bool(report.get("timed_out")) or seen.timed_out
            code, sig = (137, signal.SIGKILL) if status is None else exit_of(os.waitstatus_to_exitcode(status))
            # read after every job, as strict mode does: an OOM kill of a job's child (the job itself
            # exiting 0) is this job's, never the next one's
            oom_kills = self.group.oom_kills() - oom_before if self.group else 0
            # A setup the memory limit stopped (the job's files did not fit memory_mb) is an oom, as in strict
            # mode, where the same files fill the job's own cgroup: not an infra_error (retried, then left out).
            if report.get("setup_failed") and not timed_out and not oom_kills:  # the worker's word, not the job's
                stderr = bytes(seen.data["stderr"]).decode(errors="replace")
                if self.session and earlier:  # /work is what the session's own commands left (chmod, full)
                    return session_setup_failed(stderr, duration, backend, self.isolation)
                return infra_error(stderr[-2000:] or "job setup failed", backend, self.isolation)
            cpu = float(report.get("cpu_s", 0.0))
            if cpu_before is not None and timed_out:  # killed trees are never reaped by the job's init
                cpu_after = self.group.cpu_time_s()
                if cpu_after is not None:
                    cpu = cpu_after - cpu_before
            extra = {"mode": "session" if self.session else "warm", "uid": self.uid, "worker_jobs": self.jobs}
            if died and not seen.timed_out:
                extra["worker_died"] = True
            obs = Observed(seen=seen, exit_code=code, signaled=sig, timed_out=timed_out,
                           oom_kills=oom_kills, duration_s=duration, cpu_time_s=cpu,
                           peak_memory_mb=float(report.get("maxrss_kb", 0.0)) / 1024, extra=extra,
                           cgroup_peak_mb=self.group.peak_memory_mb() if self.group else None, cpu_limit_s=limits.cpu_s)
            return to_result(obs, backend, self.isolation, limits.result_cap)
        finally:
            fds.close_all()

    def reset(self) -> bool:
        """Session workers only: fresh, empty ``/work`` and ``/tmp`` for the next session
        (zygote.py's ``reset_session``). False, with the worker killed, when it did not
        confirm within ``START_TIMEOUT_S`` or reported itself dirty (a unix socket of the
        last session still alive): it must then not serve another session."""
        assert self.session, "only a session worker keeps /work between jobs"
        if not self.alive or self.ctl is None:
            return False
        key = uuid.uuid4().hex
        try:
            self.ctl.send(marshal.dumps({"op": "reset", "id": key, "limits": plain_limits(self.limits.as_dict())},
                                        WIRE_VERSION))
            ready, _, _ = select.select([self.ctl], [], [], START_TIMEOUT_S)
            got = json.loads(self.ctl.recv(65536) or b"{}") if ready else {}
        except (OSError, ValueError):
            got = {}
        if got.get("id") != key or got.get("op") != "reset" or "error" in got or got.get("dirty"):
            self._die()
            return False
        self.session_jobs = 0
        return True

    def _die(self) -> None:
        """Kill the whole worker sandbox (timeout backstop, flood, lost worker)."""
        self.alive = False
        if self.proc is not None:
            kill_tree(self.proc.pid, self.group)
        elif self.group:
            self.group.kill_all()

    def close(self) -> None:
        if self.ctl is not None:
            with suppress(OSError):
                self.ctl.send(marshal.dumps({"op": "exit"}, WIRE_VERSION))
            self.ctl.close()
            self.ctl = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self._die()
                self.proc.wait()
            self.proc = None
        self.alive = False
        if self.lease is not None:
            self.lease.release(wait=True)
            self.lease = self.group = None


class WarmPool:
    """``size`` workers, each serving one job at a time; dead ones are replaced. A caller
    past ``size`` (``run_many`` with a larger ``concurrency``) waits for a worker given
    back or for the slot of one that died, whichever comes first."""

    def __init__(self, support: Support, python: str, limits: Limits, size: int, isolation: str) -> None:
        self.support, self.python, self.limits, self.isolation = support, python, limits, isolation
        self.size = size
        self._idle: deque[Worker] = deque()
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a worker given back, a slot freed, the pool closed
        self._live: set[Worker] = set()
        self._starting = 0  # slots taken by workers still starting (``_take``)
        self._closed = False
        atexit.register(self.close)  # workers also exit on their own when our socket closes
        with ThreadPoolExecutor(size) as starting:
            for worker in starting.map(self._prestart, range(size)):
                if worker is not None:
                    self._idle.append(worker)

    def _prestart(self, _: int) -> Worker | None:
        try:
            return self._new()
        except WorkerDied:
            return None

    def _new(self) -> Worker:
        """A started worker; ``WorkerDied`` when it could not start, also for want of a uid,
        a cgroup, memory or fds (``InfraError``, ``OSError``): the job is an ``infra_error``."""
        try:
            worker = Worker(self.support, self.python, self.limits, self.isolation)
        except (OSError, InfraError) as exc:
            raise WorkerDied(f"warm sandbox worker could not start: {exc}") from exc
        with self._lock:
            self._live.add(worker)
        return worker

    def _take(self) -> Worker:
        """An idle worker, else a new one while fewer than ``size`` are live or starting,
        else whichever comes first: a worker given back, or a slot that a dead worker (or
        a start that failed) frees, then taken by a new worker. ``WorkerDied`` once the
        pool is closed."""
        with self._freed:
            while not self._idle and len(self._live) + self._starting >= self.size and not self._closed:
                self._freed.wait()
            if self._closed:
                raise WorkerDied("the warm pool is closed")
            if self._idle:
                return self._idle.popleft()
            self._starting += 1
        try:
            return self._new()
        finally:
            with self._freed:
                self._starting -= 1
                self._freed.notify()  # a start that failed leaves its slot to a waiting caller

    def _give_back(self, worker: Worker) -> None:
        with self._freed:
            if worker.alive and not self._closed:
                self._idle.append(worker)
                self._freed.notify()
                return
        try:
            worker.close()  # before its slot is free: never more than ``size`` sandboxes at once
        finally:
            with self._freed:
                self._live.discard(worker)
                self._freed.notify()  # a caller waiting for a worker starts one in the dead one's place

    def run(self, job: Job, backend: str) -> JobResult:
        try:
            worker = self._take()
        except WorkerDied as exc:
            return infra_error(str(exc), backend, self.isolation)
        try:
            return worker.run(job, backend)
        finally:
            self._give_back(worker)

    def close(self) -> None:
        atexit.unregister(self.close)
        with self._freed:
            self._closed = True
            workers = list(self._live)
            self._live.clear()
            self._idle.clear()
            self._freed.notify_all()  # callers still waiting get an infra_error, not a closed worker
        for worker in workers:
            worker.close()
