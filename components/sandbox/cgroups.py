"""Per-job cgroup v1 groups: memory, pids and cpu limits plus exact accounting.

A ``JobCgroup`` is a set of sibling folders, one per controller, created under the
cgroup this process already lives in (so an outer limit, e.g. a container's, still
applies). Processes join by writing their pid to each ``cgroup.procs`` *before* they
exec the sandbox (see bwrap.py), so nothing escapes. After the job the group is swept
(SIGKILL to whatever is left) and removed.

This is ~80 lines by hand on purpose: the available libraries (cgroupspy, cgroup-utils)
are unmaintained wrappers over the same file writes.

Not covered: cgroup v2. Hosts with a delegated v2 subtree (``cgroup.subtree_control``
listing memory and pids) are detected but not used; the executor then relies on
rlimits + the pid namespace and says so in its isolation string.
"""

from __future__ import annotations

import functools
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")  # cpuacct: exact CPU time of the whole tree
PREFIX = "posttrain-"
CREATED: set[str] = set()  # names of the job groups this process created


def _own_path(controller: str) -> str:
    """This process's cgroup path (relative) for a v1 controller, e.g. '/docker/abc'."""
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, names, path = line.rstrip("\n").split(":", 2)
            if controller in names.split(","):
                return path
    return "/"


def _mount(controller: str) -> Path | None:
    """Where a v1 hierarchy holding ``controller`` is mounted, or None."""
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fstype, _, options = right.split(" ", 2)
            if fstype == "cgroup" and controller in options.strip().split(","):
                return Path(left.split(" ")[4])
    return None


@functools.cache
def base(controller: str) -> Path | None:
    """The folder our job groups go under for ``controller``, if it is writable (cached:
    a process does not change cgroup while it runs sandboxes)."""
    mount = _mount(controller)
    if mount is None:
        return None
    here = mount / _own_path(controller).lstrip("/")
    folder = here if here.is_dir() else mount
    return folder if os.access(folder, os.W_OK) else None


def v1_writable() -> list[str]:
    """Controllers among CONTROLLERS where we can create and remove a group."""
    ok = []
    for controller in CONTROLLERS:
        parent = base(controller)
        if parent is None:
            continue
        probe = parent / f"{PREFIX}probe-{uuid.uuid4().hex[:8]}"
        try:
            probe.mkdir()
            probe.rmdir()
            ok.append(controller)
        except OSError:
            continue
    return ok


@dataclass
class JobCgroup:
    """One job's groups. ``create`` then launch with ``procs_files``; ``close`` always."""

    name: str
    controllers: list[str]
    paths: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def create(cls, controllers: list[str], memory_bytes: int, pids_max: int, cpus: float) -> JobCgroup:
        group = cls(name=f"{PREFIX}{uuid.uuid4().hex[:12]}", controllers=list(controllers))
        CREATED.add(group.name)
        try:
            for controller in controllers:
                parent = base(controller)
                assert parent is not None, f"cgroup controller {controller} vanished"
                path = parent / group.name
                path.mkdir()
                group.paths[controller] = path
            group._write("memory", "memory.limit_in_bytes", memory_bytes)
            group._write("memory", "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
            group._write("pids", "pids.max", pids_max)
            if cpus > 0:
                group._write("cpu", "cpu.cfs_period_us", 100_000)
                group._write("cpu", "cpu.cfs_quota_us", int(cpus * 100_000))
        except BaseException:
            group.close()
            raise
        return group

    # Raw os calls: these run several times per warm job, where pathlib's overhead showed.
    def _write(self, controller: str, name: str, value: int, optional: bool = False) -> None:
        if controller not in self.paths:
            return
        try:
            fd = os.open(f"{self.paths[controller]}/{name}", os.O_WRONLY)
            try:
                os.write(fd, str(value).encode())
            finally:
                os.close(fd)
        except OSError:
            if not optional:
                raise

    def _read(self, controller: str, name: str) -> str:
        try:
            fd = os.open(f"{self.paths[controller]}/{name}", os.O_RDONLY)
        except (KeyError, OSError):
            return ""
        try:
            return os.read(fd, 1 << 16).decode()
        except OSError:
            return ""
        finally:
            os.close(fd)

    def procs_files(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in self.paths.values()]

    def reset_peak(self) -> None:
        self._write("memory", "memory.max_usage_in_bytes", 0, optional=True)

    def peak_memory_mb(self) -> float | None:
        text = self._read("memory", "memory.max_usage_in_bytes").strip()
        return int(text) / 2**20 if text else None

    def cpu_time_s(self) -> float | None:
        text = self._read("cpuacct", "cpuacct.usage").strip()
        return int(text) / 1e9 if text else None

    def oom_kills(self) -> int:
        """OOM kills inside the group so far (v1 ``memory.oom_control``: oom_kill N)."""
        for line in self._read("memory", "memory.oom_control").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        text = self._read("memory", "memory.failcnt").strip()
        return int(text) if text else 0

    def pids(self) -> list[int]:
        found: set[int] = set()
        for path in self.paths.values():
            try:
                found.update(int(p) for p in (path / "cgroup.procs").read_text().split())
            except OSError:
                continue
        return sorted(found)

    def kill_all(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self, wait_s: float = 2.0) -> None:
        """Kill what is left, wait for it to go, remove the folders."""
        deadline = time.monotonic() + wait_s
        while self.pids() and time.monotonic() < deadline:
            self.kill_all()
            time.sleep(0.005)
        for controller, path in list(self.paths.items()):
            for _ in range(200):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the last task is being reaped
                    time.sleep(0.005)
            self.paths.pop(controller, None)


class _Reaper:
    """Closes groups off the job's critical path: the job's result is returned while the
    kernel is still tearing down its namespaces; ``then`` (e.g. releasing the uid) runs
    once the group is empty and removed."""

    def __init__(self) -> None:
        self._todo: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending = 0

    def _loop(self) -> None:
        while True:
            group, then = self._todo.get()
            try:
                group.close()
            finally:
                if then is not None:
                    then()
                with self._lock:
                    self._pending -= 1

    def submit(self, group: JobCgroup, then: Callable[[], None] | None = None) -> None:
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="sandbox-cgroup-reaper", daemon=True)
                self._thread.start()
        self._todo.put((group, then))

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every submitted group is closed (tests, executor close)."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.005)


REAPER = _Reaper()


def sweep_stale(min_age_s: float = 300.0) -> int:
    """Remove empty job groups older than ``min_age_s`` (left by a crashed host process)."""
    removed = 0
    now = time.time()
    for path in leftovers():
        try:
            if now - path.stat().st_mtime > min_age_s and not (path / "cgroup.procs").read_text().split():
                path.rmdir()
                removed += 1
        except OSError:
            continue
    return removed


def leftovers(mine_only: bool = False) -> list[Path]:
    """Job groups that still exist (for tests and ``posttrain sandbox doctor``); with
    ``mine_only``, only those this process created (other runs may share the host)."""
    found = []
    for controller in CONTROLLERS:
        parent = base(controller)
        if parent is not None:
            found.extend(p for p in parent.glob(f"{PREFIX}*") if p.is_dir() and (not mine_only or p.name in CREATED))
    return found
