"""The bwrap backend refuses weak isolation unless the recipe allows it, and says what it gave."""

from __future__ import annotations

import dataclasses
import os

import pytest

from components.core.errors import InfraError, UserError
from components.core.jobs import Job
from components.sandbox import bwrap, detect
from components.sandbox.detect import probe
from tests.sandbox.helpers import bwrap_unavailable, sandbox_config


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
        from components.core.errors import InfraError
        from components.sandbox.limits import UidPool
        pool = UidPool(base=2_000_000, slots=4, lock_dir={lock_dir!r})
        print(pool.lease(), pool.lease())
        try:
            pool.lease()
        except InfraError:
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


@pytest.mark.parametrize("rel", ["x\x00--bind\x00tmp\x00hosttmp", "main.py\x00", ".", "./main.py", "a/./b", "a/",
                                 "a//b", "/abs", "", "a/../../b"])
def test_a_file_path_that_is_not_plain_is_refused(rel):
    """A NUL in a job file name split into bwrap options of the job's choosing (bwrap reads
    ``--args`` NUL-separated): ``x\\0--bind\\0tmp\\0hosttmp`` mounted the host's /tmp
    writable at /hosttmp in strict mode. ``.`` and a trailing ``/`` named a folder."""
    with pytest.raises(ValueError, match="must be relative and stay inside the work folder") as err:
        detect.check_paths(Job("p", {rel: "x", "main.sh": "true"}, ["bash", "main.sh"]))
    assert repr(rel) in str(err.value)


def test_bwrap_options_refuse_an_option_holding_a_nul():
    """Defence in depth behind ``check_paths``: no option may split into several."""
    from components.sandbox.command import SandboxSpec, bwrap_options
    from components.sandbox.limits import Limits

    limits = Limits(timeout_s=1.0, memory_mb=64, output_cap=256, cpu_s=2)
    assert bwrap_options(SandboxSpec(uid=1, limits=limits, cmd=["true"], files=[(5, "ok.txt")])).endswith(
        b"--file\x005\x00/work/ok.txt\x00--remount-ro\x00/dev\x00--remount-ro\x00/\x00--chdir\x00/work\x00"
        b"--clearenv\x00--setenv\x00PATH\x00/usr/bin:/bin\x00--setenv\x00HOME\x00/work\x00--setenv\x00TMPDIR\x00/tmp\x00"
        b"--setenv\x00LANG\x00C.UTF-8\x00--cap-drop\x00ALL\x00")
    with pytest.raises(ValueError, match="holds a NUL byte"):
        bwrap_options(SandboxSpec(uid=1, limits=limits, cmd=["true"], files=[(5, "x\x00--bind\x00tmp\x00hosttmp")]))


def test_a_nul_in_a_file_name_mounts_nothing_of_the_hosts(executor, tmp_path):
    """Strict mode bind-mounted the host's /tmp writable (the job wrote a file there); warm
    mode's set-up failed (an infra_error, retried). Now every mode refuses the job before
    anything starts, as it refuses a path outside the work folder."""
    marker = f"posttrain-nul-escape-{os.getpid()}"
    job = Job("n", {"x\x00--bind\x00tmp\x00hosttmp": "hello", "main.sh": f"echo escaped > /hosttmp/{marker}"},
              ["bash", "main.sh"])
    with pytest.raises(ValueError, match="no NUL byte"):
        executor.run(job)
    assert not os.path.exists(f"/tmp/{marker}")
    assert executor.run(Job("ok", {"main.sh": "echo fine"}, ["bash", "main.sh"])).stdout == "fine\n"


def no_cgroup_now(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device", "/sys/fs/cgroup/memory/posttrain-test")


def no_uid_now(monkeypatch):
    from components.sandbox.limits import UIDS

    if not UIDS.drops:
        pytest.skip("uids are leased only when running as root")
    monkeypatch.setattr(UIDS, "_free", [])


@pytest.mark.skipif(bool(bwrap_unavailable()), reason="bwrap sandbox unavailable")
@pytest.mark.parametrize("short_of", ["uid", "cgroup"])
@pytest.mark.parametrize("weak", [False, True])
def test_a_probe_short_of_a_uid_or_cgroup_is_an_infra_error_and_not_kept(monkeypatch, short_of, weak):
    """All uids in use, or a cgroup that could not be made, while probing said "this host
    lacks user/pid/net/mount namespaces" (a UserError naming allow_weak_isolation, or with
    it the subprocess backend), and the probe kept that answer for the process's life."""
    from components.sandbox import cgroups

    if short_of == "uid":
        no_uid_now(monkeypatch)
    else:
        monkeypatch.setattr(cgroups, "create_group", no_cgroup_now)
    detect.probe.cache_clear()
    try:
        with pytest.raises(InfraError) as err:
            bwrap.BwrapExecutor(sandbox_config(allow_weak_isolation=weak))
        want = ("all 4096 sandbox uids are in use on this host" if short_of == "uid" else
                "a job cgroup unreachable at '/sys/fs/cgroup/memory/posttrain-test': No space left on device")
        assert want in err.value.line()
        monkeypatch.undo()
        assert probe("/usr/bin/python3").namespaces_ok  # the next probe tries again, and works
    finally:
        detect.probe.cache_clear()


@pytest.mark.skipif(bool(bwrap_unavailable()), reason="bwrap sandbox unavailable")
@pytest.mark.parametrize("short_of", ["uid", "cgroup"])
@pytest.mark.parametrize("mode", ["strict", "warm"])
def test_a_run_short_of_a_uid_or_cgroup_is_an_infra_error_result(monkeypatch, short_of, mode):
    """Uid exhaustion (RuntimeError) and a cgroup OSError came out of ``run`` as raw
    exceptions (warm mode: out of the executor's start); now each is an ``infra_error``
    result, which ``run_many`` retries, and the executor starts."""
    from components.sandbox import cgroups
    from components.sandbox.executor import get_executor

    probe(), probe("/usr/bin/python3")  # the host's real answer, kept
    if short_of == "uid":
        no_uid_now(monkeypatch)
    else:
        monkeypatch.setattr(cgroups, "create_group", no_cgroup_now)
    with get_executor(sandbox_config(mode=mode, concurrency=1)) as executor:
        result = executor.run(Job("r", {"main.sh": "echo hi"}, ["bash", "main.sh"]))
    assert (result.status, result.exit_code, result.stdout) == ("infra_error", -1, "")
    start = "could not start bwrap: " if mode == "strict" else "warm sandbox worker could not start: "
    assert result.stderr.startswith(start + ("a free sandbox uid unreachable" if short_of == "uid" else
                                             "a job cgroup unreachable at '/sys/fs/cgroup/memory/posttrain-test'"))
