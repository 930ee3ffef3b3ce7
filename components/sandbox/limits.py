"""Resource limits for one job, derived from ``SandboxConfig``, and the uids jobs run as.

``Limits`` turns the recipe's few knobs (timeout, memory, output cap) into every limit
the sandbox applies: rlimits (CPU, address space, file size, open files, processes),
cgroup values, tmpfs sizes and the output flood threshold. ``UidPool`` hands each
concurrently running sandbox its own unprivileged host uid when run as root (otherwise
every job has this user's uid; ``posttrain sandbox doctor`` warns ``shared-job-uid``), so per-uid limits
(RLIMIT_NPROC) and signals never cross between jobs. A ``Lease`` is what one sandbox
holds on the host (its uid, its cgroup, the host's ends of its fds): taken together,
given back together in ``release``.

Not covered: per-recipe tuning of the derived values (they are constants here); disk
I/O bandwidth and network limits (there is no network). Without a memory cgroup
(``no-cgroup``) memory is bounded per process and per mapping only (``RLIMIT_AS``): what a
job holds outside its mappings, a memfd (``memfd_create``) filled with ``write`` or a SysV
shared memory segment after ``shmdt``, is not capped at all, so a job can hold far more
than ``memory_mb`` that way, and the
tmpfs folders add up to ``work_mb`` + 2 x ``tmp_mb`` beyond it.
"""

from __future__ import annotations

import fcntl
import math
import os
import threading
from dataclasses import dataclass

from components.core.errors import InfraError
from components.sandbox import cgroups

UID_BASE = 1_500_000  # far above login users, below the 2^31 kernel edge; no passwd entry needed
UID_SLOTS = 4096
MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    memory_mb: int
    output_cap: int
    cpu_s: int  # RLIMIT_CPU: the wall clock plus one second; SIGXCPU reads as a timeout
    fsize_mb: int = 16  # RLIMIT_FSIZE: largest single file the job may write
    nofile: int = 64
    nproc: int = 64  # RLIMIT_NPROC for the job's uid (each sandbox has its own uid)
    pids_max: int = 64  # cgroup pids.max: processes + threads in the job's tree
    cpus: float = 1.0  # cgroup cfs quota, in CPUs
    work_mb: int = 64  # tmpfs for /work (counts against memory in the cgroup)
    tmp_mb: int = 64  # tmpfs for /tmp
    result_cap: int = 1 << 20  # bytes of result JSON read back
    flood: int = 16 * MIB  # output beyond this kills the job

    @classmethod
    def from_config(cls, config) -> Limits:
        """From a ``SandboxConfig``: its timeout, memory and output cap; the rest derived."""
        timeout, memory, cap = float(config.timeout_s), int(config.memory_mb), int(config.output_cap_bytes)
        return cls(timeout_s=timeout, memory_mb=memory, output_cap=cap, cpu_s=math.ceil(timeout) + 1,
                   work_mb=min(64, memory), tmp_mb=min(64, memory), flood=max(16 * MIB, 64 * cap))

    def with_timeout(self, timeout_s: float) -> Limits:
        from dataclasses import replace

        return replace(self, timeout_s=timeout_s, cpu_s=math.ceil(timeout_s) + 1)

    def ulimit_script(self) -> str:
        """dash ``ulimit`` lines (``-p`` is RLIMIT_NPROC in dash, ``-v``/``-f`` in KiB/512 B)."""
        pairs = (("t", self.cpu_s), ("v", self.memory_mb * 1024), ("f", self.fsize_mb * 2048),
                 ("n", self.nofile), ("p", self.nproc), ("c", 0))
        return " && ".join(f"ulimit -{flag} {value}" for flag, value in pairs)

    def as_dict(self) -> dict:
        return {
            "cpu_s": self.cpu_s, "as_bytes": self.memory_mb * MIB, "fsize_bytes": self.fsize_mb * MIB,
            "nofile": self.nofile, "nproc": self.nproc, "work_bytes": self.work_mb * MIB,
            "tmp_bytes": self.tmp_mb * MIB, "timeout_s": self.timeout_s, "result_cap": self.result_cap,
        }


class UidPool:
    """Distinct unprivileged uids for concurrent sandboxes; the current uid when not root.

    A lease is exclusive across processes too: each leased uid holds an ``flock`` on
    ``<LOCK_DIR>/<uid>.lock``, so two host processes on one machine (two sandbox shards,
    two Airflow workers) never hand the same uid to jobs that run at the same time. The
    kernel drops the lock when a process dies, even by SIGKILL, so leases never leak.
    """

    def __init__(self, base: int = UID_BASE, slots: int = UID_SLOTS, lock_dir: str = "") -> None:
        self._free = list(range(base + slots - 1, base - 1, -1))
        self._held: dict[int, int] = {}
        self.history: set[int] = set()  # every uid this process ever leased (for leak checks)
        self._lock = threading.Lock()
        self.drops = os.geteuid() == 0
        self._lock_dir = lock_dir or ("/run/posttrain-sandbox-uids" if os.path.isdir("/run") else "/tmp/posttrain-sandbox-uids")

    def try_lock(self, uid: int) -> int | None:
        """A descriptor holding ``uid``'s lease lock, or None while another holder has it."""
        os.makedirs(self._lock_dir, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(self._lock_dir, f"{uid}.lock"), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def lease(self) -> int:
        """A uid of this pool's own; ``InfraError`` while every one is held (by this process
        or others) or its lock cannot be taken: the host's state, not the job's fault, so
        the job is an ``infra_error``."""
        if not self.drops:
            return os.geteuid()
        with self._lock:
            skipped = []
            try:
                while self._free:
                    uid = self._free.pop()
                    try:
                        fd = self.try_lock(uid)
                    except OSError as exc:  # the lock folder (full, read-only, gone): the host's state now
                        skipped.append(uid)
                        raise InfraError("a sandbox uid lock", self._lock_dir, exc.strerror or str(exc)) from exc
                    if fd is not None:
                        self._held[uid] = fd
                        self.history.add(uid)
                        return uid
                    skipped.append(uid)  # another process holds it
            finally:
                self._free.extend(reversed(skipped))
            raise InfraError("a free sandbox uid", self._lock_dir,
                             f"all {UID_SLOTS} sandbox uids are in use on this host (lower sandbox.concurrency)")

    def held(self) -> set[int]:
        """The uids this process holds now."""
        with self._lock:
            return set(self._held)

    def release(self, uid: int) -> None:
        if self.drops:
            with self._lock:
                fd = self._held.pop(uid, None)
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                self._free.append(uid)


UIDS = UidPool()


class Fds:
    """fds held for one sandbox: ``ours`` are the host's ends, closed by ``close_all``;
    ``theirs`` go to the sandbox and are closed by ``started()`` once it has them."""

    def __init__(self) -> None:
        self.ours: list[int] = []
        self.theirs: list[int] = []

    def keep(self, fd: int) -> int:
        self.ours.append(fd)
        return fd

    def give(self, fd: int) -> int:
        self.theirs.append(fd)
        return fd

    def pipe(self) -> tuple[int, int]:
        """(read end, kept here; write end, for the sandbox)."""
        r, w = os.pipe()
        return self.keep(r), self.give(w)

    def close(self, fd: int) -> None:
        """Close one of ``ours`` early (e.g. to send EOF)."""
        self.ours.remove(fd)
        os.close(fd)

    def started(self) -> None:
        for fd in self.theirs:
            os.close(fd)
        self.theirs.clear()

    def close_all(self) -> None:
        for fd in self.ours + self.theirs:
            try:
                os.close(fd)
            except OSError:
                pass
        self.ours, self.theirs = [], []


class Lease(Fds):
    """One sandbox's host resources: a uid from ``UIDS``, a cgroup (``cgroups.create_group``;
    None where there is no writable cgroup) and its fds; ``InfraError`` when no uid is
    free or the cgroup cannot be made (nothing is held then). ``release`` gives everything
    back, once; by default the group is removed (and only then the uid freed) on the
    cgroup reaper's thread, off the job's critical path: the result is returned while the
    kernel is still tearing down the job's namespaces."""

    def __init__(self, cgroup_v1, cgroup_v2: bool, memory_bytes: int, pids_max: int, cpus: float) -> None:
        super().__init__()
        self.uid = UIDS.lease()
        self.released = False
        try:
            self.group = cgroups.create_group(cgroup_v1, cgroup_v2, memory_bytes, pids_max, cpus)
        except OSError as exc:  # cgroupfs full, busy or gone: the host's state now, not the job's doing
            UIDS.release(self.uid)
            raise InfraError("a job cgroup", exc.filename or "cgroupfs", exc.strerror or str(exc)) from exc
        except BaseException:
            UIDS.release(self.uid)
            raise

    def procs_files(self) -> list[str]:
        return self.group.procs_files() if self.group else []

    def release(self, wait: bool = False) -> None:
        """Close every fd, kill what is left in the group and remove it, free the uid;
        ``wait``: do it now instead of on the cgroup reaper's thread."""
        if self.released:
            return
        self.released = True
        self.close_all()
        group, self.group = self.group, None
        if group and not wait:
            cgroups.REAPER.submit(self._give_back, group, self.uid)
        else:
            self._give_back(group, self.uid)

    @staticmethod
    def _give_back(group, uid: int) -> None:
        try:
            if group:
                group.close()  # kill what is left, wait for it to go, remove the folders
        finally:
            UIDS.release(uid)  # only then: the uid's next holder finds nothing of this job
