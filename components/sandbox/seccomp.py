"""Seccomp filters for sandboxed jobs, compiled to BPF with libseccomp (``pyseccomp``).

The filter is a deny list on top of the namespaces: by default every syscall is allowed
and the ones below fail with ``EPERM`` (``EAFNOSUPPORT`` for non-local sockets,
``ENOSYS`` for ``clone3`` so libc falls back to ``clone``, whose namespace flags are
then checked). Syscalls of a foreign architecture (i386 ``int 0x80``) never run: libseccomp's default
kills the calling thread (a job's other threads go on).

Three filters exist: ``job`` for untrusted code in a fresh sandbox; ``zygote`` for the
warm worker, which must still create per-job pid/mount/ipc namespaces and mount their
tmpfs; and ``job-on-zygote``, what a warm job adds on top of the ``zygote`` filter it
inherits (seccomp filters stack, and a syscall is allowed only if every filter allows
it), so that the two together deny exactly what ``job`` denies. A warm job installs only
that short filter: the kernel checks and JIT-compiles each filter it installs, which for
the full ``job`` filter is ~0.2 ms per job.

Not covered: an allow list (Python and bash need a wide, version-dependent set);
argument filtering beyond socket families, clone flags and ioctl(TIOCSTI/TIOCLINUX);
kernels without seccomp (detect.py reports that and the executor refuses).
"""

from __future__ import annotations

import errno
import functools
import tempfile

from components.sandbox.command import memfd_with

# Kernel attack surface and host-visible state a test program never needs.
DENIED: tuple[str, ...] = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "kexec_load", "kexec_file_load", "reboot", "init_module", "finit_module", "delete_module",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "personality", "acct", "quotactl", "swapon", "swapoff", "syslog", "vhangup",
    "iopl", "ioperm", "lookup_dcookie", "open_by_handle_at", "name_to_handle_at",
    "fanotify_init", "pivot_root", "chroot",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "mbind", "migrate_pages", "move_pages", "set_mempolicy", "set_mempolicy_home_node",
    "uselib", "nfsservctl", "process_madvise", "landlock_create_ruleset",
    "memfd_secret", "open_tree_attr",
)
# Numbers for syscalls newer than some libseccomp releases (2.5.4 knows no open_tree_attr,
# older ones none of these): a name libseccomp cannot resolve is denied by number. Since
# Linux 5.1 (syscall 424) a new syscall has the same number on x86_64 and arm64 (the
# filter covers the native architecture only); a kernel older than the syscall answers
# ENOSYS without the rule, so a rule for a number it lacks changes nothing there.
LATE_SYSCALLS: dict[str, int] = {"memfd_secret": 447, "set_mempolicy_home_node": 450, "open_tree_attr": 467}
# Only the warm worker may build per-job namespaces; jobs may not.
NAMESPACE_SETUP: tuple[str, ...] = ("unshare", "setns", "mount", "umount2")
CLONE_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
AF_UNIX = 1
TIOCSTI = 0x5412
TIOCLINUX = 0x541C


def available() -> str:
    """'' when filters can be built here, else why not."""
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: libseccomp.so.2 missing
        return f"pyseccomp unusable ({exc}); pip install pyseccomp and apt-get install libseccomp2"
    try:
        with open("/proc/self/status") as fh:
            if "Seccomp:" not in fh.read():
                return "kernel built without seccomp"
    except OSError as exc:
        return f"cannot read /proc/self/status: {exc}"
    return ""


KINDS = ("job", "zygote", "job-on-zygote")


@functools.cache
def bpf(kind: str = "job") -> bytes:
    """The compiled filter (``kind``: one of ``KINDS``) as raw ``sock_filter`` bytes."""
    import pyseccomp as sc

    assert kind in KINDS, kind
    filt = sc.SyscallFilter(defaction=sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    if kind == "job-on-zygote":
        for name in NAMESPACE_SETUP:
            filt.add_rule(deny, name)
        return _export(filt)
    for name in DENIED + (NAMESPACE_SETUP if kind == "job" else ()):
        _add(filt, deny, name)
    for flag in CLONE_NS_FLAGS:
        filt.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    filt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.NE, AF_UNIX))
    filt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socketpair", sc.Arg(0, sc.NE, AF_UNIX))
    for request in (TIOCSTI, TIOCLINUX):
        filt.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    return _export(filt)


def _add(filt, action, name: str) -> None:
    """``filt.add_rule(action, name)``, by number (``LATE_SYSCALLS``) when this libseccomp
    does not know the name (it raises ``OSError`` EINVAL)."""
    try:
        filt.add_rule(action, name)
    except OSError:
        if name not in LATE_SYSCALLS:
            raise
        filt.add_rule(action, LATE_SYSCALLS[name])


def _export(filt) -> bytes:
    with tempfile.TemporaryFile() as fh:
        filt.export_bpf(fh)
        fh.seek(0)
        return fh.read()


def memfd(kind: str = "job") -> int:
    """A readable fd positioned at the start of the filter, for ``bwrap --seccomp FD``."""
    return memfd_with(bpf(kind), f"posttrain-seccomp-{kind}")
