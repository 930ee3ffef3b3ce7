"""Warm worker that runs INSIDE a bwrap sandbox and forks a fresh child per job.

Started by pool.py as ``python3 -I -S /sandbox/zygote.py CTL_FD BPF_PATH PYTHON [session]``.
Stdlib only (it runs on the sandbox's /usr/bin/python3, not the project's venv); the
host never imports it.

A session worker (``session``) also takes ``{"op": "reset"}`` between two sessions:
fresh ``/work`` and ``/tmp`` (``reset_session``), so a pooled session worker carries no
files from one session into the next.

Per job the host sends one SEQPACKET message on CTL_FD: a header plus fds (spec memfd,
stdout, stderr, the result pipe if the job has a ``{result_fd}``). Header and spec are
``marshal`` data (format 4: dicts, lists, strings and numbers only) written by the
trusted host; decoding them
touches far fewer objects than ``json`` (every object a forked job touches costs it a
copy-on-write page fault). The report goes back as JSON: the host parses what comes
out of a sandbox only with a parser that is safe on hostile input, and the worker
writes it after the job has exited, when its page faults are cheap. The worker never
reads the job's data itself (so no job's files linger in the memory later children
inherit); it forks:

    worker (pid 2 of the sandbox, CAP_SYS_ADMIN inside its own user namespace only;
            enforces the wall clock, reports to the host). At start it empties the
            capability bounding and ambient sets, locks securebits and sets
            no_new_privs once; every child inherits that. Its SIGINT is SIG_DFL, so
            the inits it forks have no signal handler a job could reach.
      └─ I: the job's init, pid 1 of a new pid namespace, as bwrap's init is in strict
            mode, so when it exits (or is killed) the kernel kills everything left in
            the namespace. Starts the job's session, forks J, reaps what J leaves to it
            until J exits, sends J's wait status to the worker and exits (``job_init``).
          └─ J: the job, pid 2 (a pid 1 would ignore the signals it sends itself and
            those its children send it, adopt orphans, and fail its own ``setsid``).
            New mount and ipc namespaces, private mounts, fresh size-capped tmpfs
            /work, /tmp and /dev/shm, its namespace's /proc. Reads the spec, writes files, sets rlimits, drops its capabilities, installs
            the job seccomp filter (seccomp.py's ``job-on-zygote``: the namespace calls;
            the rest of the job policy is the worker's own filter, which J inherits),
            then runs the program. ``{python} -I -S script`` runs in this
            already-started interpreter when ``script`` is a regular file and
            ``execve`` would take the argv (the warm path: no exec, no interpreter
            start-up; ``run_inline`` does what the interpreter does at start and at
            exit); anything else is exec'd, with SIGPIPE and SIGXFSZ at their defaults. The worker reads the exit status and
            resource use with wait4 on I, after I has exited: while I and J live, each
            page the worker writes is a copy-on-write copy, so the worker blocks on I
            first and tidies up after.

The job cannot see or signal the worker (outside its pid namespace); it sees I as pid 1
with its own uid, so it can stop I (``prlimit``, ``oom_score_adj``) and with it only
itself, as under bwrap. It cannot mount or unshare (seccomp, no capabilities) and gets
nothing from earlier jobs (fresh tmpfs, IPC and pid namespaces; /dev is read-only, so
nothing else there is writable; the worker holds no job data). The wall-clock SIGKILL
goes to I from the worker, outside.

Jobs share the worker's network namespace (only AF_UNIX sockets are allowed in it) and
its cgroup. A job's processes all die with it, but a unix socket can outlive them in an
``SCM_RIGHTS`` cycle (a socket in its own receive queue, carrying whatever fds were sent
with it: memfds, an abstract name, a mount namespace), which nothing but the kernel's
unix garbage collector frees, whenever it next runs. So after each job (a session
worker: at each reset) the worker checks that its network namespace holds no unix
socket (``Leftovers``; the worker's own control socket was made in the host's
namespace) and otherwise reports itself dirty: the host then replaces it.

Not covered: a job in the warm path shares the interpreter's already-imported stdlib
modules (ctypes, json, socket, ...) — they are imported but carry no state from other
jobs; at a warm-path job's exit the globals of modules other than ``__main__`` are not
torn down (see ``run_inline``).
"""

import atexit
import ctypes
import fcntl
import gc
import io
import json
import marshal
import os
import resource
import select
import signal
import socket
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID = 0x00020000, 0x08000000, 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE, MS_BIND = 2, 4, 8, 0x4000, 1 << 18, 4096
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 4, 22, 24
PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 28, 38, 47, 4
SECCOMP_MODE_FILTER = 2
SIGKILL = int(signal.SIGKILL)  # a plain int: ctypes passes it without touching the enum
SECBITS_LOCKED_NOROOT = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80  # noroot, no-setuid-fixup, no-ambient; locked
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# what bwrap gives a strict job (its --chdir sets PWD): a program the worker execs sees the same
JOB_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PWD": "/work"}
RESULT_FD_IN_JOB = 3
SETUP_FAILED = 125
SETUP_FAILED_MARK = b"sandbox worker: job setup failed:\n"
try:
    with open("/proc/sys/kernel/cap_last_cap") as _fh:
        CAP_LAST = int(_fh.read())
except (OSError, ValueError):
    CAP_LAST = 63


def fail_setup(fd=2):
    """J could not set the job up: say why on the job's stderr, exit 125. Never
    returns. Whether this was a setup failure is decided by the worker (no "ready" byte
    from J), not by the exit code or the text, which a job could imitate."""
    try:
        os.write(fd, SETUP_FAILED_MARK + format_exc().encode(errors="replace"))
    except BaseException:
        pass
    finally:
        os._exit(SETUP_FAILED)


def report_uncaught(from_script=False):
    """What the interpreter does with an uncaught exception: ``sys.excepthook``, and if
    the hook itself fails, both errors (as ``PyErr_PrintEx`` prints them).
    ``from_script``: the traceback starts at the script, not at run_inline's frame."""
    exc = sys.exc_info()
    if from_script and exc[2] is not None and exc[2].tb_next is not None:
        exc = (exc[0], exc[1].with_traceback(exc[2].tb_next), exc[2].tb_next)
    try:
        sys.excepthook(*exc)
    except BaseException:
        import traceback

        try:
            print("Error in sys.excepthook:", file=sys.stderr)
            traceback.print_exc()
            print("\nOriginal exception was:", file=sys.stderr)
            traceback.print_exception(*exc)
        except BaseException:
            pass


def format_exc():
    """The current exception as text. ``traceback`` is imported only here, on error paths:
    the worker stays smaller, and every fork copies (and every exit unmaps) less."""
    import traceback

    return traceback.format_exc()


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


# The calls J makes per job go through ctypes without ``argtypes``: every argument is a
# small non-negative int, bytes, None or a prebuilt ctypes object, which ctypes passes as
# is; converting through argtypes would touch ~15 more pages per job (each one a
# copy-on-write fault in J).
PRCTL, UNSHARE, SETNS, MOUNT, CAPSET = libc.prctl, libc.unshare, libc.setns, libc.mount, libc.capset
UMOUNT2, MNT_DETACH = libc.umount2, 2
TMPFS_FLAGS, PROC_FLAGS = MS_NOSUID | MS_NODEV, MS_NOSUID | MS_NODEV | MS_NOEXEC


def prctl(option, arg2=0, arg3=0, arg4=0, arg5=0):
    """prctl with int arguments below 2**31 (pass a ``ctypes.c_ulong`` for anything wider)."""
    return PRCTL(option, arg2, arg3, arg4, arg5)


def mount(source, target, fstype, flags, data):
    """``source``/``target``/``fstype``/``data`` as bytes (or None), built before the fork."""
    if MOUNT(source, target, fstype, flags, data) != 0:
        check(-1, f"mount {target!r}")


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def harden_worker():
    """Once, in the worker: what every job inherits (bounding and ambient sets empty,
    securebits locked, no_new_privs). The worker keeps its effective capabilities (it
    still has to unshare and mount for each job); each job drops them."""
    check(prctl(PR_SET_SECUREBITS, SECBITS_LOCKED_NOROOT), "securebits")
    for cap in range(CAP_LAST + 1):
        if prctl(PR_CAPBSET_DROP, cap) != 0 and ctypes.get_errno() != 22:  # EINVAL: past the last cap
            check(-1, f"drop bounding cap {cap}")
    check(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL), "clear ambient caps")
    check(prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")


class PrivilegeDrop:
    """What J must lose before untrusted code runs (on top of harden_worker): its
    capabilities, then everything outside the job seccomp filter. The ctypes arguments
    are built once in the worker; ``apply()`` in J only makes the calls, and fails closed."""

    def __init__(self, bpf):
        self.header = CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
        self.data = (CapData * 2)()
        self.buf = ctypes.create_string_buffer(bpf, len(bpf))
        self.prog = SockFprog(len(bpf) // 8, ctypes.cast(self.buf, ctypes.c_void_p))
        self.prog_ptr = ctypes.pointer(self.prog)
        self.header_ptr = ctypes.pointer(self.header)
        self.filtered = bool(bpf)  # empty: the host has no seccomp and the recipe allows weak isolation

    def apply(self):  # no_new_privs is inherited from harden_worker (it cannot be unset)
        check(CAPSET(self.header_ptr, self.data), "capset")
        if self.filtered:
            check(PRCTL(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, self.prog_ptr, 0, 0), "seccomp")


def read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


RLIMITS = ((resource.RLIMIT_CPU, "cpu_s"), (resource.RLIMIT_AS, "as_bytes"), (resource.RLIMIT_FSIZE, "fsize_bytes"),
           (resource.RLIMIT_NOFILE, "nofile"), (resource.RLIMIT_NPROC, "nproc"))


def set_limits(lim, as_extra=0):
    """The job's rlimits; ``as_extra`` bytes more address space for a job that runs in
    this interpreter (``AS_EXTRA``)."""
    setrlimit = resource.setrlimit
    for which, key in RLIMITS:
        value = lim[key] + as_extra if key == "as_bytes" else lim[key]
        setrlimit(which, (value, value))
    setrlimit(resource.RLIMIT_CORE, (0, 0))


AS_EXTRA = 0  # set by serve(): how much more address space this interpreter holds than a fresh one


def vm_size(status):
    """VmSize in bytes from the text of a /proc/<pid>/status (0 if absent)."""
    for line in status.splitlines():
        if line.startswith(b"VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def fresh_vm_size(python):
    """VmSize of a fresh ``python -I -S`` as its program starts: the address space a job
    run by a new interpreter (strict mode) starts from. 0 if it cannot be measured."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return 0
    if pid == 0:
        try:
            os.dup2(w, 1)
            os.execv(python, [python, "-I", "-S", "-c",
                              "import sys; sys.stdout.buffer.write(open('/proc/self/status', 'rb').read())"])
        finally:
            os._exit(127)
    os.close(w)
    try:
        return vm_size(read_all(r))
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def clear(path):
    """Remove what a session's earlier command left at ``path`` unless it is a plain file
    (a symlink or folder there must not turn the next job's setup into an error)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if (mode & 0o170000) == 0o040000:  # a directory
        import shutil

        shutil.rmtree(path)
    elif (mode & 0o170000) != 0o100000:  # not a regular file
        os.unlink(path)


def write_files(files, fresh):
    """The job's files into /work; ``fresh``: /work is a new, empty tmpfs (nothing to clear)."""
    for rel, text in files.items():
        path = "/work/" + rel
        if "/" in rel:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        if not fresh:
            clear(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            data = text.encode()
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)


MAX_ARG_STRLEN = 32 * os.sysconf("SC_PAGE_SIZE")  # the kernel's longest argument, its NUL included (E2BIG past it)
ARG_MAX = max(os.sysconf("SC_ARG_MAX"), MAX_ARG_STRLEN)  # argv + environment, strings and pointers (E2BIG past it)


def execve_takes(argv):
    """Whether ``execve`` would take ``argv`` with the job's environment (no E2BIG): a job
    whose exec would fail must not run inline instead."""
    total = sum(len(k) + len(v) + 2 + 8 for k, v in JOB_ENV.items())
    for arg in argv:
        size = len(os.fsencode(arg)) + 1
        if size > MAX_ARG_STRLEN:
            return False
        total += size + 8
    return total <= ARG_MAX


def inline_python(argv):
    """argv[1:] when the job is '{python} -I -S script ...' (the warm path) and the real
    interpreter would run ``script`` as a file: a regular file (not a folder with a
    ``__main__.py``, not a missing one) and an argv ``execve`` takes. Else None: the real
    interpreter is exec'd and says what it says (exit 2 "can't open file", a folder's
    ``__main__``, E2BIG as exit 127)."""
    if len(argv) >= 4 and argv[0] == "{python}" and sorted(argv[1:3]) == ["-I", "-S"] and not argv[3].startswith("-"):
        try:
            regular = (os.stat(argv[3]).st_mode & 0o170000) == 0o100000
        except (OSError, ValueError):
            return None
        if regular and execve_takes(argv):
            return argv[3:]
    return None


def stream(fd, mode, errors="surrogateescape", line_buffering=False):
    """A text stream over ``fd`` as the interpreter builds sys.stdin/stdout/stderr (its
    name and mode too, which its repr shows)."""
    raw = io.FileIO(fd, mode, closefd=False)
    raw.name = ("<stdin>", "<stdout>", "<stderr>")[fd]
    buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    text = io.TextIOWrapper(buffered, encoding="utf-8", errors=errors, line_buffering=line_buffering)
    text.mode = mode
    return text


def job_stdio():
    """sys.stdin/stdout/stderr for warm-path jobs, built once in the worker over fds 0-2
    while those are of the kinds a job gets (a memfd for stdin, pipes for stdout and
    stderr), so what the streams cache at creation (seekable, position) is what a fresh
    interpreter would cache in the job. Each job gets its own copy by fork; the worker
    never uses them."""
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    memfd = os.memfd_create("stdin")
    r, w = os.pipe()
    try:
        os.dup2(memfd, 0)
        os.dup2(w, 1)
        os.dup2(w, 2)
        return stream(0, "r"), stream(1, "w"), stream(2, "w", "backslashreplace", True)
    finally:
        for fd, old in enumerate(saved):
            os.dup2(old, fd)
            os.close(old)
        for fd in (memfd, r, w):
            os.close(fd)


JOB_STDIO = None  # set by serve() before the first fork


def run_inline(args):
    """Run a script like ``python -I -S script args`` would, in this interpreter; never returns.

    As the interpreter does for a script: a fresh ``__main__`` module, the source compiled
    with the script's path, ``sys.argv`` set, ``SystemExit`` turned into the exit status.
    Then its shutdown, in its order: non-daemon threads joined, ``atexit`` functions,
    stdout and stderr flushed (exit status 120 when that fails), ``__main__``'s globals
    dropped (``__del__`` runs, an unclosed file is flushed), the streams flushed again;
    an uncaught ``KeyboardInterrupt`` ends the job by SIGINT.
    Signal dispositions are the interpreter's start-up defaults already: the worker
    installs no handlers (``test_warm_job_signal_dispositions_are_the_interpreters``).
    Not covered: other modules' globals are not torn down and there is no last garbage
    collection (a ``__del__`` there or in a reference cycle does not run; the collection
    cost ~6% of a trivial job's throughput).
    """
    sys.stdin, sys.stdout, sys.stderr = JOB_STDIO
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = list(args)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the worker's own is SIG_DFL (serve)
    code = 0
    interrupted = False
    main = type(sys)("__main__")
    main.__file__ = path = os.path.abspath(args[0])  # as the interpreter makes a script's path
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    try:
        fd = os.open(path, os.O_RDONLY)  # not open(): no buffered file object to build
        try:
            source = read_all(fd)
        finally:
            os.close(fd)
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException as exc:  # the job's own uncaught error: the interpreter hands it to sys.excepthook too
        interrupted = isinstance(exc, KeyboardInterrupt)
        report_uncaught(from_script=True)
        code = 1
    if not finalize(main):
        code = 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def exit_code(exc):
    """The exit status a ``SystemExit`` asks for (anything but None or an int is printed, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def finalize(main):
    """The interpreter's shutdown for a warm-path job (see ``run_inline``); False when
    stdout or stderr could not be flushed."""
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()  # joins the job's non-daemon threads
        except BaseException:
            report_uncaught()
    try:
        atexit._run_exitfuncs()
    except BaseException:
        report_uncaught()
    flushed = flush_streams()
    for name in list(main.__dict__):
        if name != "__builtins__":
            main.__dict__[name] = None
    return flush_streams(report=False) and flushed  # said once, as the interpreter does


def flush_streams(report=True):
    """Flush sys.stdout, then sys.stderr, skipping a closed or missing one; a failure on
    stdout is reported as the interpreter reports it at exit ("Exception ignored in:
    ...") when ``report``. False if either failed."""
    ok = True
    for out in (sys.stdout, sys.stderr):
        try:
            if out is None or out.closed:
                continue
            out.flush()
        except BaseException as exc:
            ok = False
            if report and out is sys.stdout:
                try:
                    sys.stderr.write(f"Exception ignored in: {out!r}\n{type(exc).__name__}: {exc}\n")
                    sys.stderr.flush()
                except BaseException:
                    pass
    return ok


def job_main(spec_fd, out_fd, err_fd, result_fd, drop, python, fresh):
    """J: becomes the job. Never returns. Once everything before the job's own code has
    worked it writes one byte to READY_W and closes it: the worker's proof that a later
    exit is the job's, not a setup failure."""
    try:
        os.dup2(err_fd, 2)  # from here on a setup error lands on the job's stderr
        spec = marshal.loads(read_all(spec_fd))
        os.close(spec_fd)
        write_files(spec["files"], fresh)
        stdin = os.memfd_create("stdin")
        os.write(stdin, spec.get("stdin", "").encode())
        os.lseek(stdin, 0, os.SEEK_SET)
        os.dup2(stdin, 0)
        os.dup2(out_fd, 1)
        keep = 2
        argv = list(spec["argv"])
        if result_fd >= 0 and "{result_fd}" in argv:
            os.dup2(result_fd, RESULT_FD_IN_JOB)
            keep = RESULT_FD_IN_JOB
            argv = [str(RESULT_FD_IN_JOB) if a == "{result_fd}" else a for a in argv]
        os.closerange(keep + 1, READY_W)  # the worker's control socket and namespace fd included
        os.closerange(READY_W + 1, 65536)
        os.chdir("/work")
        oom = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        os.write(oom, b"1000")
        os.close(oom)
        inline = inline_python(argv)
        set_limits(spec["limits"], AS_EXTRA if inline is not None else 0)
        drop.apply()
        os.write(READY_W, b"1")
        os.close(READY_W)
    except BaseException:
        fail_setup()
    if inline is not None:
        run_inline(inline)
    argv = [python if a == "{python}" else a for a in argv]
    try:
        # as a fresh process gets them (bwrap's init and subprocess's restore_signals): the worker's
        # interpreter ignores SIGPIPE and SIGXFSZ, and an exec keeps what is ignored
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        os.execvpe(argv[0], argv, JOB_ENV)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in an argument (the host refuses those first)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        os.write(2, f"cannot run {argv[0]}: {why}\n".encode(errors="replace"))
        os._exit(127)


TMPFS_TARGETS = (b"/work", b"/tmp", b"/dev/shm")


def tmpfs_options(limits):
    """The job's tmpfs mount data for /work, /tmp and /dev/shm (in ``TMPFS_TARGETS``
    order), built in the worker before the fork."""
    tmp = f"size={limits['tmp_bytes']},mode=1777".encode()
    return (f"size={limits['work_bytes']},mode=0755".encode(), tmp, tmp)


def private_mounts(fresh, tmpfs):
    """New mount and ipc namespaces; fresh tmpfs /work, /tmp and /dev/shm; this pid
    namespace's /proc. Every argument is prebuilt: J runs as little Python as it can
    before the job (each object it touches costs a copy-on-write page fault)."""
    check(UNSHARE(CLONE_NEWNS | CLONE_NEWIPC), "unshare mount+ipc")
    mount(None, b"/", None, MS_REC | MS_PRIVATE, None)
    if fresh:
        mount(b"tmpfs", b"/work", b"tmpfs", TMPFS_FLAGS, tmpfs[0])
        mount(b"tmpfs", b"/tmp", b"tmpfs", TMPFS_FLAGS, tmpfs[1])
        mount(b"tmpfs", b"/dev/shm", b"tmpfs", TMPFS_FLAGS, tmpfs[2])
    mount(b"proc", b"/proc", b"proc", PROC_FLAGS, None)


def reset_session(tmpfs):
    """A session worker between two sessions: fresh, empty tmpfs ``/work``, ``/tmp`` and ``/dev/shm`` in
    the worker's own mount namespace, which every later command's namespace copies. The
    old ones are detached (their memory goes once nothing holds them: every command of
    the last session has exited, its pid namespace with it). The same mounts, options
    and sizes a fresh warm job gets; the worker's cwd moves off ``/work`` first."""
    os.chdir("/")
    for target, options in zip(TMPFS_TARGETS, tmpfs):
        if UMOUNT2(target, MNT_DETACH) != 0:
            check(-1, f"umount {target!r}")
        mount(b"tmpfs", target, b"tmpfs", TMPFS_FLAGS, options)
    os.chdir("/work")


def job_init(job_args, fresh, tmpfs):
    """The forked child: I, the init (pid 1) of the job's own pid namespace, as bwrap's
    init is in strict mode. Never returns (and never unwinds back into the worker's loop).
    It starts the job's session, forks J (which builds its mounts, then ``job_main``),
    reaps whatever J leaves to it until J exits, sends J's wait status to the worker on
    READY_W and exits: the kernel then kills everything left in the namespace.

    The job is the init's child, not the init itself: a pid 1 would ignore the signals it
    sends itself and those its children send it, adopt orphans, and fail its own
    ``setsid``. What the job can do to I (it sees it as pid 1, with the same uid:
    ``prlimit``, its ``oom_score_adj``) ends this job only, as it would under bwrap."""
    try:
        PRCTL(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
        os.setsid()  # the job's session and process group: kill(0, sig) in the job cannot reach the worker
        job = os.fork()
    except BaseException:
        fail_setup(job_args[2])
    if job == 0:  # J builds the mounts (I touches as little memory as it can: J forks from it)
        try:
            private_mounts(fresh, tmpfs)
        except BaseException:
            fail_setup(job_args[2])
        try:
            job_main(*job_args)
        finally:
            os._exit(SETUP_FAILED)
    code = SETUP_FAILED  # fail closed: an I that could not pass J's status on must not read as J's success
    try:
        os.closerange(0, READY_W)  # the worker's fds and the job's streams: I only waits
        os.closerange(READY_W + 1, 65536)
        while True:
            pid, status = os.wait()
            if pid == job:
                break
        os.write(READY_W, STATUS_MARK + struct.pack("i", status))
        code = 0
    finally:
        os._exit(code)


def wait_job(pid, timeout_s):
    """Wait for I (our child) under the wall clock; kill it, and so its namespace, when the
    clock runs out. Returns the report dict (I's status, and CPU time and peak memory
    from wait4 on I, which include J's: I reaps J before it exits)."""
    pidfd = os.pidfd_open(pid)
    timed_out = False
    try:
        ready, _, _ = select.select([pidfd], [], [], max(0.0, timeout_s))
        if not ready:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(pidfd)
    _, status, usage = os.wait4(pid, 0)
    return {"timed_out": timed_out, "status": status, "cpu_s": usage.ru_utime + usage.ru_stime,
            "maxrss_kb": usage.ru_maxrss}


READY_W = -1  # set by open_ready_pipe(): J's "setup done" fd, the same number in every job


def open_ready_pipe():
    """The worker's pipe on which each J writes one byte once its setup is done. Both
    ends sit at fd 10 or above (J's own fds 0-3 are rebuilt below that); the read end is
    non-blocking. Returns the read end."""
    global READY_W
    r, w = os.pipe()
    ready_r = fcntl.fcntl(r, fcntl.F_DUPFD, 10)
    READY_W = fcntl.fcntl(w, fcntl.F_DUPFD, 10)
    os.close(r)
    os.close(w)
    os.set_blocking(ready_r, False)
    return ready_r


STATUS_MARK = b"s"  # I's message on READY_W: this byte, then J's wait status (a native int)


def job_ended(ready_r):
    """(whether the job that just ended finished its setup, J's wait status or None) from
    what J and I wrote on the ready pipe (drains it). None: I did not see J end (the wall
    clock killed I, or I failed or was killed)."""
    try:
        data = os.read(ready_r, 64)
    except BlockingIOError:
        data = b""
    ready = data.startswith(b"1")
    message = data[1:] if ready else data
    if len(message) == 1 + FD_SIZE and message[:1] == STATUS_MARK:
        return ready, struct.unpack("i", message[1:])[0]
    return ready, None


FD_SIZE = struct.calcsize("i")
ANCILLARY_SPACE = socket.CMSG_SPACE(8 * FD_SIZE)


def receive(ctl):
    """One control message and the fds passed with it (``socket.recv_fds`` without its
    per-call import and array: the worker's loop touches as few objects as it can)."""
    msg, ancdata, _, _ = ctl.recvmsg(65536, ANCILLARY_SPACE)
    fds = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += struct.unpack(f"{len(data) // FD_SIZE}i", data[:len(data) - len(data) % FD_SIZE])
    return msg, fds


WARM_UP_SOURCE = "import json\ndef f(x):\n    return [i * x for i in range(3)]\nprint(f(2), json.dumps({'a': 1}))\n"


def warm_up():
    """Run the job path's lazy initialisations (the compiler's, print's, json's) once here,
    before any fork: otherwise every job redoes them in fresh copy-on-write memory (the
    first ``compile()`` in a forked child costs ~1 ms of page faults; after this ~0.2 ms).
    Only this constant, trusted source runs; the worker never runs job code."""
    sink_fd = os.open(os.devnull, os.O_WRONLY)
    sink = io.TextIOWrapper(io.BufferedWriter(io.FileIO(sink_fd, "w")), encoding="utf-8")
    for _ in range(3):
        namespace = {"__builtins__": __builtins__, "print": lambda *a: print(*a, file=sink)}
        exec(compile(WARM_UP_SOURCE, "warm-up", "exec"), namespace)
        json.loads(json.dumps({"files": {"main.py": "x"}, "argv": ["a"], "limits": {"cpu_s": 1}}))
        with open(os.devnull, "rb") as fh:
            fh.read()
    sink.close()


class Leftovers:
    """Whether a job left a unix socket alive in the worker's network namespace (see the
    module's docstring). One pread of ``/proc/self/net/unix`` on an fd opened at start
    (~15 us): the table holds only its header line while no socket is alive. Fails
    closed: an unreadable table, or one that was not empty at start, reads as dirty."""

    HEADER_MAX = 128  # the header line is 56 bytes; any socket adds a line after it

    def __init__(self):
        try:
            self.fd = os.open("/proc/self/net/unix", os.O_RDONLY | os.O_CLOEXEC)
            self.clean = self.read()
        except OSError:
            self.fd, self.clean = -1, None
        if self.clean is not None and self.clean.count(b"\n") != 1:
            self.clean = None  # not one header line (a socket there at start): never clean

    def read(self):
        return os.pread(self.fd, self.HEADER_MAX, 0)

    def found(self):
        try:
            return self.clean is None or self.read() != self.clean
        except OSError:
            return True


def serve(ctl, bpf, python, fresh):
    prctl(PR_SET_DUMPABLE, 0)
    harden_worker()
    # Each job's init (a fork of the worker) must have no handler a job could reach: a pid 1
    # gets signals from inside its namespace only through one (run_inline puts SIGINT's back).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    global JOB_STDIO
    drop = PrivilegeDrop(bpf)
    JOB_STDIO = job_stdio()
    warm_up()
    global AS_EXTRA
    with open("/proc/self/status", "rb") as fh:
        AS_EXTRA = max(0, vm_size(fh.read()) - fresh_vm_size(python))
    gc.freeze()  # keep the collector in each forked job off the worker's pages (fewer copy-on-write faults)
    own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY)
    leftovers = Leftovers()
    ready_r = open_ready_pipe()
    ctl.send(json.dumps({"op": "ready", "pid": os.getpid()}).encode())
    while True:
        report = None  # a forked job must not find the previous job's report in this frame
        try:
            msg, fds = receive(ctl)
        except OSError:
            return
        if not msg:
            return
        req = marshal.loads(msg)
        if req.get("op") == "reset" and not fresh and not fds:
            try:
                reset_session(tmpfs_options(req["limits"]))
                report = {"op": "reset"}
                if leftovers.found():  # the last session's: the host closes this worker
                    report["dirty"] = True
            except OSError:
                report = {"op": "reset", "error": format_exc()[-2000:]}
            report["id"] = req["id"]
            ctl.send(json.dumps(report).encode())
            continue
        if req.get("op") != "run":
            for fd in fds:
                os.close(fd)
            return
        spec_fd, out_fd, err_fd = fds[:3]
        result_fd = fds[3] if len(fds) > 3 else -1
        try:
            tmpfs = tmpfs_options(req["limits"])
            timeout_s = req["limits"]["timeout_s"]
            check(UNSHARE(CLONE_NEWPID), "unshare pid")  # applies to the next child only
        except OSError:
            report = {"error": format_exc()[-2000:]}
        else:
            try:
                pid = os.fork()
            except OSError:
                pid, report = -1, {"error": format_exc()[-2000:]}
            if pid == 0:
                job_init((spec_fd, out_fd, err_fd, result_fd, drop, python, fresh), fresh, tmpfs)
            if pid > 0:
                # Wait first, tidy up after: while I and J live, each page the worker writes is
                # copied (copy-on-write, ~4.5 us here); once they are gone it is only re-enabled (~1 us).
                report = wait_job(pid, timeout_s)
            check(SETNS(own_pidns, CLONE_NEWPID), "setns pid")  # later children: back in our namespace
            if pid > 0:
                ready, status = job_ended(ready_r)
                if not ready:
                    report["setup_failed"] = True
                if status is not None and not report["timed_out"]:
                    report["status"] = status  # J's exit, not I's
        for fd in fds:
            os.close(fd)
        if fresh and leftovers.found():  # the job's processes are gone, something of it is not
            report["dirty"] = True
        report["op"] = "done"
        report["id"] = req["id"]
        ctl.send(json.dumps(report).encode())


def main():
    ctl = socket.socket(fileno=int(sys.argv[1]))
    with open(sys.argv[2], "rb") as fh:
        bpf = fh.read()
    serve(ctl, bpf, python=sys.argv[3], fresh=sys.argv[4:5] != ["session"])


if __name__ == "__main__":
    main()
