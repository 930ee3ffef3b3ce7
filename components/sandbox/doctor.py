"""``posttrain sandbox doctor``: what the sandbox needs here, and the real reason when it is missing.

Three checks:

- ``installed_causes`` (``doctor --installed``): the static prerequisites an image or a
  host must ship, checked without creating any namespace, so it runs inside an image
  build: bubblewrap >= 0.8, ``setpriv``, dash as ``/bin/sh``, Debian's
  ``/usr/bin/python3`` readable and executable by the sandbox uid, pyseccomp with
  libseccomp able to compile the job filter.
- ``diagnose`` (plain ``doctor``): when the probe sandbox (detect.py) failed, which
  confinement of *this* process caused it, read from what the kernel shows it
  (``HostView``): a seccomp filter that denies creating namespaces, a masked ``/proc``
  (files over-mounted, so the kernel refuses a fresh procfs to an unprivileged user
  namespace), AppArmor confinement, unprivileged user namespaces switched off by a
  sysctl. Each cause comes with the evidence and the fix (podman/docker flag, Kubernetes
  ``securityContext`` field, or sysctl). bwrap's own message for most of these ("likely
  because the kernel does not allow non-privileged user namespaces") names the sysctl
  even when a container's seccomp profile or masked paths are to blame.
- ``warnings``: what works now but breaks under load in a container: a supervisor that
  is PID 1 (nothing reaps the processes bwrap leaves behind; the zombies count against
  the jobs' RLIMIT_NPROC, 64, until sandboxes fail with EAGAIN), and jobs sharing a
  non-root supervisor's uid (RLIMIT_NPROC counts that uid host-wide, other containers'
  processes of the same uid included).

The diagnosis pairs the failing step in bwrap's message with the confinement that can
make that step fail: creating the user namespace -> userns sysctls, AppArmor's userns
restriction, a seccomp filter; a privileged call inside the sandbox's own namespace
(``sethostname``, ``setns``, mounts) -> a seccomp filter (podman's and Docker's default
profiles deny them without CAP_SYS_ADMIN); mounting ``/proc`` -> masked ``/proc``. A
masked ``/proc`` and AppArmor confinement are reported whenever the probe failed: they
stop a later step even once the first one is fixed. Nothing is reported when the probe
worked, whatever confinement is present (podman's default profile allows ``unshare``).

Not covered: SELinux policies (a denial shows up as the generic cause with bwrap's
message), gVisor specifics (its kernel passes or fails the probe like any other).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from components.sandbox.detect import DEFAULT_PYTHON
from components.sandbox.limits import Limits

MIN_BWRAP = (0, 8)  # --disable-userns and --size
NPROC = Limits.nproc  # RLIMIT_NPROC of every job
# Mount points under /proc the kernel still accepts a fresh procfs beside: they sit on
# permanently empty directories (mnt_already_visible in fs/namespace.c).
EMPTY_PROC_DIRS = ("/proc/sys/fs/binfmt_misc",)

FIX_SECCOMP = ("run the container with a seccomp profile that allows unshare, clone with namespace flags, sethostname, "
               "setns and mount: "
               "podman/docker --security-opt seccomp=unconfined; Kubernetes securityContext.seccompProfile.type: "
               "Unconfined (or a Localhost profile allowing them). The sandbox installs its own filter on every job.")
FIX_MASKED_PROC = ("unmask /proc: podman --security-opt unmask=ALL; docker --security-opt systempaths=unconfined; "
                   "Kubernetes securityContext.procMount: Unmasked (needs hostUsers: false). The sandbox mounts its "
                   "own fresh /proc, the kernel allows that only where no /proc path is over-mounted.")
FIX_APPARMOR = ("run the container unconfined by AppArmor or under a profile that allows mount and userns: "
                "podman/docker --security-opt apparmor=unconfined; Kubernetes securityContext.appArmorProfile.type: "
                "Unconfined (older clusters: the container.apparmor.security.beta.kubernetes.io annotation).")
FIX_PID1 = ("run under an init that reaps orphans: keep the posttrain images' entrypoint (tini); podman/docker "
            "run --init; on Kubernetes a pod command that replaces the entrypoint should start with "
            "/usr/bin/tini -s --, or set shareProcessNamespace: true (the pause process reaps)")
FIX_SHARED_UID = ("give each container its own host uids: Kubernetes hostUsers: false (a user namespace per pod), "
                  "podman --userns=auto; or run the supervisor as root inside a user namespace so each job gets its "
                  "own leased uid")
FIX_USERNS_CLONE = "on the node: sysctl -w kernel.unprivileged_userns_clone=1 (persist it in /etc/sysctl.d/)"
FIX_MAX_USERNS = "on the node: sysctl -w user.max_user_namespaces=15000 (persist it in /etc/sysctl.d/)"
FIX_APPARMOR_USERNS = ("on the node (Ubuntu 24.04+): sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or "
                       "install an AppArmor profile that grants bwrap 'userns'")


@dataclass(frozen=True)
class Cause:
    """One thing that stops the sandbox, what shows it, and how to fix it."""

    cause: str  # a short id: seccomp-filter, masked-proc, apparmor, userns-disabled, no-python, ...
    evidence: str
    fix: str

    def line(self) -> str:
        return f"{self.cause}: {self.evidence}\n  fix: {self.fix}"


@dataclass(frozen=True)
class HostView:
    """What the kernel shows this process about its own confinement (None: not readable)."""

    seccomp_mode: int | None  # /proc/self/status Seccomp: 0 none, 1 strict, 2 filter
    proc_overmounts: tuple[str, ...]  # mount points under /proc (from /proc/self/mountinfo)
    apparmor: str | None  # this process's AppArmor label, e.g. "containers-default-0.50.0 (enforce)"
    userns_clone: int | None  # kernel.unprivileged_userns_clone (Debian kernels)
    max_user_namespaces: int | None  # user.max_user_namespaces
    apparmor_restrict_userns: int | None  # kernel.apparmor_restrict_unprivileged_userns (Ubuntu)
    is_pid1: bool = False  # this process is PID 1 of its PID namespace (a container's first process)
    uid: int = 0  # this process's real uid, which jobs share when it is not root
    uid_tasks: int = 0  # processes + threads of that uid visible here (what RLIMIT_NPROC counts)
    zombies: int = 0  # of those, exited processes nobody reaped

    @property
    def apparmor_confined(self) -> bool:
        return bool(self.apparmor) and self.apparmor != "unconfined" and not self.apparmor.endswith("(unconfined)")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def seccomp_mode(status: str | None) -> int | None:
    match = re.search(r"^Seccomp:\s*(\d+)", status or "", flags=re.M)
    return int(match.group(1)) if match else None


def proc_overmounts(mountinfo: str | None) -> tuple[str, ...]:
    """Mount points strictly below /proc that block a fresh procfs (octal escapes decoded)."""
    found = []
    for line in (mountinfo or "").splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if point.startswith("/proc/") and point not in EMPTY_PROC_DIRS:
            found.append(point)
    return tuple(found)


def apparmor_label(root: Path) -> str | None:
    """The AppArmor label of this process, or None when AppArmor is not active here."""
    for rel in ("proc/self/attr/apparmor/current", "proc/self/attr/current"):
        text = _read(root / rel)
        if text is None:
            continue
        label = text.strip("\0\n ")
        # /proc/self/attr/current belongs to whichever LSM is first: an SELinux context
        # (user:role:type:level) is not an AppArmor label.
        if label and (rel.startswith("proc/self/attr/apparmor") or label == "unconfined" or label.endswith(")")):
            return label
    return None


def uid_tasks(root: Path, uid: int) -> tuple[int, int]:
    """(tasks, zombies) of real uid ``uid`` among the processes under ``root``/proc."""
    tasks = zombies = 0
    for status in (root / "proc").glob("[0-9]*/status"):
        text = _read(status) or ""
        uids = re.search(r"^Uid:\s*(\d+)", text, flags=re.M)
        if not uids or int(uids.group(1)) != uid:
            continue
        threads = re.search(r"^Threads:\s*(\d+)", text, flags=re.M)
        tasks += int(threads.group(1)) if threads else 1
        zombies += bool(re.search(r"^State:\s*Z", text, flags=re.M))
    return tasks, zombies


def read_view(root: Path = Path("/"), pid: int | None = None, uid: int | None = None) -> HostView:
    """``root`` is "/" except in tests, which fabricate a /proc tree under a temp folder
    (and pass the ``pid`` and ``uid`` that tree belongs to)."""
    pid = os.getpid() if pid is None else pid
    uid = os.getuid() if uid is None else uid
    tasks, zombies = uid_tasks(root, uid)
    return HostView(
        seccomp_mode=seccomp_mode(_read(root / "proc/self/status")),
        proc_overmounts=proc_overmounts(_read(root / "proc/self/mountinfo")),
        apparmor=apparmor_label(root),
        userns_clone=_int(_read(root / "proc/sys/kernel/unprivileged_userns_clone")),
        max_user_namespaces=_int(_read(root / "proc/sys/user/max_user_namespaces")),
        apparmor_restrict_userns=_int(_read(root / "proc/sys/kernel/apparmor_restrict_unprivileged_userns")),
        is_pid1=pid == 1, uid=uid, uid_tasks=tasks, zombies=zombies,
    )


def failed_step(failure: str) -> str:
    """Which step of starting a sandbox failed, from bwrap's message:

    - ``nproc``: a process could not be created (EAGAIN): the process limit is used up
    - ``userns``: creating the user namespace (or writing its uid map)
    - ``proc``: mounting the fresh /proc
    - ``mount``: another mount inside the sandbox (tmpfs, binds, remounts)
    - ``privileged``: another privileged call inside the user namespace (hostname, setns)
    - ``other``: anything else (the interpreter, the probe's own checks)
    """
    text = failure.lower()
    if "resource temporarily unavailable" in text or "(eagain)" in text:
        return "nproc"
    if any(words in text for words in ("new namespace", "uid map", "gid map", "setgroups", "unshare", "clone")):
        return "userns"
    if "mount proc" in text:
        return "proc"
    if any(words in text for words in ("mount", "pivot_root", "make / slave")):
        return "mount"
    if any(words in text for words in ("hostname", "setns", "operation not permitted", "capabilit")):
        return "privileged"
    return "other"


def diagnose(view: HostView, failure: str) -> list[Cause]:
    """The causes of a failed probe sandbox (``failure``: what detect.py reported): first
    what bwrap's failing step points at, then confinement that will stop a later step
    (a masked /proc fails the /proc mount even once namespaces work). Empty ``failure``
    (the probe worked) gives no causes."""
    if not failure:
        return []
    step = failed_step(failure)
    causes: list[Cause] = []
    seccomp_filter = view.seccomp_mode == 2
    if step == "nproc":
        causes.append(Cause("process-limit", f"bwrap could not create a process (EAGAIN): a job may have {NPROC} "
                            f"processes (RLIMIT_NPROC), which the kernel counts over every process and thread of "
                            f"the job's uid {view.uid} on the host; {view.uid_tasks} are visible here, "
                            f"{view.zombies} of them unreaped zombies", FIX_SHARED_UID))
        if view.is_pid1 and view.zombies:
            causes.append(pid1_cause())
    if step == "userns":
        if view.userns_clone == 0:
            causes.append(Cause("userns-disabled", "kernel.unprivileged_userns_clone = 0", FIX_USERNS_CLONE))
        if view.max_user_namespaces == 0:
            causes.append(Cause("userns-disabled", "user.max_user_namespaces = 0", FIX_MAX_USERNS))
        if view.apparmor_restrict_userns == 1:
            causes.append(Cause("apparmor-userns", "kernel.apparmor_restrict_unprivileged_userns = 1",
                                FIX_APPARMOR_USERNS))
    if seccomp_filter and (step in ("userns", "privileged", "mount") or (step == "proc" and not view.proc_overmounts)):
        what = {"userns": "creating a user namespace", "privileged": "a privileged call inside the sandbox's own "
                "user namespace (container runtimes' default profiles deny sethostname and setns without "
                "CAP_SYS_ADMIN)"}.get(step, "a mount inside the sandbox's own user namespace")
        causes.append(Cause("seccomp-filter", f"a seccomp filter is in force on this process (Seccomp: 2 in "
                            f"/proc/self/status) and {what} failed: {_bwrap_message(failure)}", FIX_SECCOMP))
    if view.proc_overmounts:
        shown = ", ".join(view.proc_overmounts[:6]) + (" ..." if len(view.proc_overmounts) > 6 else "")
        later = "" if step == "proc" else " (bwrap mounts it after the step that failed first)"
        causes.append(Cause("masked-proc", f"/proc is masked: {len(view.proc_overmounts)} paths in it are over-mounted "
                            f"({shown}), so the kernel refuses the sandbox a fresh procfs{later}", FIX_MASKED_PROC))
    if view.apparmor_confined:
        causes.append(Cause("apparmor", f"this process is confined by AppArmor profile {view.apparmor!r}, which can "
                            "deny user namespaces and mounts", FIX_APPARMOR))
    if not causes:
        causes.append(Cause("sandbox-failed", failure.strip()[-400:],
                            "see 'What the host must allow' in components/sandbox/README.md; an SELinux or custom "
                            "runtime policy denying unshare/mount shows up here"))
    return causes


def pid1_cause() -> Cause:
    return Cause("pid1-no-reaper", "this process is PID 1 of its PID namespace: processes bwrap leaves behind are "
                 "handed to it and stay zombies, each counting against the jobs' process limit until new sandboxes "
                 "fail with 'Resource temporarily unavailable'", FIX_PID1)


def warnings(view: HostView) -> list[Cause]:
    """What works now but degrades or breaks under load (reported, not refused)."""
    found = [pid1_cause()] if view.is_pid1 else []
    if view.uid != 0:
        found.append(Cause("shared-job-uid", f"not root, so every job runs as this process's uid {view.uid}: their "
                           f"process limit ({NPROC}) counts all processes and threads of uid {view.uid} on the host, "
                           f"other containers' of that uid too ({view.uid_tasks} visible here)", FIX_SHARED_UID))
    return found


def _bwrap_message(failure: str) -> str:
    lines = [line for line in failure.splitlines() if "bwrap:" in line]
    return (lines[-1][lines[-1].index("bwrap:"):] if lines else failure.strip())[:300]


def _bwrap_version(bwrap: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"(\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


def unreadable_for_others(path: str) -> str:
    """'' when any uid can execute ``path`` (leased sandbox uids own nothing and are in no
    group), else the first file or folder on its way that stops them."""
    real = Path(os.path.realpath(path))
    for part in [*reversed(real.parents), real]:
        try:
            mode = part.stat().st_mode
        except OSError as exc:
            return f"{part}: {exc.strerror}"
        need = stat.S_IXOTH if part != real else stat.S_IXOTH | stat.S_IROTH
        if mode & need != need:
            return f"{part} has mode {stat.filemode(mode)}"
    return ""


def python_causes(python: str) -> list[Cause]:
    fix = "apt-get install python3 (Debian's /usr/bin/python3; the sandbox shows only /usr to a job)"
    if not python.startswith("/usr/"):
        return [Cause("python-outside-usr", f"{python} is not under /usr, the only host tree a sandbox sees",
                      "leave sandbox.python empty to use /usr/bin/python3")]
    if not os.path.exists(python):
        return [Cause("no-python", f"{python} does not exist", fix)]
    if not os.access(python, os.X_OK | os.R_OK):
        return [Cause("python-unreadable", f"{python} is not readable/executable by uid {os.geteuid()}", fix)]
    why = unreadable_for_others(python)
    if why:
        return [Cause("python-unreadable", f"{python}: the sandbox's leased uids cannot run it ({why})",
                      "chmod o+rx the interpreter and the folders above it")]
    try:
        proc = subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.version_info >= (3, 9))"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return [Cause("python-broken", f"{python} does not start: {exc}", fix)]
    if proc.stdout.strip() != "True":
        return [Cause("python-broken", f"{python} -I -S failed or is older than 3.9: {proc.stderr.strip()[-200:]}",
                      fix)]
    return []


def installed_causes(python: str = DEFAULT_PYTHON) -> list[Cause]:
    """The static prerequisites: what an image must ship, checked without any namespace."""
    from components.sandbox import seccomp
    from components.sandbox.command import SH, tool

    causes: list[Cause] = []
    bwrap = tool("bwrap")
    if not bwrap:
        causes.append(Cause("no-bwrap", "bubblewrap is not installed", "apt-get install bubblewrap"))
    else:
        version = _bwrap_version(bwrap)
        if version is None or version < MIN_BWRAP:
            causes.append(Cause("old-bwrap", f"{bwrap} is version {version}, the sandbox needs >= 0.8 "
                                "(--disable-userns, --size)", "apt-get install bubblewrap from Debian 12 or newer"))
    if not tool("setpriv"):
        causes.append(Cause("no-setpriv", "setpriv is missing (drops root to the sandbox uid)",
                            "apt-get install util-linux"))
    if not os.path.realpath(SH).endswith("dash"):
        causes.append(Cause("sh-not-dash", f"{SH} is {os.path.realpath(SH)}; the launch wrapper uses dash's ulimit",
                            "apt-get install dash (Debian's /bin/sh)"))
    causes += python_causes(python)
    why = seccomp.available()
    if not why:
        try:
            seccomp.bpf("job")
        except Exception as exc:  # noqa: BLE001 - any failure to compile means no filter
            why = f"compiling the job filter failed: {exc}"
    if why:
        causes.append(Cause("no-seccomp", why, "pip install pyseccomp; apt-get install libseccomp2"))
    return causes


def run(installed_only: bool = False, python: str = DEFAULT_PYTHON) -> tuple[dict, list[Cause]]:
    """The doctor's JSON report and the causes that make the sandbox refuse (empty: it would run)."""
    causes = installed_causes(python)
    if installed_only:
        return {"checked": "installed", "python": python, "causes": [asdict(c) for c in causes],
                "missing": [c.cause for c in causes]}, causes
    from components.sandbox.detect import probe

    support = probe(python)
    report = asdict(support)
    report.update(isolation=support.isolation, missing=support.missing, refuses_without_flag=bool(support.missing))
    if support.bwrap and not support.namespaces_ok:
        failure = next((p for p in support.problems if p.startswith("probe sandbox")), "probe sandbox failed")
        found = diagnose(read_view(), failure)
        if not (causes and [c.cause for c in found] == ["sandbox-failed"]):  # else the installed causes explain it
            causes += found
    elif support.missing and not causes:
        causes.append(Cause("sandbox-failed", "; ".join(support.missing + list(support.problems)),
                            "see 'What the host must allow' in components/sandbox/README.md"))
    report.update(checked="runtime", causes=[asdict(c) for c in causes],
                  warnings=[asdict(w) for w in warnings(read_view())])
    return report, causes
