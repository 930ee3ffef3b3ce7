"""Watch one running job from the host: drain its pipes, enforce the wall clock, reap it.

Serves all three ways a job runs: a strict bwrap sandbox and a ``subprocess`` job (a
process we spawned: ``watch_process``) and a warm job (``watch`` on the worker's
control socket). ``watch`` multiplexes the job's stdout, stderr and result pipes plus a "finished" fd
(a pidfd for a process we spawned, or the warm worker's control socket) with one
``select.poll`` loop in the calling thread (no epoll instance to create and close per
job; a warm job is ~3 ms, so the host's share matters). Output beyond ``cap`` bytes is read and
dropped so the job never blocks on a full pipe; output beyond ``flood`` bytes kills
the job (a flood would otherwise burn host CPU until the timeout). On the deadline it
calls ``kill`` once and keeps draining briefly.

Not covered: the kill itself (the caller knows how to kill its tree) and accounting
beyond ``wait4`` (cgroup counters, the warm worker's report).
"""

from __future__ import annotations

import math
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

READ_CHUNK = 1 << 16
AFTER_EXIT_S = 0.5  # how long pipes may stay open after the job itself finished
# Readable, or the writer went away (a closed pipe reports POLLHUP, an error POLLERR): read to learn which.
READABLE = select.POLLIN | select.POLLHUP | select.POLLERR


@dataclass
class Watched:
    data: dict[str, bytearray] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)
    timed_out: bool = False
    flooded: bool = False
    finished: bool = False
    finished_at: float = 0.0


def kill_tree(pid: int, group=None) -> None:
    """SIGKILL the process group ``pid`` leads (we start every sandbox in its own session)
    and everything in its cgroup ``group``, if any."""
    with suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    if group:
        group.kill_all()


def job_streams(stdout: int, stderr: int, result: int | None, limits) -> dict[str, tuple[int, int]]:
    """name -> (fd, bytes kept) for a job's pipes (``limits``: a ``Limits``)."""
    streams = {"stdout": (stdout, limits.output_cap), "stderr": (stderr, limits.output_cap)}
    if result is not None:
        streams["result"] = (result, limits.result_cap)
    return streams


def watch(streams: dict[str, tuple[int, int]], finished_fd: int, on_finished: Callable[[], bool], deadline: float,
          kill: Callable[[], None], flood: int) -> Watched:
    """Drain ``streams`` (name -> (fd, bytes kept)) until ``on_finished()`` says done and
    the pipes closed (or time ran out).

    ``on_finished`` is called whenever ``finished_fd`` is readable and returns True once
    the job is over. ``deadline`` is a ``time.monotonic()`` value.
    """
    out = Watched({name: bytearray() for name in streams}, {name: 0 for name in streams})
    names = {fd: name for name, (fd, _) in streams.items()}
    poller = select.poll()
    for fd in names:
        os.set_blocking(fd, False)
        poller.register(fd, READABLE)
    poller.register(finished_fd, READABLE)
    killed = False
    while names or not out.finished:
        now = time.monotonic()
        if out.finished and now - out.finished_at > AFTER_EXIT_S:
            break  # an orphan kept a pipe open; the caller's sweep will kill it
        if not killed and now >= deadline:
            out.timed_out, killed = True, True
            kill()
            deadline = now + 2.0  # after the kill: bounded wait for the tree to go
        elif killed and now >= deadline:
            break
        limit = deadline - now if not out.finished else AFTER_EXIT_S - (now - out.finished_at)
        for fd, _ in poller.poll(max(0, math.ceil(limit * 1000))):
            if fd == finished_fd:
                if on_finished():
                    out.finished, out.finished_at = True, time.monotonic()
                    poller.unregister(finished_fd)
                continue
            try:
                chunk = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                continue
            name = names[fd]
            if not chunk:
                poller.unregister(fd)
                del names[fd]
                continue
            out.total[name] += len(chunk)
            room = streams[name][1] - len(out.data[name])
            if room > 0:
                out.data[name] += chunk[:room]
            if out.total[name] > flood and not killed:
                out.flooded, killed = True, True
                kill()
                deadline = time.monotonic() + 2.0
    return out


def watch_process(proc: subprocess.Popen, streams: dict[str, tuple[int, int]], deadline: float,
                  kill: Callable[[], None], flood: int) -> tuple[Watched, os.struct_rusage]:
    """``watch`` a process we spawned (finished: its pidfd), kill it if the watch gave up
    on it, and reap it with ``os.wait4``: this child's own rusage (``RUSAGE_CHILDREN``
    would mix concurrent jobs). Sets ``proc.returncode``."""
    pidfd = os.pidfd_open(proc.pid)
    try:
        seen = watch(streams, pidfd, lambda: True, deadline, kill, flood)
    finally:
        os.close(pidfd)
    if not seen.finished:
        kill()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    for stream in (proc.stdout, proc.stderr):
        if stream:
            stream.close()
    return seen, usage
