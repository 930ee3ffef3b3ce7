"""What isolation this host can give, found by trying it, and the string that names it.

``probe(python)`` checks each layer (bubblewrap binary, unprivileged uid drop, user/pid/
net namespaces, seccomp, cgroup v1 controllers or a v2 subtree, Landlock) and finally
starts one real sandbox running ``python -I -S`` through the same launch chain jobs use
(in a job cgroup, v1 where writable, else v2), so "supported" means "worked here", not
"is installed". ``Support.isolation`` is the string recorded in every
``JobResult.isolation``; ``Support.missing`` lists required layers that are absent,
which makes the bwrap executor refuse (``bwrap.host_support``) unless
``sandbox.allow_weak_isolation``.

Required: bwrap with user+pid+net+mount namespaces, an unprivileged uid, seccomp,
rlimits. Reported but optional: cgroup limits (rlimits, the pid namespace and sized
tmpfs still bound the job), Landlock (not used; mounts hide the host tree).

``resolve_python`` picks the job interpreter (it must live under /usr, the only host
tree a sandbox sees, exist, and be readable and executable by the sandbox's uids:
``python_problem``; a mistake is a ``UserError`` naming ``sandbox.python``) and
``check_paths`` refuses job file paths that would land outside the work folder or hold a
NUL byte.

Not covered: AppArmor/SELinux profiles, gVisor detection (a gVisor sandbox shows up as
its own kernel and passes the probe as usual).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
import subprocess
from dataclasses import dataclass, field

from components.core.jobs import Job
from components.sandbox import cgroups, seccomp
from components.sandbox.command import SandboxSpec, host_argv, tool
from components.sandbox.limits import Lease, Limits

PROBE_TIMEOUT_S = 20.0
DEFAULT_PYTHON = "/usr/bin/python3"


@dataclass(frozen=True)
class Support:
    bwrap: str | None
    bwrap_version: str
    setpriv: str | None
    python: str
    seccomp: bool
    cgroup_v1: tuple[str, ...]
    cgroup_v2: bool  # job groups can be created under our cgroup v2 (used only when v1 is not writable)
    cgroup_v2_controllers: tuple[str, ...]  # of memory, pids, cpu: those a v2 job group gets
    landlock_abi: int
    drops_uid: bool  # root: jobs run as a leased uid; else they run as our own unprivileged uid
    namespaces_ok: bool
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def missing(self) -> list[str]:
        need = []
        if not self.bwrap:
            need.append("bubblewrap (apt-get install bubblewrap)")
        elif not self.namespaces_ok:
            need.append("user/pid/net/mount namespaces for an unprivileged uid")
        if not self.seccomp:
            need.append("seccomp (pip install pyseccomp; apt-get install libseccomp2)")
        if os.geteuid() == 0 and not self.setpriv:
            need.append("setpriv (util-linux) to drop root")
        return need

    @property
    def isolation(self) -> str:
        if not self.bwrap or not self.namespaces_ok:
            return "process+rlimits (WEAK: no namespaces)"
        parts = ["bwrap:user,pid,net,ipc,uts,mount,cgroup-ns", "uid:unprivileged", "caps:none", "rlimits",
                 "tmpfs:/work,/tmp,/dev/shm", "seccomp" if self.seccomp else "no-seccomp(WEAK)"]
        if self.cgroup_v1:
            parts.append(f"cgroup-v1:{','.join(self.cgroup_v1)}")
        elif self.cgroup_v2:  # cpu.stat and cgroup.kill come with every v2 group
            parts.append(f"cgroup-v2:{','.join(self.cgroup_v2_controllers + ('accounting',))}")
        else:
            parts.append("no-cgroup")
        return "+".join(parts)


def landlock_abi() -> int:
    """Landlock ABI version, 0 when unsupported (syscall 444 with LANDLOCK_CREATE_RULESET_VERSION)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        version = libc.syscall(444, None, 0, 1)
    except (OSError, AttributeError):
        return 0
    return max(0, int(version))


def _bwrap_version(bwrap: str) -> str:
    try:
        return subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unusable: {exc}"


TRANSIENT = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC})
"""errnos that say the host is short of something now (processes, memory, fds), not that it lacks a layer."""


def _try_sandbox(bwrap: str, setpriv: str | None, python: str, use_seccomp: bool, cgroup_v1: list[str],
                 cgroup_v2: bool) -> str:
    """'' when a real sandbox ran ``python -I -S`` as an unprivileged uid, else what failed.

    ``InfraError`` (never an answer ``probe`` would keep) when the probe could not be set
    up or started for a reason of the moment: no free uid, a cgroup that cannot be made
    (``Lease``), no memory, fds or processes left (``TRANSIENT``)."""
    from components.core.errors import InfraError

    limits = Limits(timeout_s=PROBE_TIMEOUT_S, memory_mb=512, output_cap=4096, cpu_s=int(PROBE_TIMEOUT_S) + 1)
    lease = Lease(cgroup_v1, cgroup_v2, 512 << 20, 64, 1.0)
    try:
        code = "import os,socket; print(os.getuid(), os.getpid()); socket.socket(socket.AF_INET)"
        try:
            seccomp_fd = lease.keep(seccomp.memfd("job")) if use_seccomp else None
            spec = SandboxSpec(uid=lease.uid, limits=limits, cmd=[python, "-I", "-S", "-c", code],
                               cgroup_procs=lease.procs_files(), seccomp_fd=seccomp_fd)
            argv, env = host_argv(spec, bwrap, setpriv)
            proc = subprocess.run(argv, env=env, pass_fds=lease.ours, capture_output=True, text=True,
                                  timeout=PROBE_TIMEOUT_S, start_new_session=True)
        except OSError as exc:
            if exc.errno in TRANSIENT:
                raise InfraError("the sandbox probe", bwrap, str(exc)) from exc
            return f"probe sandbox could not start: {exc}"
        except subprocess.SubprocessError as exc:
            return f"probe sandbox could not start: {exc}"
        first = proc.stdout.split()
        if len(first) < 2 or first[1] != "2":
            return f"probe sandbox failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}"
        if os.geteuid() == 0 and first[0] == "0":
            return "probe sandbox still ran as uid 0"
        if use_seccomp and "PermissionError" not in proc.stderr and "Address family" not in proc.stderr:
            return f"seccomp filter did not block AF_INET sockets: {proc.stderr.strip()[-200:]}"
        return ""
    finally:
        lease.release(wait=True)


@functools.cache
def probe(python: str = DEFAULT_PYTHON) -> Support:
    """What this host supports, once per process and interpreter. ``InfraError`` (not
    kept: the next call probes again) when the probe sandbox could not be set up for a
    reason of the moment (``_try_sandbox``): that says nothing about the host's layers."""
    bwrap, setpriv = tool("bwrap"), tool("setpriv")
    why_not_seccomp = seccomp.available()
    controllers = cgroups.v1_writable()
    v2 = None if controllers else cgroups.base_v2()  # v2 only where v1 is not writable (preparing it may move us)
    # '' when the probe sandbox worked, else what failed; None without bwrap (nothing to try)
    failed = _try_sandbox(bwrap, setpriv, python, not why_not_seccomp, controllers, v2 is not None) if bwrap else None
    return Support(
        bwrap=bwrap, bwrap_version=_bwrap_version(bwrap) if bwrap else "", setpriv=setpriv, python=python,
        seccomp=not why_not_seccomp, cgroup_v1=tuple(controllers), cgroup_v2=v2 is not None,
        cgroup_v2_controllers=v2[1] if v2 else (),
        landlock_abi=landlock_abi(), drops_uid=os.geteuid() == 0, namespaces_ok=failed == "",
        problems=tuple(problem for problem in (why_not_seccomp, failed) if problem),
    )


def resolve_python(config) -> str:
    """The job interpreter ``sandbox.python`` names (empty: ``DEFAULT_PYTHON``), once it is
    one this host can start in the sandbox (``python_problem``); else a ``UserError``
    naming ``sandbox.python``, never the host's isolation."""
    from components.core.errors import UserError
    from components.core.recipe import SANDBOX_PYTHON_FIX

    python = getattr(config, "python", "") or DEFAULT_PYTHON
    if (problem := python_problem(python)) is not None:
        fix = SANDBOX_PYTHON_FIX if getattr(config, "python", "") else (
            "install Debian's python3 (apt-get install python3), or set sandbox.python to a Python 3 interpreter under /usr")
        raise UserError("sandbox.python", python, problem, fix)
    return python


_STARTED: set[str] = set()  # interpreters python_problem found good in this process (it starts each once)


def python_problem(python: str) -> str | None:
    """Why the job interpreter ``python`` cannot run a job on this host (None when it can):
    a path the sandbox does not show (outside /usr: ``recipe.sandbox_python_problem``, or a
    link that leads out of /usr and the merged-usr folders the sandbox binds), a file that
    is missing, not a file or not executable, one the sandbox's leased uids cannot read
    and run (as root, jobs run as a uid that owns nothing and is in no group, so the
    interpreter and every folder above it need the "others" bits:
    ``doctor.unreadable_for_others``), or a program that is no Python 3.9 or newer."""
    from components.core.recipe import sandbox_python_problem
    from components.sandbox.command import TOP_LEVEL
    from components.sandbox.doctor import unreadable_for_others

    if (problem := sandbox_python_problem(python)) is not None:
        return problem
    if python in _STARTED:
        return None
    if not os.path.lexists(python):
        return "no such file on this host"
    real = os.path.realpath(python)
    if not os.path.exists(python):
        return f"is a link to {real}, which does not exist"
    if not os.path.isfile(python):
        return "is not a file"
    if sandbox_python_problem(real) is not None and real.split("/")[1] not in TOP_LEVEL:
        return f"is a link to {real}, outside /usr: the sandbox shows only /usr, so no job could start it"
    if not os.access(python, os.X_OK | os.R_OK):
        return f"is not readable and executable by uid {os.geteuid()} (mode {stat.filemode(os.stat(python).st_mode)})"
    if os.geteuid() == 0 and (why := unreadable_for_others(python)):
        return f"the sandbox's leased uids cannot run it ({why}): chmod o+rx it and the folders above it"
    try:
        proc = subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.version_info >= (3, 9))"],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"does not start ({type(exc).__name__}: {str(exc)[:200]})"
    if proc.stdout.strip() != "True":
        return f"is not a Python 3.9 or newer (exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-200:]!r})"
    _STARTED.add(python)
    return None


def check_paths(job: Job) -> None:
    """``ValueError`` for a job file path that is not a plain relative path in the work
    folder: empty, absolute, with an empty, ``.`` or ``..`` part (so no ``a//b`` and no
    trailing ``/``), or holding a NUL byte (bwrap reads its options NUL-separated, so a
    NUL in a name would be options of the job's choosing). Not covered: other control
    characters (a file name may hold them) and name lengths (the write fails in the job)."""
    for rel in job.files:
        if not rel or "\x00" in rel or any(part in ("", ".", "..") for part in rel.split("/")):
            raise ValueError(f"job {job.job_id}: file path {rel!r} must be relative and stay inside the work folder "
                             "(no leading or trailing '/', no '.', '..' or '//' parts, no NUL byte)")
