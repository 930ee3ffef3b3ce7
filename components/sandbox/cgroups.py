"""Per-job cgroups: memory, pids and cpu limits plus exact accounting, on v1 or v2.

A ``JobCgroup`` (v1) is a set of sibling folders, one per controller, created under the
cgroup this process already lives in (so an outer limit, e.g. a container's, still
applies). A ``JobCgroupV2`` is one folder under this process's cgroup v2 (its
``base_v2()``), with whichever of memory, pids and cpu that folder delegates. Processes
join by writing their pid to each ``cgroup.procs`` *before* they exec the sandbox (see
command.py's ``WRAPPER`` and ``host_argv``), so nothing escapes. After the job the group is
swept (SIGKILL to whatever is left; ``cgroup.kill`` on v2) and removed. ``create_group`` picks v1 where its
controllers are writable, else v2.

cgroup v2's "no internal processes" rule: a cgroup that hands controllers to children
may hold no processes itself (the root excepted). ``prepare_v2`` therefore enables the
controllers in this process's cgroup and, when this process is the only one there,
first moves itself into a leaf ``posttrain-supervisor`` — the usual set-up under a
systemd ``Delegate=yes`` unit or a container with its own cgroup namespace.

This is hand-written on purpose: the available libraries (cgroupspy, cgroup-utils) are
unmaintained wrappers over the same file writes.

Not covered: v2 limits on hosts that do not delegate the controllers (the group then
gives exact CPU time and ``cgroup.kill`` only, and the isolation string says so); on
this project's CI host v2 carries no memory/pids/cpu controllers (they are bound to v1),
so the v2 limit files are tested against a simulated cgroupfs only.
"""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from components.sandbox.background import Background

CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")  # cpuacct: exact CPU time of the whole tree
V2_CONTROLLERS = ("memory", "pids", "cpu")  # v2 reports CPU time (cpu.stat) without any controller
SUPERVISOR_LEAF = "posttrain-supervisor"
PREFIX = "posttrain-"
CREATED: set[str] = set()  # names of the job groups this process created


def _own_path(controller: str) -> str:
    """This process's cgroup path (relative) for a v1 controller, e.g. '/docker/abc'; with
    ``controller=""`` the v2 path (the unified line, ``0::/path``, names no controller)."""
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, names, path = line.rstrip("\n").split(":", 2)
            if controller in names.split(","):
                return path
    return "/"


def _mount(fstype: str, controller: str = "") -> Path | None:
    """Where a cgroup hierarchy is mounted, or None: v1 (``fstype="cgroup"``) holding
    ``controller``, or v2 (``"cgroup2"``: ``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified``
    on hybrid hosts)."""
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            found, _, options = right.split(" ", 2)
            if found == fstype and (not controller or controller in options.strip().split(",")):
                return Path(left.split(" ")[4])
    return None


@functools.cache
def base(controller: str) -> Path | None:
    """The folder our job groups go under for ``controller``, if it is writable (cached:
    a process does not change cgroup while it runs sandboxes)."""
    mount = _mount("cgroup", controller)
    if mount is None:
        return None
    here = mount / _own_path(controller).lstrip("/")
    folder = here if here.is_dir() else mount
    return folder if os.access(folder, os.W_OK) else None


def v1_writable() -> list[str]:
    """Controllers among CONTROLLERS where we can create and remove a group."""
    return [c for c in CONTROLLERS if (parent := base(c)) is not None and _probe(parent) is not None]


def _probe(parent: Path) -> list[str] | None:
    """Create and remove a group under ``parent``: the controllers it got (v2), None if
    no group can be created there."""
    probe = parent / f"{PREFIX}probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError:
        return None
    try:
        return _words(probe / "cgroup.controllers")
    finally:
        probe.rmdir()


@dataclass
class JobCgroup:
    """One job's groups. ``create`` then launch with ``procs_files``; ``close`` always."""

    name: str
    controllers: list[str]
    paths: dict[str, Path] = field(default_factory=dict)
    peak_stale: bool = False  # a reset was asked for and could not be done: no per-job peak

    @classmethod
    def create(cls, controllers: list[str], memory_bytes: int, pids_max: int, cpus: float) -> JobCgroup:
        group = cls(name=group_name(), controllers=list(controllers))
        CREATED.add(group.name)
        try:
            for controller in controllers:
                parent = base(controller)
                assert parent is not None, f"cgroup controller {controller} vanished"
                path = parent / group.name
                path.mkdir()
                group.paths[controller] = path
            group.limit_memory(memory_bytes)
            group._write("pids", "pids.max", pids_max)
            if cpus > 0:
                group._write("cpu", "cpu.cfs_period_us", 100_000)
                group._write("cpu", "cpu.cfs_quota_us", int(cpus * 100_000))
        except BaseException:
            group.close()
            raise
        return group

    # Raw os calls: these run several times per warm job, where pathlib's overhead showed.
    def _write(self, controller: str, name: str, value: int | str, optional: bool = False) -> None:
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

    def _key(self, controller: str, name: str, key: str) -> int | None:
        """The value of ``key`` in a flat-keyed file (``key value`` lines), or None."""
        for line in self._read(controller, name).splitlines():
            found, _, value = line.partition(" ")
            if found == key:
                return int(value)
        return None

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
        """A warm worker's group between two jobs: where ``memory.max_usage_in_bytes`` cannot
        be reset, the group reports no per-job peak (None) rather than the worker's lifetime
        peak, as on v2."""
        if "memory" not in self.paths:
            return
        try:
            self._write("memory", "memory.max_usage_in_bytes", 0)
            self.peak_stale = False
        except OSError:
            self.peak_stale = True

    def peak_memory_mb(self) -> float | None:
        if self.peak_stale:
            return None
        text = self._read("memory", "memory.max_usage_in_bytes").strip()
        return int(text) / 2**20 if text else None

    def cpu_time_s(self) -> float | None:
        text = self._read("cpuacct", "cpuacct.usage").strip()
        return int(text) / 1e9 if text else None

    def memory_bytes(self) -> int | None:
        """The group's memory use now (None without a memory controller)."""
        text = self._read("memory", "memory.usage_in_bytes").strip()
        return int(text) if text.isdigit() else None

    def _keys(self, controller: str, name: str, keys: tuple[str, ...]) -> int | None:
        """The sum of ``keys`` in a flat-keyed file, or None when one is missing."""
        found = {}
        for line in self._read(controller, name).splitlines():
            key, _, value = line.partition(" ")
            if key in keys:
                found[key] = int(value)
        return sum(found.values()) if len(found) == len(keys) else None

    def pinned_bytes(self) -> int | None:
        """Memory of the group that reclaim cannot free (no swap): anonymous plus shmem
        (tmpfs, memfds, SysV shm); None without a memory controller."""
        return self._keys("memory", "memory.stat", ("rss", "shmem")) if "memory" in self.paths else None

    def limit_memory(self, memory_bytes: int) -> None:
        """The memory limit (at creation, or lower later); memory+swap follows it (set
        after it: memory+swap may never be below the memory limit)."""
        self._write("memory", "memory.limit_in_bytes", memory_bytes)
        self._write("memory", "memory.memsw.limit_in_bytes", memory_bytes, optional=True)

    def oom_kills(self) -> int:
        """OOM kills inside the group so far (v1 ``memory.oom_control``: oom_kill N)."""
        kills = self._key("memory", "memory.oom_control", "oom_kill")
        if kills is not None:
            return kills
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
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

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


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def _try_write(path: Path, text: str) -> bool:
    try:
        path.write_text(text)
        return True
    except OSError:
        return False


_V2: dict[str, tuple[Path, tuple[str, ...]] | None] = {}


def base_v2() -> tuple[Path, tuple[str, ...]] | None:
    """(folder, controllers) for v2 job groups, or None when this process cannot create
    groups under its v2 cgroup. Prepared once per process (``prepare_v2``)."""
    if "base" not in _V2:
        mount = _mount("cgroup2")
        own = _own_path("").strip("/")
        # At the hierarchy's root take what it already delegates: enabling controllers
        # there would change the whole host.
        _V2["base"] = prepare_v2(mount / own, enable=bool(own)) if mount is not None else None
    return _V2["base"]


def prepare_v2(folder: Path, want: tuple[str, ...] = V2_CONTROLLERS,
               enable: bool = True) -> tuple[Path, tuple[str, ...]] | None:
    """Make ``folder`` (this process's v2 cgroup) able to hand ``want`` to job groups.

    With ``enable``, turns on in ``folder/cgroup.subtree_control`` each wanted controller
    that ``folder`` is offered, one at a time (a refused one costs only itself). When the
    kernel refuses because ``folder`` holds processes and this process is the only one
    there, moves this process into ``folder/posttrain-supervisor`` first. Returns
    (folder, controllers a job group gets), or None when no group can be created there.
    """
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        return None
    offered = [c for c in want if c in _words(folder / "cgroup.controllers")]
    missing = [c for c in offered if c not in _words(folder / "cgroup.subtree_control")] if enable else []
    if missing and not _try_write(folder / "cgroup.subtree_control", f"+{missing[0]}"):
        if _words(folder / "cgroup.procs") == [str(os.getpid())]:
            leaf = folder / SUPERVISOR_LEAF
            leaf.mkdir(exist_ok=True)
            _try_write(leaf / "cgroup.procs", str(os.getpid()))
    for controller in missing:
        _try_write(folder / "cgroup.subtree_control", f"+{controller}")
    got = _probe(folder)
    return None if got is None else (folder, tuple(c for c in want if c in got))


@dataclass
class JobCgroupV2(JobCgroup):
    """One job's v2 group: a single folder; limits for the controllers it was given,
    CPU time from ``cpu.stat`` (always there), peak from ``memory.peak`` through one
    kept-open fd (a write there resets the peak this fd sees, kernel >= 6.12)."""

    peak_fd: int = -1

    @classmethod
    def create_v2(cls, parent: Path, controllers: tuple[str, ...], memory_bytes: int, pids_max: int,
                  cpus: float, name: str = "") -> JobCgroupV2:
        """``name``: the folder's name (default a fresh ``posttrain-<hex>``)."""
        group = cls(name=name or group_name(), controllers=list(controllers))
        CREATED.add(group.name)
        try:
            path = parent / group.name
            path.mkdir(exist_ok=bool(name))
            group.paths["v2"] = path
            if "memory" in controllers:
                group.limit_memory(memory_bytes)
                group._write("v2", "memory.swap.max", 0, optional=True)
                with suppress(OSError):  # else peak_fd stays -1
                    group.peak_fd = os.open(f"{path}/memory.peak", os.O_RDWR)
            if "pids" in controllers:
                group._write("v2", "pids.max", pids_max)
            if "cpu" in controllers and cpus > 0:
                group._write("v2", "cpu.max", f"{int(cpus * 100_000)} 100000")
        except BaseException:
            group.close()
            raise
        return group

    def procs_files(self) -> list[str]:
        return [f"{self.paths['v2']}/cgroup.procs"] if "v2" in self.paths else []

    def reset_peak(self) -> None:
        """Kernels before 6.12 cannot reset ``memory.peak``: a warm worker's group then
        reports no per-job peak (None) rather than the worker's lifetime peak."""
        if "memory" not in self.controllers:
            return
        try:
            os.pwrite(self.peak_fd, b"reset", 0)  # EBADF when memory.peak could not be opened
            self.peak_stale = False
        except OSError:
            self.peak_stale = True

    def peak_memory_mb(self) -> float | None:
        if self.peak_stale:
            return None
        if self.peak_fd >= 0:
            text = os.pread(self.peak_fd, 64, 0).decode().strip()
        else:
            text = self._read("v2", "memory.peak").strip() if "memory" in self.controllers else ""
        return int(text) / 2**20 if text else None

    def cpu_time_s(self) -> float | None:
        usec = self._key("v2", "cpu.stat", "usage_usec")
        return None if usec is None else usec / 1e6

    def memory_bytes(self) -> int | None:
        text = self._read("v2", "memory.current").strip() if "memory" in self.controllers else ""
        return int(text) if text.isdigit() else None

    def pinned_bytes(self) -> int | None:
        return self._keys("v2", "memory.stat", ("anon", "shmem")) if "memory" in self.controllers else None

    def limit_memory(self, memory_bytes: int) -> None:
        if "memory" in self.controllers:
            self._write("v2", "memory.max", memory_bytes)

    def oom_kills(self) -> int:
        return self._key("v2", "memory.events", "oom_kill") or 0

    def kill_all(self) -> None:
        if "v2" in self.paths and not _try_write(self.paths["v2"] / "cgroup.kill", "1"):
            super().kill_all()  # kernels before 5.14: signal each process

    def close(self, wait_s: float = 2.0) -> None:
        if self.peak_fd >= 0:
            os.close(self.peak_fd)
            self.peak_fd = -1
        super().close(wait_s)


def create_group(v1_controllers: tuple[str, ...] | list[str], use_v2: bool, memory_bytes: int, pids_max: int,
                 cpus: float) -> JobCgroup | None:
    """A job group on v1 where its controllers are writable (``v1_controllers``, see
    ``v1_writable``), else on v2 (``use_v2``: ``base_v2()`` worked), else None."""
    if v1_controllers:
        return JobCgroup.create(list(v1_controllers), memory_bytes, pids_max, cpus)
    v2 = base_v2() if use_v2 else None
    if v2 is not None:
        return JobCgroupV2.create_v2(v2[0], v2[1], memory_bytes, pids_max, cpus)
    return None


REAPER = Background("sandbox-cgroup-reaper")  # closes groups off the job's critical path (Lease.release)


def group_name() -> str:
    """A fresh job group's name, ``posttrain-<creator pid>-<hex>``: the pid lets a later
    sweep tell a leaked group (its creator is gone) from one a live process still uses."""
    return f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"


def creator_pid(name: str) -> int | None:
    """The creating process's pid from a group's name; None for names without one."""
    pid, sep, rest = name[len(PREFIX):].partition("-")
    return int(pid) if name.startswith(PREFIX) and sep and rest and pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep_stale(min_age_s: float = 300.0, parents: list[Path] | None = None) -> int:
    """Remove leaked job groups: this project's groups (``posttrain-*``) under our parents
    that hold no process and whose creator is gone (dead pid, or this process but no
    longer in ``CREATED``). A group whose name carries no pid (older versions, probes)
    goes once it is also older than ``min_age_s``. Groups of live processes (another
    executor on the host) are left alone. Run when a sandbox executor starts, so a
    crashed or killed run's groups never pile up. Returns how many were removed."""
    now, removed = time.time(), 0
    for path in leftovers(parents=parents):
        if path.name in CREATED:
            continue
        pid = creator_pid(path.name)
        if pid is not None and pid != os.getpid() and _alive(pid):
            continue
        try:
            if pid is None and now - path.stat().st_mtime <= min_age_s:
                continue
            if (path / "cgroup.procs").read_text().split():
                continue
            if any(child.is_dir() for child in path.iterdir()):
                continue
            path.rmdir()
            removed += 1
        except OSError:  # gone already, or busy: the next sweep tries again
            continue
    return removed


def _v2_parent() -> Path | None:
    """Where v2 job groups go, found without preparing v2 (which may move this process)."""
    if _V2.get("base"):
        return _V2["base"][0]
    try:
        mount = _mount("cgroup2")
        own = _own_path("").strip("/")
    except OSError:
        return None
    if mount is None:
        return None
    folder = mount / own
    return folder.parent if folder.name == SUPERVISOR_LEAF else folder


def leftovers(mine_only: bool = False, parents: list[Path] | None = None) -> list[Path]:
    """Job groups that still exist (for tests and ``posttrain sandbox doctor``); with
    ``mine_only``, only those this process created (other runs may share the host).
    ``parents``: the folders to look in (default: our v1 controllers' and v2's)."""
    if parents is None:
        parents = [p for p in (base(controller) for controller in CONTROLLERS) if p is not None]
        v2 = _v2_parent()  # listing must not move this process: no prepare_v2 here
        if v2 is not None and v2 not in parents and os.access(v2, os.W_OK):
            parents.append(v2)
    found = []
    for parent in dict.fromkeys(parents):
        try:
            found.extend(p for p in parent.glob(f"{PREFIX}*") if p.is_dir() and p.name != SUPERVISOR_LEAF
                         and (not mine_only or p.name in CREATED))
        except OSError:
            continue
    return found
