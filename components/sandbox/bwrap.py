"""The ``bwrap`` backend: each job in a bubblewrap sandbox, refusing weak isolation.

``sandbox.mode``: "strict" starts a fresh sandbox per job (``StrictRunner`` below; the
launch for the next job of the same shape is parked ahead of time, see there);
"warm" keeps one pre-started sandboxed worker per concurrency slot that forks a child
per job in fresh per-job namespaces (pool.py). Both record the isolation string from
detect.py in every ``JobResult.isolation``.

On start the executor probes the host. If a required layer is missing it raises a
``UserError`` naming ``sandbox.allow_weak_isolation``; with that flag set it runs with
what there is (no seccomp, or the subprocess backend when there are no namespaces) and
says "WEAK" in the isolation string.

Not covered: jobs that need the network, host folders, GPUs or a different root image;
interpreters outside /usr (the sandbox sees only /usr and a few /etc files).
"""

from __future__ import annotations

import atexit
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from components.sandbox import cgroups, seccomp
from components.sandbox.command import SandboxSpec, bwrap_options, host_argv, memfd_with
from components.sandbox.detect import Support, probe
from components.sandbox.executor import DEFAULT_PYTHON, SubprocessExecutor, register_backend
from components.core.jobs import PYTHON, RESULT_FD, Job, JobResult, SessionJob
from components.sandbox.limits import UIDS, Limits
from components.sandbox.outcome import Observed, infra_error, to_result
from components.sandbox.supervise import watch

SETUP_FAILED = 125  # the launch wrapper's own failure (cgroup join or ulimit)


def check_paths(job: Job) -> None:
    for rel in job.files:
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts:
            raise ValueError(f"job {job.job_id}: file path {rel!r} must be relative and stay inside the work folder")


def resolve_python(config) -> str:
    from components.core.errors import UserError

    python = getattr(config, "python", "") or DEFAULT_PYTHON
    if not python.startswith("/usr/"):
        raise UserError("sandbox.python", python, "the bwrap sandbox only shows /usr, so this interpreter is not "
                        "visible inside it", "leave sandbox.python empty to use /usr/bin/python3 (Debian's)")
    return python


def require(support: Support, allow_weak: bool) -> None:
    """Refuse weak isolation unless the recipe allows it."""
    from components.core.errors import UserError

    if support.missing and not allow_weak:
        detail = "; ".join(support.problems)
        raise UserError(
            "sandbox.allow_weak_isolation", False,
            f"this host lacks {', '.join(support.missing)} for the bwrap sandbox" + (f" ({detail})" if detail else ""),
            "install what is missing (see 'Sandbox: threat model' in README.md), or set "
            "sandbox.allow_weak_isolation: true to run untrusted code with weaker isolation",
        )


class _Parked:
    """A launch started ahead of its job: in its cgroup, rlimits set, uid dropped, bwrap
    exec'd and blocked reading its options from ``args_w``. Holds placeholders (empty
    memfds for the files and stdin, pipes) that the job fills in before the options go."""

    def __init__(self, key: tuple, uid: int, group, proc: subprocess.Popen, args_w: int, file_fds: list[int],
                 stdin_fd: int, status_r: int, result_r: int | None, status_w: int, seccomp_fd: int | None) -> None:
        self.key, self.uid, self.group, self.proc = key, uid, group, proc
        self.args_w, self.file_fds, self.stdin_fd = args_w, file_fds, stdin_fd  # ours, filled in by the job
        self.status_r, self.result_r = status_r, result_r  # ours, read while the job runs
        self.status_w, self.seccomp_fd = status_w, seccomp_fd  # fd numbers in the launched process only

    def discard(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait()
        except ChildProcessError:
            pass
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()
        for fd in [self.args_w, self.stdin_fd, self.status_r, *self.file_fds]:
            try:
                os.close(fd)
            except OSError:
                pass
        if self.result_r is not None:
            os.close(self.result_r)
        if self.group:
            cgroups.REAPER.submit(self.group, lambda: UIDS.release(self.uid))
        else:
            UIDS.release(self.uid)


class StrictRunner:
    """A fresh sandbox per job.

    Joining a job's cgroup (v1) costs one RCU grace period (several ms, the largest part
    of a strict job's overhead here), and the fork/exec chain a few more. So after each
    job a background thread *parks* the next launch for the same job shape (argv, file
    count, result fd, limits): a fresh uid, a fresh cgroup, the launch chain run up to
    bwrap, which blocks reading its options (``--args``) before it creates any namespace.
    The next job of that shape fills in its files and sends the options; everything else
    (namespaces, mounts, seccomp, the program) happens per job as before. A job of another
    shape, or with ``result_file``, launches directly. Parked launches hold no job data.
    """

    def __init__(self, support: Support, python: str, limits: Limits, use_seccomp: bool, isolation: str,
                 park: int = 1) -> None:
        self.support = support
        self.python = python
        self.limits = limits
        self.use_seccomp = use_seccomp
        self.isolation = isolation
        self.park_max = park
        self._parked: list[_Parked] = []
        self._pending = 0
        self._lock = threading.Lock()
        self._closed = False
        self._wake: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    # -- parking -------------------------------------------------------------------

    @staticmethod
    def _key(job: Job, limits: Limits) -> tuple | None:
        if job.result_file and not job.uses_result_fd:
            return None
        return (tuple(job.argv), len(job.files), job.uses_result_fd, limits)

    def _take(self, key: tuple) -> _Parked | None:
        with self._lock:
            for i, parked in enumerate(self._parked):
                if parked.key == key:
                    return self._parked.pop(i)
        return None

    def _request(self, key: tuple) -> None:
        """Ask the parking thread for one more launch of this shape (drops other shapes)."""
        if self.park_max <= 0:
            return
        with self._lock:
            if self._closed or len([p for p in self._parked if p.key == key]) + self._pending >= self.park_max:
                return
            stale = [p for p in self._parked if p.key != key]
            self._parked = [p for p in self._parked if p.key == key]
            self._pending += 1
            if self._thread is None:
                # a long-lived thread: setpriv's --pdeathsig fires when the thread that forked exits
                self._thread = threading.Thread(target=self._loop, name="sandbox-park", daemon=True)
                self._thread.start()
                atexit.register(self.close)  # remove parked launches' cgroups on a normal exit
        for parked in stale:
            parked.discard()
        self._wake.put(key)

    def _loop(self) -> None:
        while True:
            key = self._wake.get()
            if key is None:
                return
            parked = None
            try:
                parked = self._park(key)
            except Exception:  # noqa: BLE001 - parking is an optimisation; the job launches directly
                parked = None
            with self._lock:
                self._pending -= 1
                if parked is not None and not self._closed:
                    self._parked.append(parked)
                    parked = None
            if parked is not None:
                parked.discard()

    def _park(self, key: tuple) -> _Parked:
        argv_t, n_files, uses_result_fd, limits = key
        uid = UIDS.lease()
        group = None
        child: list[int] = []
        ours: list[int] = []
        ok = False
        try:
            group = cgroups.create_group(self.support.cgroup_v1, self.support.cgroup_v2, limits.memory_mb << 20,
                                         limits.pids_max, limits.cpus)
            file_fds = [memfd_with(b"") for _ in range(n_files)]
            ours += file_fds
            argv = [self.python if a == PYTHON else a for a in argv_t]
            result_r = None
            if uses_result_fd:
                result_r, result_w = os.pipe()
                ours.append(result_r)
                child.append(result_w)
                argv = [str(result_w) if a == RESULT_FD else a for a in argv]
            status_r, status_w = os.pipe()
            ours.append(status_r)
            child.append(status_w)
            seccomp_fd = None
            if self.use_seccomp:
                seccomp_fd = seccomp.memfd("job")
                child.append(seccomp_fd)
            args_r, args_w = os.pipe()
            ours.append(args_w)
            child.append(args_r)
            stdin_fd = memfd_with(b"", "posttrain-stdin")
            ours.append(stdin_fd)
            spec = SandboxSpec(uid=uid, limits=limits, cmd=argv, cgroup_procs=group.procs_files() if group else [])
            host, env = host_argv(spec, self.support.bwrap, self.support.setpriv, args_fd=args_r)
            proc = subprocess.Popen(host, env=env, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=child + file_fds, start_new_session=True, cwd="/")
            for fd in child:
                os.close(fd)
            child.clear()
            ok = True
            return _Parked(key, uid, group, proc, args_w, file_fds, stdin_fd, status_r, result_r, status_w, seccomp_fd)
        finally:
            if not ok:
                for fd in child + ours:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                if group:
                    cgroups.REAPER.submit(group, lambda: UIDS.release(uid))
                else:
                    UIDS.release(uid)

    def close(self) -> None:
        atexit.unregister(self.close)
        with self._lock:
            self._closed = True
            parked, self._parked = self._parked, []
        if self._thread is not None:
            self._wake.put(None)
        for p in parked:
            p.discard()

    # -- one job -------------------------------------------------------------------

    def run(self, job: Job, backend: str) -> JobResult:
        check_paths(job)
        limits = self.limits if job.timeout_s is None else self.limits.with_timeout(job.timeout_s)
        key = self._key(job, limits)
        parked = self._take(key) if key is not None else None
        if parked is not None and parked.proc.poll() is not None:
            parked.discard()  # died while parked (killed from outside): launch directly
            parked = None
        if key is not None:
            self._request(key)  # the next job of this shape finds its launch parked
        if parked is not None:
            return self._run_parked(job, limits, parked, backend)
        return self._run_direct(job, limits, backend)

    def _run_parked(self, job: Job, limits: Limits, parked: _Parked, backend: str) -> JobResult:
        uid, group, proc = parked.uid, parked.group, parked.proc
        ours = [parked.status_r] + ([parked.result_r] if parked.result_r is not None else [])
        try:
            files = []
            for fd, (rel, text) in zip(parked.file_fds, job.files.items()):
                data = text.encode()
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.lseek(fd, 0, os.SEEK_SET)
                files.append((fd, rel))
            stdin = job.stdin.encode()
            view = memoryview(stdin)
            while view:
                view = view[os.write(parked.stdin_fd, view):]
            os.lseek(parked.stdin_fd, 0, os.SEEK_SET)
            spec = SandboxSpec(uid=uid, limits=limits, cmd=[], seccomp_fd=parked.seccomp_fd,
                               status_fd=parked.status_w, files=files)
            view = memoryview(bwrap_options(spec))
            start = time.monotonic()
            while view:
                view = view[os.write(parked.args_w, view):]
        except BrokenPipeError:
            parked.discard()  # the parked launch is gone: launch directly
            return self._run_direct(job, limits, backend)
        except BaseException:
            parked.discard()
            raise
        os.close(parked.args_w)
        os.close(parked.stdin_fd)
        for fd in parked.file_fds:
            os.close(fd)
        return self._supervise(job, limits, backend, uid, group, proc, start, parked.status_r, parked.result_r,
                               None, ours)

    def _run_direct(self, job: Job, limits: Limits, backend: str) -> JobResult:
        uid = UIDS.lease()
        fds: list[int] = []  # child-side fds, closed in the parent right after the spawn
        ours: list[int] = []  # parent-side fds
        group = None
        result_dir = None
        handed = False
        try:
            group = cgroups.create_group(self.support.cgroup_v1, self.support.cgroup_v2, limits.memory_mb << 20,
                                         limits.pids_max, limits.cpus)
            files = []
            for rel, text in job.files.items():
                fd = memfd_with(text)
                fds.append(fd)
                files.append((fd, rel))
            binds = []
            argv = [self.python if a == PYTHON else a for a in job.argv]
            result_r = None
            if job.uses_result_fd:
                result_r, result_w = os.pipe()
                ours.append(result_r)
                fds.append(result_w)
                argv = [str(result_w) if a == RESULT_FD else a for a in argv]
            elif job.result_file:
                check_paths(Job(job.job_id, {job.result_file: ""}, []))
                result_dir = tempfile.mkdtemp(prefix="posttrain-result-")
                os.chmod(result_dir, 0o711)
                host_file = os.path.join(result_dir, "result")
                Path(host_file).touch(0o600)
                if self.support.drops_uid:
                    os.chown(host_file, uid, uid)
                binds.append((host_file, f"/work/{job.result_file}"))
            status_r, status_w = os.pipe()
            ours.append(status_r)
            fds.append(status_w)
            seccomp_fd = None
            if self.use_seccomp:
                seccomp_fd = seccomp.memfd("job")
                fds.append(seccomp_fd)
            stdin_fd = memfd_with(job.stdin, "posttrain-stdin")
            fds.append(stdin_fd)
            spec = SandboxSpec(uid=uid, limits=limits, cmd=argv, cgroup_procs=group.procs_files() if group else [],
                               seccomp_fd=seccomp_fd, status_fd=status_w, files=files, binds=binds)
            host, env = host_argv(spec, self.support.bwrap, self.support.setpriv)
            start = time.monotonic()
            try:
                proc = subprocess.Popen(host, env=env, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=[fd for fd in fds if fd != stdin_fd], start_new_session=True,
                                        cwd="/")
            except OSError as exc:
                return infra_error(f"could not start bwrap: {exc}", backend, self.isolation)
            for fd in fds:
                os.close(fd)
            fds.clear()
            handed, group_, ours_ = True, group, list(ours)
            ours.clear()
            group = None
        finally:
            for fd in fds + ours:
                try:
                    os.close(fd)
                except OSError:
                    pass
            if not handed:
                if result_dir:
                    shutil.rmtree(result_dir, ignore_errors=True)
                if group:
                    cgroups.REAPER.submit(group, lambda: UIDS.release(uid))
                else:
                    UIDS.release(uid)
        return self._supervise(job, limits, backend, uid, group_, proc, start, status_r, result_r, result_dir, ours_)

    def _supervise(self, job: Job, limits: Limits, backend: str, uid: int, group, proc: subprocess.Popen,
                   start: float, status_r: int, result_r: int | None, result_dir: str | None,
                   ours: list[int]) -> JobResult:
        """Watch a started sandbox to its end; owns ``ours``, ``result_dir``, the group and the uid."""
        try:
            pidfd = os.pidfd_open(proc.pid)
            ours.append(pidfd)

            def kill() -> None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if group:
                    group.kill_all()

            streams = {"stdout": proc.stdout.fileno(), "stderr": proc.stderr.fileno(), "status": status_r}
            caps = {"stdout": limits.output_cap, "stderr": limits.output_cap, "status": 4096}
            if result_r is not None:
                streams["result"] = result_r
                caps["result"] = limits.result_cap
            seen = watch(streams, caps, pidfd, lambda: True, start + limits.timeout_s, kill, limits.flood)
            if not seen.finished:
                kill()
            _, wait_status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(wait_status)
            duration = time.monotonic() - start
            proc.stdout.close()
            proc.stderr.close()
            if group:
                group.kill_all()  # anything still there outlived bwrap's pid namespace: kill it
            started = b"child-pid" in bytes(seen.data["status"])
            code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
            if not started and not seen.timed_out and not seen.flooded:
                why = bytes(seen.data["stderr"]).decode(errors="replace").strip()[-2000:]
                return infra_error(f"sandbox did not start (exit {code}): {why}", backend, self.isolation)
            result_raw, result_total = None, 0
            if result_r is not None:
                result_raw, result_total = bytes(seen.data["result"]), seen.total["result"]
            elif result_dir:
                path = os.path.join(result_dir, "result")
                result_total = os.path.getsize(path)
                with open(path, "rb") as fh:
                    result_raw = fh.read(limits.result_cap)
            extra = {"mode": "strict", "uid": uid}
            oom = group.oom_kills() if group else 0
            cpu = usage.ru_utime + usage.ru_stime
            if group and group.cpu_time_s() is not None:
                cpu = group.cpu_time_s()  # includes processes killed before anyone reaped them
            if group:
                peak = group.peak_memory_mb()
                if peak is not None:
                    extra["cgroup_peak_memory_mb"] = round(peak, 1)
            obs = Observed(
                exit_code=code, signaled=0, timed_out=seen.timed_out, flooded=seen.flooded, oom_kills=oom,
                stdout=bytes(seen.data["stdout"]), stderr=bytes(seen.data["stderr"]),
                stdout_total=seen.total["stdout"], stderr_total=seen.total["stderr"], duration_s=duration,
                cpu_time_s=cpu, peak_memory_mb=usage.ru_maxrss / 1024,
                result_raw=result_raw, result_total=result_total, extra=extra,
            )
            return to_result(obs, backend, self.isolation, limits.result_cap, job.wants_result)
        finally:
            for fd in ours:
                try:
                    os.close(fd)
                except OSError:
                    pass
            if result_dir:
                shutil.rmtree(result_dir, ignore_errors=True)
            if group:  # kill stragglers, remove the group, then free the uid: off the critical path
                cgroups.REAPER.submit(group, lambda: UIDS.release(uid))
            else:
                UIDS.release(uid)


@register_backend("bwrap")
class BwrapExecutor:
    """Executor protocol: ``name``, ``isolation``, ``run(job)``, ``close()``."""

    name = "bwrap"

    def __init__(self, config) -> None:
        self.config = config
        self.python = resolve_python(config)
        self.mode = getattr(config, "mode", "strict")
        allow_weak = bool(getattr(config, "allow_weak_isolation", False))
        self.support = probe(self.python)
        require(self.support, allow_weak)
        cgroups.sweep_stale()
        self.limits = Limits.from_config(config)
        self._fallback = None
        self._pool = None
        if not self.support.bwrap or not self.support.namespaces_ok:
            self._fallback = SubprocessExecutor(config)
            self.isolation = self.support.isolation
            self._fallback.isolation = self.isolation
            return
        self.isolation = self.support.isolation + f"+mode:{self.mode}"
        use_seccomp = self.support.seccomp
        if self.mode == "warm":
            from components.sandbox.pool import WarmPool

            self._pool = WarmPool(self.support, self.python, self.limits, int(config.concurrency), self.isolation)
        self._strict = StrictRunner(self.support, self.python, self.limits, use_seccomp, self.isolation)

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
        if getattr(self, "_strict", None) is not None:
            self._strict.close()
        cgroups.REAPER.drain()
        if self._pool is not None:
            self._pool.close()
        if self._fallback is not None:
            self._fallback.close()
