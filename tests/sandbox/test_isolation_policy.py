"""The bwrap backend refuses weak isolation unless the recipe allows it, and says what it gave."""

from __future__ import annotations

import dataclasses
import os

import pytest

from components.core.errors import UserError
from components.core.jobs import Job
from components.sandbox import bwrap, detect
from components.sandbox.detect import probe
from tests.sandbox.helpers import sandbox_config


def weakened(**changes):
    return dataclasses.replace(probe(), **changes)


def test_missing_bwrap_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.setattr(bwrap, "probe", lambda python: weakened(bwrap=None, namespaces_ok=False))
    with pytest.raises(UserError) as err:
        bwrap.BwrapExecutor(sandbox_config())
    assert err.value.field == "sandbox.allow_weak_isolation"
    assert "bubblewrap" in err.value.problem and "allow_weak_isolation: true" in err.value.fix


def test_missing_seccomp_is_refused(monkeypatch):
    monkeypatch.setattr(bwrap, "probe", lambda python: weakened(seccomp=False))
    with pytest.raises(UserError, match="seccomp"):
        bwrap.BwrapExecutor(sandbox_config())


def test_allowed_weak_isolation_runs_and_says_weak(monkeypatch):
    monkeypatch.setattr(bwrap, "probe", lambda python: weakened(bwrap=None, namespaces_ok=False))
    executor = bwrap.BwrapExecutor(sandbox_config(allow_weak_isolation=True))
    result = executor.run(Job("w", {"main.py": "print(2)"}, ["{python}", "-I", "-S", "main.py"]))
    assert result.status == "ok" and "WEAK" in result.isolation and "WEAK" in executor.isolation


@pytest.mark.parametrize("mode", ["strict", "warm"])
def test_allowed_weak_isolation_without_seccomp_runs_in_both_modes(monkeypatch, mode):
    """On a host without seccomp (pyseccomp not importable), warm mode raised
    ModuleNotFoundError though the recipe allowed weak isolation; strict mode ran."""
    import sys

    monkeypatch.setitem(sys.modules, "pyseccomp", None)
    detect.probe.cache_clear()  # the host as probed without pyseccomp, and not kept for later tests
    try:
        executor = bwrap.BwrapExecutor(sandbox_config(mode=mode, allow_weak_isolation=True))
        try:
            source = "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('Seccomp:')][0])"
            result = executor.run(Job("w", {"main.py": source}, ["{python}", "-I", "-S", "main.py"]))
        finally:
            executor.close()
    finally:
        detect.probe.cache_clear()
    assert (result.status, result.stdout) == ("ok", "0\n"), result.stderr  # no filter, as the isolation string says
    assert "no-seccomp(WEAK)" in result.isolation and "no-seccomp(WEAK)" in executor.isolation


def test_interpreter_outside_usr_is_refused():
    with pytest.raises(UserError) as err:
        bwrap.BwrapExecutor(sandbox_config(python="/root/.pyenv/versions/3.11.7/bin/python"))
    assert err.value.field == "sandbox.python"


def test_paths_escaping_the_work_folder_are_rejected():
    with pytest.raises(ValueError, match="inside the work folder"):
        detect.check_paths(Job("p", {"../evil.py": ""}, ["true"]))


def test_uid_leases_are_exclusive_across_processes(tmp_path):
    """Two host processes never lease the same sandbox uid at the same time."""
    import subprocess
    import sys
    import textwrap

    from components.sandbox.limits import UidPool

    if os.geteuid() != 0:
        pytest.skip("uid leasing only drops privileges when running as root")
    lock_dir = str(tmp_path / "uids")
    mine = UidPool(base=2_000_000, slots=4, lock_dir=lock_dir)
    held = [mine.lease(), mine.lease()]
    script = textwrap.dedent(f"""
        from components.sandbox.limits import UidPool
        pool = UidPool(base=2_000_000, slots=4, lock_dir={lock_dir!r})
        print(pool.lease(), pool.lease())
        try:
            pool.lease()
        except RuntimeError as exc:
            print("exhausted")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert sorted(int(u) for u in out[:2]) == sorted(set(range(2_000_000, 2_000_004)) - set(held))
    assert out[2] == "exhausted"
    mine.release(held[0])
    again = subprocess.run([sys.executable, "-c", script.replace("print(pool.lease(), pool.lease())", "print(pool.lease())")],
                           capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert held == [2_000_000, 2_000_001]
    assert int(again[0]) == held[0]  # the lowest free uid again; held[1] is still locked by this process
    mine.release(held[1])
