"""The leaked-cgroup sweep at sandbox executor start: groups whose creator is gone and
that hold no process are removed; groups of live processes are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from components.sandbox import cgroups

PARENT = cgroups.base("pids") if "pids" in cgroups.v1_writable() else None
needs_v1 = pytest.mark.skipif(PARENT is None, reason="no writable v1 pids cgroup on this host")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def make(name: str, parent=None):
    path = (parent or PARENT) / name
    path.mkdir()
    return path


def test_names_carry_the_creator_pid():
    name = cgroups.group_name()
    assert cgroups.creator_pid(name) == os.getpid()
    assert cgroups.creator_pid("posttrain-probe-1234abcd") is None
    assert cgroups.creator_pid("posttrain-0123456789ab") is None
    assert cgroups.creator_pid("other-12-ab") is None


@needs_v1
def test_sweep_removes_groups_of_dead_creators_only():
    tag = uuid.uuid4().hex[:8]
    # A folder of this test's own (its name is not posttrain-*): a sandbox executor starting
    # meanwhile in another process on the host sweeps the parent, never inside this folder.
    parent = make(f"sweep-test-{tag}")
    leaked = [make(f"{cgroups.PREFIX}{dead_pid()}-{tag}{i}", parent) for i in range(30)]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live_empty = make(f"{cgroups.PREFIX}{sleeper.pid}-{tag}live", parent)  # a live creator between mkdir and join
        occupied = make(f"{cgroups.PREFIX}{dead_pid()}-{tag}busy", parent)
        (occupied / "cgroup.procs").write_text(str(sleeper.pid))
        young_unnamed = make(f"{cgroups.PREFIX}{tag}young0000", parent)  # no pid: kept until old enough
        assert cgroups.sweep_stale(parents=[parent]) == 30
        assert not any(p.exists() for p in leaked)
        assert live_empty.exists() and occupied.exists() and young_unnamed.exists()
        assert cgroups.sweep_stale(min_age_s=0, parents=[parent]) == 1
        assert not young_unnamed.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
        time.sleep(0.05)
        live = parent / f"{cgroups.PREFIX}{sleeper.pid}-{tag}live"
        if live.exists():
            live.rmdir()
        cgroups.sweep_stale(min_age_s=0, parents=[parent])
        left = [p.name for p in parent.iterdir() if p.is_dir()]
        if not left:
            parent.rmdir()
    assert left == []


@needs_v1
def test_sweep_leaves_this_process_live_groups():
    group = cgroups.JobCgroup.create(["pids"], memory_bytes=1 << 26, pids_max=16, cpus=0)
    try:
        assert cgroups.creator_pid(group.name) == os.getpid()
        cgroups.sweep_stale(min_age_s=0, parents=[PARENT])
        assert group.paths["pids"].exists()
    finally:
        group.close()
        cgroups.CREATED.discard(group.name)


@needs_v1
def test_executor_start_sweeps():
    """A killed run's groups are gone once a new executor starts (BwrapExecutor calls sweep_stale)."""
    from components.core.recipe import SandboxConfig
    from components.sandbox.bwrap import BwrapExecutor

    leaked = [make(f"{cgroups.PREFIX}{dead_pid()}-{uuid.uuid4().hex[:8]}") for _ in range(5)]
    executor = BwrapExecutor(SandboxConfig(allow_weak_isolation=True, concurrency=1))
    try:
        assert not any(p.exists() for p in leaked)
    finally:
        executor.close()
