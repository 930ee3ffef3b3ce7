"""cgroup v2 job groups: real groups on this host's v2 hierarchy (accounting, kill,
delegation to a leaf), and the limit files against a simulated cgroupfs.

This host binds memory, pids and cpu to v1, so its v2 hierarchy offers only ``hugetlb``;
the delegation test uses that controller to exercise the real kernel rules (no internal
processes, subtree_control), and the limit values are checked on plain files.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from components.core.jobs import Job
from components.sandbox import bwrap, cgroups
from components.sandbox.detect import probe
from tests.sandbox.helpers import bwrap_unavailable, sandbox_config

ROOT = Path(__file__).resolve().parents[2]
V2 = cgroups._mount("cgroup2")


def v2_unusable() -> str:
    if V2 is None:
        return "no cgroup2 mount"
    if os.geteuid() != 0:
        return "creating v2 groups here needs root"
    return "" if cgroups.base_v2() is not None else "cannot create groups under this process's v2 cgroup"


needs_v2 = pytest.mark.skipif(bool(v2_unusable()), reason=v2_unusable() or "ok")


@needs_v2
def test_v2_group_accounts_cpu_and_kills_the_whole_tree():
    parent, controllers = cgroups.base_v2()
    group = cgroups.JobCgroupV2.create_v2(parent, controllers, 256 << 20, 64, 1.0)
    path = group.paths["v2"]
    try:
        assert group.procs_files() == [f"{path}/cgroup.procs"]
        # Join before exec, as the launch chain does; burn 0.3 s of CPU, then leave a sleeper child.
        script = ("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\n"
                  "end = time.process_time() + 0.3\nwhile time.process_time() < end:\n    pass\n"
                  "if os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nprint('ready', flush=True)\ntime.sleep(600)\n")
        proc = subprocess.Popen([sys.executable, "-c", script, group.procs_files()[0]], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        members = group.pids()
        assert proc.pid in members and len(members) == 2  # the sleeper followed its parent into the group
        assert group.cpu_time_s() >= 0.3
        group.kill_all()  # cgroup.kill: one write takes the setsid'd sleeper too
        assert proc.wait(timeout=5) == -9
        deadline = time.monotonic() + 5
        while group.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert group.pids() == []
    finally:
        group.close()
    assert not path.exists()
    assert cgroups.leftovers(mine_only=True) == []


@pytest.mark.skipif(bool(bwrap_unavailable()) or bool(v2_unusable()), reason="needs bwrap and cgroup v2 groups")
@pytest.mark.parametrize("mode", ["strict", "warm"])
def test_executor_on_v2_records_exact_cpu_and_leaves_no_group(monkeypatch, mode):
    """With no writable v1 controllers the executor puts jobs (strict) or workers (warm) in v2 groups."""
    from components.sandbox.executor import get_executor

    real = probe()
    v2_support = dataclasses.replace(real, cgroup_v1=(), cgroup_v2=True, cgroup_v2_controllers=cgroups.base_v2()[1])
    monkeypatch.setattr(bwrap, "probe", lambda python: v2_support)
    executor = get_executor(sandbox_config(mode=mode, timeout_s=5.0))
    try:
        busy = Job("busy", {"main.py": "import time\nwhile time.process_time() < 0.3:\n    pass\n"},
                   ["{python}", "-I", "-S", "main.py"])
        result = executor.run(busy)
        assert result.status == "ok", result.stderr
        assert "cgroup-v2:" in result.isolation and "cgroup-v1" not in result.isolation
        assert result.cpu_time_s >= 0.3
        loop = Job("loop", {"main.py": "import os\nos.fork()\nwhile True:\n    pass\n"},
                   ["{python}", "-I", "-S", "main.py"], timeout_s=1.0)
        assert executor.run(loop).status == "timeout"
    finally:
        executor.close()
    cgroups.REAPER.drain()
    assert cgroups.leftovers(mine_only=True) == []


@pytest.fixture
def lone_cgroup():
    """A fresh v2 cgroup X under the root, with ``hugetlb`` offered to it (the one v2
    controller this host has); restored afterwards."""
    root = V2
    before = (root / "cgroup.subtree_control").read_text().split()
    if "hugetlb" not in (root / "cgroup.controllers").read_text().split():
        pytest.skip("no controller available on the v2 hierarchy")
    if "hugetlb" not in before:
        (root / "cgroup.subtree_control").write_text("+hugetlb")
    folder = root / f"posttrain-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    yield folder
    for leaf in sorted(folder.glob("*/"), reverse=True):
        if leaf.is_dir():
            leaf.rmdir()
    folder.rmdir()
    if "hugetlb" not in before:
        (root / "cgroup.subtree_control").write_text("-hugetlb")


PREPARE = ("import os, sys\nfrom pathlib import Path\nfrom components.sandbox import cgroups\n"
           "folder = Path(sys.argv[1])\n(folder / 'cgroup.procs').write_text(str(os.getpid()))\n"
           "print('joined', flush=True)\nsys.stdin.readline()\n"
           "got = cgroups.prepare_v2(folder, want=('hugetlb',))\n"
           "print(got[1] if got else None, open('/proc/self/cgroup').read().split('0::')[1].strip(), flush=True)\n")


def prepare_in(folder: Path) -> tuple[str, str]:
    """Start a process in ``folder``, have it run ``prepare_v2`` there; (controllers, its cgroup after)."""
    proc = subprocess.Popen([sys.executable, "-c", PREPARE, str(folder)], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "joined"
    proc.stdin.write("\n")
    proc.stdin.flush()
    controllers, where = proc.stdout.readline().split()
    proc.wait(timeout=10)
    return controllers, where


@pytest.mark.skipif(V2 is None or os.geteuid() != 0, reason="needs a cgroup2 mount and root")
def test_prepare_v2_moves_a_lone_supervisor_into_a_leaf_and_delegates(lone_cgroup):
    controllers, where = prepare_in(lone_cgroup)
    assert controllers == "('hugetlb',)"
    assert where == f"/{lone_cgroup.name}/{cgroups.SUPERVISOR_LEAF}"
    assert "hugetlb" in (lone_cgroup / "cgroup.subtree_control").read_text().split()


@pytest.mark.skipif(V2 is None or os.geteuid() != 0, reason="needs a cgroup2 mount and root")
def test_prepare_v2_leaves_a_shared_cgroup_alone(lone_cgroup):
    """Another process in X: the supervisor is not moved and job groups get no controllers."""
    neighbour = subprocess.Popen(["sleep", "60"])
    try:
        (lone_cgroup / "cgroup.procs").write_text(str(neighbour.pid))
        controllers, where = prepare_in(lone_cgroup)
        assert controllers == "()"
        assert where == f"/{lone_cgroup.name}"
        assert (lone_cgroup / "cgroup.subtree_control").read_text().split() == []
        assert not (lone_cgroup / cgroups.SUPERVISOR_LEAF).exists()
    finally:
        neighbour.kill()
        neighbour.wait()


def test_v2_limit_files_on_a_simulated_cgroupfs(tmp_path):
    """Values written to and parsed from a v2 group's files (plain files stand in for a
    cgroupfs whose memory, pids and cpu controllers are delegated)."""
    folder = tmp_path / "posttrain-sim"
    folder.mkdir()
    for name in ("memory.max", "memory.swap.max", "pids.max", "cpu.max", "cgroup.procs", "cgroup.kill"):
        (folder / name).write_text("")
    (folder / "memory.peak").write_text("3145728\n")
    (folder / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    group = cgroups.JobCgroupV2.create_v2(tmp_path, ("memory", "pids", "cpu"), 256 << 20, 64, 1.5,
                                          name="posttrain-sim")
    assert (folder / "memory.max").read_text() == str(256 << 20)
    assert (folder / "memory.swap.max").read_text() == "0"
    assert (folder / "pids.max").read_text() == "64"
    assert (folder / "cpu.max").read_text() == "150000 100000"
    assert group.peak_memory_mb() == 3.0
    assert group.cpu_time_s() == 1.5
    assert group.oom_kills() == 2
    group.kill_all()
    assert (folder / "cgroup.kill").read_text() == "1"
    os.close(group.peak_fd)
    group.peak_fd = -1
    for child in folder.iterdir():
        child.unlink()
    group.close()
    assert not folder.exists()


def test_v2_group_without_controllers_writes_no_limits(tmp_path):
    folder = tmp_path / "posttrain-bare"
    folder.mkdir()
    (folder / "cpu.stat").write_text("usage_usec 250000\n")
    group = cgroups.JobCgroupV2.create_v2(tmp_path, (), 256 << 20, 64, 1.0, name="posttrain-bare")
    assert sorted(p.name for p in folder.iterdir()) == ["cpu.stat"]
    assert group.cpu_time_s() == 0.25
    assert group.peak_memory_mb() is None
    assert group.oom_kills() == 0
    (folder / "cpu.stat").unlink()
    group.close()


def test_v1_peak_is_not_reported_when_it_cannot_be_reset(tmp_path, monkeypatch):
    """A v1 reset that failed was ignored, and the warm worker's lifetime peak was then
    reported as the next job's."""
    import errno

    folder = tmp_path / "memory"
    folder.mkdir()
    (folder / "memory.max_usage_in_bytes").write_text("9437184\n")
    group = cgroups.JobCgroup(name="posttrain-v1", controllers=["memory"], paths={"memory": folder})
    assert group.peak_memory_mb() == 9.0

    def refused(controller, name, value, optional=False):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(group, "_write", refused)
    group.reset_peak()
    assert group.peak_memory_mb() is None


def test_v2_peak_is_not_reported_when_it_cannot_be_reset(tmp_path):
    """Kernels before 6.12 cannot reset memory.peak: a warm worker's group must not pass
    the worker's lifetime peak off as the job's."""
    folder = tmp_path / "posttrain-old"
    folder.mkdir()
    (folder / "memory.max").write_text("")
    (folder / "memory.peak").write_text("9437184\n")
    (folder / "memory.peak").chmod(0o444)  # not openable for writing, as on older kernels
    group = cgroups.JobCgroupV2.create_v2(tmp_path, ("memory",), 256 << 20, 64, 0, name="posttrain-old")
    if group.peak_fd >= 0:  # root ignores file modes: take the fd away as an old kernel would
        os.close(group.peak_fd)
        group.peak_fd = -1
    assert group.peak_memory_mb() == 9.0  # one job per group (strict): the lifetime peak is the job's
    group.reset_peak()
    assert group.peak_memory_mb() is None
    for child in folder.iterdir():
        child.unlink()
    group.close()
