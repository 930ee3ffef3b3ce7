"""``posttrain sandbox doctor`` names the real cause of a failed sandbox, with its fix.

    pytest tests/sandbox/test_doctor.py

Fast: the diagnosis runs on fabricated /proc trees (what a process sees inside podman
with its defaults, inside Docker, on Ubuntu 24.04, on a Debian kernel with user
namespaces off) paired with the message bwrap prints in each case; the install checks
run on this host and on fabricated interpreters; the CLI wiring runs with a stand-in
probe. The same diagnosis inside real containers is tests/containers/test_images.py.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from components.sandbox import doctor
from components.sandbox.detect import Support

# What a process in a podman 4.3 container with default options sees (masked and read-only paths).
PODMAN_MOUNTINFO = """\
79 61 0:43 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
52 79 0:43 /bus /proc/bus ro,nosuid,nodev,noexec,relatime - proc proc rw
53 79 0:43 /fs /proc/fs ro,nosuid,nodev,noexec,relatime - proc proc rw
54 79 0:43 /irq /proc/irq ro,nosuid,nodev,noexec,relatime - proc proc rw
55 79 0:43 /sys /proc/sys ro,nosuid,nodev,noexec,relatime - proc proc rw
56 79 0:48 / /proc/acpi ro,relatime - tmpfs tmpfs ro
57 79 0:44 /null /proc/keys rw,nosuid,noexec - tmpfs tmpfs rw,size=65536k,mode=755
58 79 0:44 /null /proc/timer_list rw,nosuid,noexec - tmpfs tmpfs rw,size=65536k,mode=755
80 61 0:45 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
"""
UNMASKED_MOUNTINFO = """\
79 61 0:43 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
81 79 0:50 / /proc/sys/fs/binfmt_misc rw,relatime - binfmt_misc binfmt_misc rw
80 61 0:45 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
"""
HOSTNAME = "probe sandbox failed (exit 1): bwrap: Can't set hostname to sandbox: Operation not permitted"
PROC = "probe sandbox failed (exit 1): bwrap: Can't mount proc on /newroot/proc: Operation not permitted"
USERNS = ("probe sandbox failed (exit 1): bwrap: No permissions to create new namespace, likely because the kernel "
          "does not allow non-privileged user namespaces. See <https://deb.li/bubblewrap>.")
ENOSPC = ("probe sandbox failed (exit 1): bwrap: Creating new namespace failed: nesting depth or "
          "/proc/sys/user/max_*_namespaces exceeded (ENOSPC)")
EAGAIN = "probe sandbox failed (exit 1): bwrap: Creating new namespace failed: Resource temporarily unavailable"


def fake_root(tmp_path: Path, seccomp: int = 0, mountinfo: str = UNMASKED_MOUNTINFO, apparmor: str | None = None,
              attr_current: str | None = None, sysctls: dict[str, str] | None = None) -> Path:
    """A folder holding proc/self/{status,mountinfo,attr/...} and proc/sys/... as a process would see them."""
    proc = tmp_path / "proc"
    (proc / "self" / "attr").mkdir(parents=True)
    (proc / "self" / "status").write_text(f"Name:\tpython3\nNoNewPrivs:\t0\nSeccomp:\t{seccomp}\nSeccomp_filters:\t"
                                          f"{1 if seccomp == 2 else 0}\n")
    (proc / "self" / "mountinfo").write_text(mountinfo)
    if apparmor is not None:
        (proc / "self" / "attr" / "apparmor").mkdir()
        (proc / "self" / "attr" / "apparmor" / "current").write_text(apparmor + "\n")
    if attr_current is not None:
        (proc / "self" / "attr" / "current").write_text(attr_current)
    for rel, value in (sysctls or {"user/max_user_namespaces": "96364"}).items():
        (proc / "sys" / rel).parent.mkdir(parents=True, exist_ok=True)
        (proc / "sys" / rel).write_text(value + "\n")
    return tmp_path


def causes(tmp_path: Path, failure: str, **view) -> list[str]:
    return [c.cause for c in doctor.diagnose(doctor.read_view(fake_root(tmp_path, **view)), failure)]


def test_podman_defaults_name_the_seccomp_filter_then_the_masked_proc(tmp_path):
    found = doctor.diagnose(doctor.read_view(fake_root(tmp_path, seccomp=2, mountinfo=PODMAN_MOUNTINFO)), HOSTNAME)
    assert [c.cause for c in found] == ["seccomp-filter", "masked-proc"]
    assert "Seccomp: 2" in found[0].evidence and "Can't set hostname" in found[0].evidence
    assert "seccomp=unconfined" in found[0].fix and "seccompProfile.type: Unconfined" in found[0].fix
    assert "7 paths" in found[1].evidence and "/proc/keys" in found[1].evidence
    assert "unmask=ALL" in found[1].fix and "procMount: Unmasked" in found[1].fix


def test_unmasked_but_filtered_names_only_seccomp(tmp_path):
    assert causes(tmp_path, HOSTNAME, seccomp=2) == ["seccomp-filter"]


def test_unconfined_seccomp_but_masked_proc_names_only_the_mask(tmp_path):
    found = doctor.diagnose(doctor.read_view(fake_root(tmp_path, mountinfo=PODMAN_MOUNTINFO)), PROC)
    assert [c.cause for c in found] == ["masked-proc"]
    assert "after the step" not in found[0].evidence  # /proc is the step that failed


def test_docker_default_seccomp_blocking_the_user_namespace_is_not_blamed_on_the_sysctl(tmp_path):
    found = doctor.diagnose(doctor.read_view(fake_root(tmp_path, seccomp=2)), USERNS)
    assert [c.cause for c in found] == ["seccomp-filter"]
    assert "creating a user namespace failed" in found[0].evidence


def test_debian_sysctl_off_names_the_sysctl_not_seccomp(tmp_path):
    sysctls = {"kernel/unprivileged_userns_clone": "0", "user/max_user_namespaces": "15000"}
    found = doctor.diagnose(doctor.read_view(fake_root(tmp_path, sysctls=sysctls)), USERNS)
    assert [c.cause for c in found] == ["userns-disabled"]
    assert found[0].evidence == "kernel.unprivileged_userns_clone = 0"
    assert "sysctl -w kernel.unprivileged_userns_clone=1" in found[0].fix


def test_max_user_namespaces_zero(tmp_path):
    found = doctor.diagnose(doctor.read_view(fake_root(tmp_path, sysctls={"user/max_user_namespaces": "0"})), ENOSPC)
    assert [(c.cause, c.evidence) for c in found] == [("userns-disabled", "user.max_user_namespaces = 0")]


def test_ubuntu_apparmor_userns_restriction(tmp_path):
    sysctls = {"kernel/apparmor_restrict_unprivileged_userns": "1", "user/max_user_namespaces": "63000"}
    found = doctor.diagnose(doctor.read_view(fake_root(tmp_path, apparmor="unconfined", sysctls=sysctls)), USERNS)
    assert [c.cause for c in found] == ["apparmor-userns"]
    assert "apparmor_restrict_unprivileged_userns=0" in found[0].fix


def test_apparmor_profile_denying_mounts(tmp_path):
    found = doctor.diagnose(doctor.read_view(fake_root(tmp_path, apparmor="docker-default (enforce)")), PROC)
    assert [c.cause for c in found] == ["apparmor"]
    assert "docker-default (enforce)" in found[0].evidence
    assert "apparmor=unconfined" in found[0].fix and "appArmorProfile.type: Unconfined" in found[0].fix


def test_apparmor_label_from_the_legacy_attr_file_but_not_an_selinux_context(tmp_path):
    assert doctor.read_view(fake_root(tmp_path / "a", attr_current="containers-default-0.50.0 (enforce)\n")).apparmor_confined
    selinux = doctor.read_view(fake_root(tmp_path / "b", attr_current="system_u:system_r:container_t:s0:c1,c2\0"))
    assert selinux.apparmor is None
    assert causes(tmp_path / "c", PROC, attr_current="system_u:system_r:container_t:s0") == ["sandbox-failed"]


def test_unknown_failure_keeps_bwraps_message(tmp_path):
    found = doctor.diagnose(doctor.read_view(fake_root(tmp_path)), "probe sandbox failed (exit 1): bwrap: something new")
    assert [c.cause for c in found] == ["sandbox-failed"] and "something new" in found[0].evidence


def test_a_working_probe_reports_nothing_whatever_the_confinement(tmp_path):
    assert doctor.diagnose(doctor.read_view(fake_root(tmp_path, seccomp=2, mountinfo=PODMAN_MOUNTINFO)), "") == []


def test_view_reads_nothing_it_cannot_find(tmp_path):
    view = doctor.read_view(tmp_path, pid=7, uid=10001)
    assert view == doctor.HostView(None, (), None, None, None, None, is_pid1=False, uid=10001, uid_tasks=0, zombies=0)



def add_processes(root: Path, *procs: tuple[int, int, str, int]) -> None:
    """(pid, uid, state, threads) entries under root/proc."""
    for pid, uid, state, threads in procs:
        (root / "proc" / str(pid)).mkdir(parents=True)
        (root / "proc" / str(pid) / "status").write_text(
            f"Name:\tbwrap\nState:\t{state}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nThreads:\t{threads}\n")


def test_zombies_under_a_pid1_supervisor_use_up_the_job_process_limit(tmp_path):
    root = fake_root(tmp_path, seccomp=0)
    add_processes(root, (1, 10001, "S (sleeping)", 6), *[(100 + i, 10001, "Z (zombie)", 1) for i in range(60)],
                  (900, 0, "S (sleeping)", 1))
    view = doctor.read_view(root, pid=1, uid=10001)
    assert (view.is_pid1, view.uid_tasks, view.zombies) == (True, 66, 60)
    found = doctor.diagnose(view, EAGAIN)
    assert [c.cause for c in found] == ["process-limit", "pid1-no-reaper"]  # not blamed on seccomp or sysctls
    assert "66 are visible here, 60 of them unreaped zombies" in found[0].evidence
    assert "hostUsers: false" in found[0].fix and "tini" in found[1].fix and "--init" in found[1].fix


def test_warnings_for_a_pid1_supervisor_and_a_shared_job_uid(tmp_path):
    root = fake_root(tmp_path)
    add_processes(root, (1, 10001, "S (sleeping)", 3))
    assert [w.cause for w in doctor.warnings(doctor.read_view(root, pid=1, uid=10001))] == ["pid1-no-reaper", "shared-job-uid"]
    assert [w.cause for w in doctor.warnings(doctor.read_view(root, pid=2, uid=10001))] == ["shared-job-uid"]
    assert doctor.warnings(doctor.read_view(root, pid=2, uid=0)) == []  # root: each job gets its own leased uid


def test_proc_overmounts_skip_binfmt_misc_and_decode_escapes():
    info = ("1 0 0:1 / /proc rw - proc proc rw\n"
            "2 1 0:2 / /proc/sys/fs/binfmt_misc rw - binfmt_misc binfmt_misc rw\n"
            "3 1 0:3 /null /proc/my\\040file rw - tmpfs tmpfs rw\n"
            "4 0 0:4 / /procfoo rw - tmpfs tmpfs rw\n")
    assert doctor.proc_overmounts(info) == ("/proc/my file",)


@pytest.mark.parametrize("failure, step", [(EAGAIN, "nproc"), (HOSTNAME, "privileged"), (PROC, "proc"), (USERNS, "userns"), (ENOSPC, "userns"),
                                           ("bwrap: Failed to mount tmpfs: Operation not permitted", "mount"),
                                           ("probe sandbox could not start: [Errno 2] No such file", "other")])
def test_failed_step(failure, step):
    assert doctor.failed_step(failure) == step


def test_this_hosts_install_is_complete():
    assert doctor.installed_causes() == []


def test_missing_or_misplaced_python(tmp_path):
    assert [c.cause for c in doctor.python_causes("/usr/bin/no-such-python3")] == ["no-python"]
    assert [c.cause for c in doctor.python_causes(str(tmp_path / "python3"))] == ["python-outside-usr"]


def test_interpreter_the_sandbox_uid_cannot_run():
    with tempfile.TemporaryDirectory(dir="/tmp") as top:  # pytest's own tmp root is private (0700)
        os.chmod(top, 0o755)
        _check_modes(Path(top))


def _check_modes(top: Path):
    private = top / "private"
    private.mkdir(mode=0o700)
    exe = private / "python3"
    exe.write_text("")
    exe.chmod(0o755)
    assert doctor.unreadable_for_others(str(exe)) == f"{private} has mode drwx------"
    private.chmod(0o755)
    exe.chmod(0o750)
    assert doctor.unreadable_for_others(str(exe)) == f"{exe} has mode -rwxr-x---"
    exe.chmod(0o755)
    assert doctor.unreadable_for_others(str(exe)) == ""
    assert doctor.unreadable_for_others("/usr/bin/python3") == ""


def test_installed_mode_reports_a_missing_bwrap(monkeypatch):
    from components.sandbox import command

    real = command.tool
    monkeypatch.setattr(command, "tool", lambda name: None if name == "bwrap" else real(name))
    assert [c.cause for c in doctor.installed_causes()] == ["no-bwrap"]


def _failing_support() -> Support:
    return Support(bwrap="/usr/bin/bwrap", bwrap_version="bubblewrap 0.8.0", setpriv="/usr/bin/setpriv",
                   python="/usr/bin/python3", seccomp=True, cgroup_v1=(), cgroup_v2=False, cgroup_v2_controllers=(),
                   landlock_abi=0, drops_uid=False, namespaces_ok=False, problems=(HOSTNAME,))


def test_cli_doctor_prints_the_causes_and_exits_1(tmp_path, monkeypatch, capsys):
    from components import cli
    from components.sandbox import detect

    root = fake_root(tmp_path, seccomp=2, mountinfo=PODMAN_MOUNTINFO)
    monkeypatch.setattr(detect, "probe", lambda python="/usr/bin/python3": _failing_support())
    real_read_view = doctor.read_view
    monkeypatch.setattr(doctor, "read_view", lambda _root=None: real_read_view(root, pid=1, uid=10001))
    assert cli.main(["sandbox", "doctor"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["checked"] == "runtime" and report["isolation"].startswith("process+rlimits (WEAK")
    assert [c["cause"] for c in report["causes"]] == ["seccomp-filter", "masked-proc"]
    assert [w["cause"] for w in report["warnings"]] == ["pid1-no-reaper", "shared-job-uid"]
    assert "would refuse to run the sandbox" in err and "- seccomp-filter:" in err and "fix: " in err
    assert "warning: pid1-no-reaper:" in err


def test_cli_doctor_installed_needs_no_namespaces(monkeypatch, capsys):
    from components import cli
    from components.sandbox import detect

    def no_probe(*_args, **_kwargs):
        raise AssertionError("--installed must not start a sandbox")

    monkeypatch.setattr(detect, "probe", no_probe)
    assert cli.main(["sandbox", "doctor", "--installed"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {"checked": "installed", "python": "/usr/bin/python3", "causes": [], "missing": []}


def test_cli_doctor_on_this_host_finds_nothing_missing(capsys):
    """This host has every layer (``test_this_hosts_install_is_complete``); the expected exit
    status used to come from the same probe the doctor runs, so a probe that wrongly found
    something missing passed."""
    from components import cli

    code = cli.main(["sandbox", "doctor"])
    report = json.loads(capsys.readouterr().out)
    assert (code, report["causes"], report["missing"]) == (0, [], [])
    assert "WEAK" not in report["isolation"] and report["isolation"].startswith("bwrap:user,pid,net,ipc,uts,mount")
