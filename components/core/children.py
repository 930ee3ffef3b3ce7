"""Child processes that do not outlive the process that started them (Linux).

A child started with ``preexec_fn=die_with_parent(signal.SIGTERM)`` gets that signal
from the kernel when its parent dies (``PR_SET_PDEATHSIG``), however the parent dies:
SIGKILL, the OOM killer, a crash. Used for vLLM's server (``components/rollout/vllm_server.py``)
and the trainer's ``torchrun`` (``components/trainer/distributed.py``); a process can
also ask it for itself (``set_death_signal``: the trainer's workers, children of torchrun).

``prctl`` is looked up in the parent, so the child between fork and exec only calls
it (no ``dlopen`` there). A child whose parent died before the call cannot get the
signal any more, so it exits at once instead of running on.

Not covered: systems without Linux's prctl (the functions do nothing there; callers
still stop their children themselves), and a parent thread other than the one that
waits for the child: the kernel sends the signal when the *thread* that forked the
child ends, so start a child from the thread that outlives it.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's ``prctl``, or None where there is none (not Linux/glibc)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when the calling
    process dies (exit status 1 at once if it already has)."""
    prctl, parent = _prctl(), os.getpid()

    def preexec() -> None:
        if prctl is None:
            return
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # died between fork and prctl: no signal will come
            os._exit(1)

    return preexec


def set_death_signal(sig: signal.Signals = signal.SIGKILL) -> bool:
    """This process gets ``sig`` when its parent dies; False where that cannot be set."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's too: signal 0 is refused, not
    answered with "no such process")."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
