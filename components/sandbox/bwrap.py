"""The ``bwrap`` backend: each job in a bubblewrap sandbox, refusing weak isolation.

``sandbox.mode``: "strict" starts a fresh sandbox per job (``StrictRunner`` below);
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

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from components.sandbox import cgroups, seccomp
from components.sandbox.command import SandboxSpec, host_argv, memfd_with
from components.sandbox.detect import Support, probe
from components.sandbox.executor import DEFAULT_PYTHON, SubprocessExecutor, register_backend
from components.sandbox.job import PYTHON, RESULT_FD, Job, JobResult
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


class StrictRunner:
    """A fresh sandbox per job."""

    def __init__(self, support: Support, python: str, limits: Limits, use_seccomp: bool, isolation: str) -> None:
        self.support = support
        self.python = python
        self.limits = limits
        self.use_seccomp = use_seccomp
        self.isolation = isolation

    def run(self, job: Job, backend: str) -> JobResult:
        check_paths(job)
        limits = self.limits if job.timeout_s is None else self.limits.with_timeout(job.timeout_s)
        uid = UIDS.lease()
        fds: list[int] = []  # child-side fds, closed in the parent right after the spawn
        ours: list[int] = []  # parent-side fds
        group = None
        result_dir = None
        try:
            if self.support.cgroup_v1:
                group = cgroups.JobCgroup.create(list(self.support.cgroup_v1), limits.memory_mb << 20,
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
            for fd in fds + ours:
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

    def run(self, job: Job) -> JobResult:
        if self._fallback is not None:
            result = self._fallback.run(job)
            return result
        if self._pool is not None:
            return self._pool.run(job, self.name)
        return self._strict.run(job, self.name)

    def close(self) -> None:
        cgroups.REAPER.drain()
        if self._pool is not None:
            self._pool.close()
        if self._fallback is not None:
            self._fallback.close()
