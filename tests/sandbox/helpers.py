"""Helpers shared by the sandbox tests (configs, skip reason, host process scans)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from components.core.recipe import SandboxConfig
from components.sandbox.detect import probe
from components.sandbox.limits import UID_BASE, UID_SLOTS


def sandbox_config(**over) -> SimpleNamespace:
    """A SandboxConfig as a namespace (mode and allow_weak_isolation may be overridden)."""
    extra = {k: over.pop(k) for k in ("mode", "allow_weak_isolation") if k in over}
    fields = SandboxConfig(**{"backend": "bwrap", "timeout_s": 3.0, "concurrency": 2, **over}).model_dump()
    return SimpleNamespace(**{"mode": "strict", "allow_weak_isolation": False, **fields, **extra})


def bwrap_unavailable() -> str:
    support = probe()
    return "; ".join(support.missing + list(support.problems)) if support.missing else ""


def _held_elsewhere(uid: int) -> bool:
    """Whether another process holds ``uid``'s lease now (its lock cannot be taken)."""
    from components.sandbox.limits import UIDS

    fd = UIDS.try_lock(uid)
    if fd is None:
        return True
    os.close(fd)  # closing the only descriptor drops the lock
    return False


def sandbox_pids() -> list[int]:
    """Host pids running as a sandbox uid that this test process leased (every sandbox uid
    when it leased none: its sandboxes ran in a child process) and that no other process
    holds now (uid leases are exclusive across processes: once this process gave a uid
    back, another run on the host, such as another pytest-xdist worker, may lease it, and
    its sandboxes are not ours)."""
    from components.sandbox.limits import UIDS

    mine = UIDS.history if UIDS.drops else set(range(UID_BASE, UID_BASE + UID_SLOTS))
    mine = {uid for uid in mine if uid in UIDS.held() or not _held_elsewhere(uid)}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as fh:
                for line in fh:
                    if line.startswith("Uid:"):
                        uid = int(line.split()[1])
                        if uid in mine:
                            found.append(int(entry))
                        break
        except OSError:
            continue
    return found


def pids_with(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if token.encode() in fh.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def sandbox_pids_after(seconds: float = 10.0) -> list[int]:
    """``sandbox_pids()`` once they are gone or ``seconds`` have passed: sandboxes are torn
    down in the background (the reaper), and a loaded host is slow."""
    deadline = time.monotonic() + seconds
    while sandbox_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    return sandbox_pids()
