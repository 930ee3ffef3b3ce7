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
            no_new_privs once; every child inherits that.
      └─ J: the job, pid 1 of a new pid namespace, so when it exits (or is killed) the
            kernel kills everything it left in the namespace. New mount and ipc
            namespaces, private mounts, fresh size-capped tmpfs /work, /tmp and /dev/shm, its own
            /proc. Reads the spec, writes files, sets rlimits, drops its capabilities,
            installs the job seccomp filter (seccomp.py's ``job-on-zygote``: the
            namespace calls; the rest of the job policy is the worker's own filter,
            which J inherits), then runs the program. ``{python} -I -S
            script`` runs in this already-started interpreter (the warm path: no exec,
            no interpreter start-up); anything else is exec'd. The worker reads J's exit
            status and resource use with wait4, after J has exited: while J lives,
            each page the worker writes is a copy-on-write copy, so the worker blocks
            on J first and tidies up after.

The job cannot see or signal the worker (outside its pid namespace), cannot mount or
unshare (seccomp, no capabilities) and gets nothing from earlier jobs (fresh tmpfs and
IPC namespace; /dev is read-only, so nothing else there is writable; the worker holds no job data). As the init of its namespace, J ignores
signals it has no handler for when they come from inside (its own children), as any
init does; the wall-clock SIGKILL comes from the worker, outside.

Not covered: a job in the warm path shares the interpreter's already-imported stdlib
modules (ctypes, json, socket, ...) — they are imported but carry no state from other
jobs; threads a warm-path job leaves running are not joined at exit (os._exit).
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
JOB_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
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


def report_uncaught():
    """What the interpreter does with an uncaught exception: ``sys.excepthook``, and if
    the hook itself fails, both errors (as ``PyErr_PrintEx`` prints them)."""
    exc = sys.exc_info()
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

    def apply(self):  # no_new_privs is inherited from harden_worker (it cannot be unset)
        check(CAPSET(self.header_ptr, self.data), "capset")
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


def set_limits(lim):
    setrlimit = resource.setrlimit
    for which, key in RLIMITS:
        setrlimit(which, (lim[key], lim[key]))
    setrlimit(resource.RLIMIT_CORE, (0, 0))


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


def inline_python(argv):
    """argv[1:] when the job is '{python} -I -S script ...' (the warm path), else None."""
    if len(argv) >= 4 and argv[0] == "{python}" and sorted(argv[1:3]) == ["-I", "-S"] and not argv[3].startswith("-"):
        return argv[3:]
    return None


def stream(fd, mode, errors="surrogateescape", line_buffering=False):
    """A text stream over ``fd`` as the interpreter builds sys.stdin/stdout/stderr."""
    raw = io.FileIO(fd, mode, closefd=False)
    buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding="utf-8", errors=errors, line_buffering=line_buffering)


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
    Signal dispositions are the interpreter's start-up defaults already: the worker
    installs no handlers (``test_warm_job_signal_dispositions_are_the_interpreters``).
    """
    sys.stdin, sys.stdout, sys.stderr = JOB_STDIO
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = list(args)
    code = 0
    main = type(sys)("__main__")
    main.__file__ = args[0]
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    try:
        fd = os.open(args[0], os.O_RDONLY)  # not open(): no buffered file object to build
        try:
            source = read_all(fd)
        finally:
            os.close(fd)
        exec(compile(source, args[0], "exec"), main.__dict__)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # the job's own uncaught error: the interpreter hands it to sys.excepthook too
        report_uncaught()
        code = 1
    try:
        atexit._run_exitfuncs()
    except BaseException:
        report_uncaught()
    for out in (sys.stdout, sys.stderr):
        try:
            out.flush()
        except BaseException:
            pass
    os._exit(code & 0xFF)


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
        os.setsid()  # its own session and process group: kill(0, sig) cannot reach the worker
        set_limits(spec["limits"])
        drop.apply()
        os.write(READY_W, b"1")
        os.close(READY_W)
    except BaseException:
        fail_setup()
    script = inline_python(argv)
    if script is not None:
        run_inline(script)
    argv = [python if a == "{python}" else a for a in argv]
    try:
        os.execvpe(argv[0], argv, JOB_ENV)
    except OSError as exc:
        os.write(2, f"cannot run {argv[0]}: {exc}\n".encode())
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


def job_pid1(job_args, fresh, tmpfs):
    """The forked child: J, pid 1 of its own pid namespace. Never returns (and never
    unwinds back into the worker's loop); J closes the worker's fds in job_main."""
    try:
        PRCTL(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
        private_mounts(fresh, tmpfs)
    except BaseException:
        fail_setup(job_args[2])
    try:
        job_main(*job_args)
    finally:
        os._exit(SETUP_FAILED)


def wait_job(pid, timeout_s):
    """Wait for J (our child) under the wall clock; kill it when the clock runs out.
    Returns the report dict (status, CPU time and peak memory from wait4)."""
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


def job_was_ready(ready_r):
    """Whether the job that just ended finished its setup (drains the pipe)."""
    try:
        return bool(os.read(ready_r, 64))
    except BlockingIOError:
        return False


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


def serve(ctl, bpf, python, fresh):
    prctl(PR_SET_DUMPABLE, 0)
    harden_worker()
    global JOB_STDIO
    drop = PrivilegeDrop(bpf)
    JOB_STDIO = job_stdio()
    warm_up()
    gc.freeze()  # keep the collector in each forked job off the worker's pages (fewer copy-on-write faults)
    own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY)
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
                job_pid1((spec_fd, out_fd, err_fd, result_fd, drop, python, fresh), fresh, tmpfs)
            if pid > 0:
                # Wait first, tidy up after: while J lives, each page the worker writes is
                # copied (copy-on-write, ~4.5 us here); once J is gone it is only re-enabled (~1 us).
                report = wait_job(pid, timeout_s)
            check(SETNS(own_pidns, CLONE_NEWPID), "setns pid")  # later children: back in our namespace
            if pid > 0 and not job_was_ready(ready_r):
                report["setup_failed"] = True
        for fd in fds:
            os.close(fd)
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
