"""The host command line that starts one bubblewrap sandbox.

Chain (each step ``exec``s the next, so the job's tree is one process lineage):

1. ``/bin/sh`` (dash, as root): joins the job's cgroups (``$PT_CG``) and sets rlimits
   with ``ulimit``; exit status 125 means this step failed (an infrastructure error).
2. ``setpriv``: drops to the sandbox's own unprivileged uid/gid, no supplementary
   groups (skipped when we are not root: then we already are unprivileged).
3. ``bwrap``: new user, pid, net, ipc, uts, mount and cgroup namespaces; no further
   user namespaces; read-only /usr (and the merged-usr symlinks), a few /etc files,
   fresh /proc and a fresh read-only /dev, size-capped tmpfs on /tmp, /work and /dev/shm; the job's files copied
   in from memfds; a cleared environment but PATH, HOME=/work, TMPDIR, LANG (and PWD); all capabilities dropped (the warm worker keeps
   CAP_SYS_ADMIN/CAP_SETPCAP inside its own user namespace only, to build per-job
   namespaces); the seccomp filter; ``--die-with-parent`` and ``--new-session``.

A strict launch runs the chain up to ``bwrap --args FD -- cmd``, which blocks reading
its options from that pipe before it creates any namespace; the job then sends
``bwrap_options`` (strict.py parks such launches ahead of their jobs).

Not covered: bind-mounting host data folders (jobs get only their own files);
Landlock (mounts already hide the host tree); devices beyond bwrap's ``--dev`` set (null, zero,
full, random, urandom, tty, ptmx and pts, on a /dev remounted read-only).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

from components.sandbox.limits import Limits

SH = "/bin/sh"
WRAPPER = 'for f in $PT_CG; do echo $$ > "$f" || exit 125; done; unset PT_CG; {ulimits} || exit 125; exec "$@"'
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime",
             "/etc/python3", "/etc/python3.11", "/etc/python3.12")
TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
WORK = "/work"


def tool(name: str) -> str | None:
    for folder in ("/usr/bin", "/bin", "/usr/sbin", "/usr/local/bin"):
        if os.access(os.path.join(folder, name), os.X_OK):
            return os.path.join(folder, name)
    return shutil.which(name)


@dataclass
class SandboxSpec:
    """What one sandbox gets. fds must be inheritable-by-number (passed with ``pass_fds``)."""

    uid: int
    limits: Limits
    cmd: list[str]
    cgroup_procs: list[str] = field(default_factory=list)
    seccomp_fd: int | None = None
    status_fd: int | None = None
    files: list[tuple[int, str]] = field(default_factory=list)  # (memfd, relative path in /work)
    system_files: list[tuple[int, str]] = field(default_factory=list)  # (memfd, absolute path), read-only
    worker: bool = False  # the warm worker: keeps namespace-building caps inside its user namespace


def bwrap_args(spec: SandboxSpec, bwrap: str) -> list[str]:
    lim = spec.limits
    args = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    if not spec.worker:
        # The worker must own its pid namespace to setns back after each per-job unshare;
        # its jobs get no new user namespaces from the job seccomp filter instead.
        args.insert(3, "--disable-userns")
    for name in TOP_LEVEL:
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in ETC_FILES:
        args += ["--ro-bind-try", path, path]
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(lim.tmp_mb << 20), "--tmpfs", "/dev/shm",
             "--perms", "1777", "--size", str(lim.tmp_mb << 20), "--tmpfs", "/tmp",
             "--perms", "0755", "--size", str(lim.work_mb << 20), "--tmpfs", WORK]
    # The folders the files go in, before the files (sorted: parents first).
    folders = {f"{WORK}/{rel.rsplit('/', n)[0]}" for _, rel in spec.files for n in range(1, rel.count("/") + 1)}
    for folder in sorted(folders | {os.path.dirname(path) for _, path in spec.system_files}):
        args += ["--dir", folder]
    for fd, rel in spec.files:
        args += ["--perms", "0644", "--file", str(fd), f"{WORK}/{rel}"]
    for fd, path in spec.system_files:
        args += ["--perms", "0444", "--file", str(fd), path]
    # /dev read-only (devices still read and write): a warm worker's /dev outlives its jobs,
    # so a file a job left there would reach the next one; /dev/shm is a tmpfs of its own.
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK, "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORK,
             "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8", "--cap-drop", "ALL"]
    if spec.worker:
        args += ["--uid", "0", "--gid", "0", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP"]
    if spec.seccomp_fd is not None:
        args += ["--seccomp", str(spec.seccomp_fd)]
    if spec.status_fd is not None:
        args += ["--json-status-fd", str(spec.status_fd)]
    return args + ["--", *spec.cmd]


def host_argv(spec: SandboxSpec, bwrap: str, setpriv: str | None,
              args_fd: int | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and environment for ``subprocess.Popen`` (run it with ``start_new_session=True``).

    With ``args_fd`` bwrap gets only ``--args args_fd -- cmd`` and blocks until the
    options (``bwrap_options``) arrive on that pipe: a launch parked ahead of its job.
    """
    chain = [SH, "-c", WRAPPER.format(ulimits=spec.limits.ulimit_script()), "sh"]
    if os.geteuid() == 0:
        assert setpriv, "running as root needs setpriv to drop to the sandbox uid"
        chain += [setpriv, f"--reuid={spec.uid}", f"--regid={spec.uid}", "--clear-groups"]
        if not spec.worker:  # killed when the spawning thread exits; a warm worker ends when its socket closes
            chain += ["--pdeathsig", "KILL"]
        chain += ["--"]
    env = {"PATH": "/usr/bin:/bin", "PT_CG": " ".join(spec.cgroup_procs)}
    if args_fd is not None:
        return chain + [bwrap, "--args", str(args_fd), "--", *spec.cmd], env
    return chain + bwrap_args(spec, bwrap), env


def bwrap_options(spec: SandboxSpec) -> bytes:
    """The options of ``bwrap_args`` (no program, no command), NUL-separated for ``--args``.
    An option holding a NUL byte (a job file name: ``detect.check_paths`` refuses those
    first) raises ``ValueError``: it would split into options of the job's choosing."""
    options = bwrap_args(spec, "bwrap")[1:-(len(spec.cmd) + 1)]
    if any("\0" in arg for arg in options):
        raise ValueError("a bwrap option holds a NUL byte: it would split into several options")
    return b"".join(arg.encode() + b"\0" for arg in options)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def memfd_with(text: str | bytes, name: str = "posttrain-file") -> int:
    fd = os.memfd_create(name, 0)
    write_all(fd, text.encode() if isinstance(text, str) else text)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
