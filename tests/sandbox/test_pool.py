"""Warm pools: a caller waiting for a worker, and a session worker that cannot start.

``WarmPool`` keeps ``size`` workers. A caller past ``size`` (``run_many`` with a larger
``concurrency`` than the executor's) waited on the idle queue with no timeout, and a
worker that died (an output flood, a lost worker) was dropped without waking it: the
run hung for good. A session worker that did not start raised ``pool.WorkerDied`` (a
``RuntimeError``) out of ``SessionPool.open()``, which the rollout stage's and the eval
suite's episodes, catching only ``InfraError``, ended with a traceback instead of
"unreachable" and exit status 1 (retried).
"""

from __future__ import annotations

import errno
import threading
import time

import pytest

from components.core.errors import InfraError
from components.core.jobs import Job, JobResult
from components.sandbox import pool as warm
from tests.sandbox.helpers import bwrap_unavailable, sandbox_config, sandbox_pids_after

needs_bwrap = pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"bwrap sandbox unavailable: {bwrap_unavailable()}")


def start(fn, *args) -> tuple[threading.Thread, dict]:
    """``fn(*args)`` on a daemon thread (one that hangs is left behind); its value in the dict once it returns."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(value=fn(*args)), daemon=True)
    thread.start()
    return thread, box


def within(seconds: float, fn, *args):
    """``fn(*args)``; fails the test if it has not returned in ``seconds``."""
    thread, box = start(fn, *args)
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return box["value"]


class FakeWorkers:
    """Stands in for ``pool.Worker``: a job named ``dies`` holds its worker until ``release``,
    then leaves it dead, as an output flood does; ``live`` counts workers started and not closed."""

    def __init__(self) -> None:
        self.started = self.live = self.most = 0
        self.busy, self.release = threading.Event(), threading.Event()
        fakes = self

        class Fake:
            def __init__(self, *args, **kwargs) -> None:
                self.alive, self.closed = True, False
                fakes.started += 1
                fakes.live += 1
                fakes.most = max(fakes.most, fakes.live)

            def run(self, job: Job, backend: str) -> JobResult:
                if job.job_id == "dies":
                    fakes.busy.set()
                    fakes.release.wait(10)
                    self.alive = False
                status = "killed" if job.job_id == "dies" else "ok"
                return JobResult(status=status, exit_code=0, signal=0, stdout=job.job_id, stderr="", duration_s=0.0,
                                 cpu_time_s=0.0, peak_memory_mb=0.0, backend=backend, isolation="fake")

            def close(self) -> None:
                if not self.closed:
                    fakes.live -= 1
                self.alive, self.closed = False, True

        self.Worker = Fake


@pytest.fixture()
def fakes(monkeypatch) -> FakeWorkers:
    made = FakeWorkers()
    monkeypatch.setattr(warm, "Worker", made.Worker)
    return made


def test_a_dead_workers_slot_goes_to_the_caller_waiting_for_one(fakes) -> None:
    pool = warm.WarmPool(None, "python3", None, 1, "fake")
    first, first_box = start(pool.run, Job("dies", {}, ["x"]), "bwrap")
    assert fakes.busy.wait(10)
    second, second_box = start(pool.run, Job("plain", {}, ["x"]), "bwrap")
    time.sleep(0.2)  # the second caller waits: the pool's one worker is busy
    assert second.is_alive()
    fakes.release.set()
    for thread in (first, second):
        thread.join(10)
        assert not thread.is_alive(), "a caller still waits for a worker"
    assert (first_box["value"].status, second_box["value"].status, second_box["value"].stdout) == ("killed", "ok", "plain")
    # the dead worker was replaced, and closed before its replacement started: never more than size at once
    assert (fakes.started, fakes.most) == (2, 1)
    pool.close()
    assert fakes.live == 0


def test_closing_the_pool_answers_a_waiting_caller(fakes) -> None:
    pool = warm.WarmPool(None, "python3", None, 1, "fake")
    first, _ = start(pool.run, Job("dies", {}, ["x"]), "bwrap")
    assert fakes.busy.wait(10)
    second, second_box = start(pool.run, Job("plain", {}, ["x"]), "bwrap")
    time.sleep(0.2)
    pool.close()
    second.join(10)
    assert not second.is_alive(), "a caller still waits on a closed pool"
    waited = second_box["value"]
    assert (waited.status, waited.stderr) == ("infra_error", "the warm pool is closed")
    fakes.release.set()
    first.join(10)
    assert fakes.live == 0


@needs_bwrap
def test_more_callers_than_warm_workers_and_a_flood_never_hang() -> None:
    """The review's repro: one warm worker, two callers, the first job floods its output
    (its worker is killed with it); the second caller waited forever."""
    from components.sandbox.executor import get_executor, run_many

    jobs = [Job("flood", {}, ["bash", "-c", "sleep 0.3; head -c 40000000 /dev/zero"]),
            Job("plain", {}, ["bash", "-c", "echo hi"])]
    with get_executor(sandbox_config(mode="warm", concurrency=1)) as executor:
        results = within(30, run_many, executor, jobs, 2)
    got = [(r.status, r.extra.get("reason"), r.stdout if r.status == "ok" else "") for r in results]
    assert got == [("killed", "output flood", ""), ("ok", None, "hi\n")], [r.stderr[-300:] for r in results]


@needs_bwrap
@pytest.mark.parametrize("failure", ["no start in time", "no fds"])
def test_a_session_worker_that_cannot_start_is_an_infra_error(monkeypatch, failure) -> None:
    from components.sandbox.session import SandboxSession, SessionPool

    cfg = sandbox_config(mode="warm", concurrency=1)
    if failure == "no start in time":  # a loaded or broken host
        monkeypatch.setattr(warm, "START_TIMEOUT_S", 0.0)
        why = "warm sandbox worker did not start"
    else:
        def no_fds(*args):
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(warm, "memfd_with", no_fds)
        why = "Too many open files"
    with SessionPool(cfg, 1) as pool:
        with pytest.raises(InfraError, match=f"^sandbox session unreachable at 'bwrap.*': .*{why}"):
            pool.open(60)
    with pytest.raises(InfraError, match=why):
        SandboxSession(cfg, 60)
    assert sandbox_pids_after(10) == []


@needs_bwrap
def test_an_episode_whose_session_cannot_start_is_an_infra_error(monkeypatch) -> None:
    """What the rollout stage and the eval suite catch (then exit 1, retried), not a traceback."""
    from components.rollout.interactive import interactive_specs, play
    from tests.domains.test_terminal_interactive import actor, cfgs, interactive_task

    tasks = [interactive_task("pick")]
    rollout_cfg, sandbox_cfg = cfgs(group_size=2)
    monkeypatch.setattr(warm, "START_TIMEOUT_S", 0.0)
    for replay in (True, False):
        with pytest.raises(InfraError, match="warm sandbox worker did not start"):
            play(actor(reads=True), tasks, interactive_specs(tasks), rollout_cfg, sandbox_cfg, seed=0, iteration=1,
                 replay=replay)
    assert sandbox_pids_after(10) == []


# A job that leaves state in an SCM_RIGHTS cycle: a socketpair in its own receive queue,
# carrying what it was sent. Nothing frees that when the job's processes die but the
# kernel's unix garbage collector, which runs only when some unix socket somewhere is
# released. The worker (whose cgroup and network namespace every later job shares) must
# not serve another job with that in it.
PIN_MEMORY = ("import os, socket\nfds = []\nfor i in range(6):\n    fd = os.memfd_create('pin')\n"
              "    for j in range(15):\n        os.write(fd, b'x' * (1 << 20))\n    fds.append(fd)\n"
              "x, y = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
              "for fd in fds:\n    socket.send_fds(x, [b'm'], [fd])\n"
              "socket.send_fds(x, [b'c'], [x.fileno(), y.fileno()])\nprint('pinned')\n")
TOUCH_80_MIB = "b = bytearray(80 << 20)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\nprint('got 80 MiB')\n"
KEEP_NAME = ("import socket\ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\ns.bind('\\0posttrain-left-name')\n"
             "x, y = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
             "socket.send_fds(x, [b'c'], [s.fileno(), x.fileno(), y.fileno()])\nprint('left')\n")
TAKE_NAME = ("import socket\ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\ns.bind('\\0posttrain-left-name')\n"
             "print('bound')\n")


def warm_job(job_id: str, src: str) -> Job:
    return Job(job_id, {"main.py": src}, ["{python}", "-I", "-S", "main.py"])


@needs_bwrap
def test_memory_a_warm_job_pins_past_its_exit_is_not_the_next_jobs() -> None:
    """Strict mode runs the second job ``ok``; warm mode made it ``oom`` (the pinned memfds
    stayed charged to the worker's cgroup, fitted to ``memory_mb``) until the kernel's unix
    garbage collector happened to run."""
    from components.sandbox.executor import get_executor

    with get_executor(sandbox_config(mode="warm", concurrency=1, memory_mb=128)) as executor:
        first = executor.run(warm_job("pin", PIN_MEMORY))
        second = executor.run(warm_job("use", TOUCH_80_MIB))
    assert (first.status, first.stdout) == ("ok", "pinned\n"), first.stderr
    assert (second.status, second.stdout) == ("ok", "got 80 MiB\n"), (second.extra, second.stderr[-300:])


@needs_bwrap
def test_an_abstract_socket_name_a_warm_job_bound_is_free_for_the_next_job() -> None:
    """Warm jobs share the worker's network namespace: a name kept alive past the job was
    taken for the next job (EADDRINUSE, a result strict mode never gives) and a channel to it."""
    from components.sandbox.executor import get_executor

    with get_executor(sandbox_config(mode="warm", concurrency=1)) as executor:
        results = [executor.run(warm_job(f"keep-{i}", KEEP_NAME if i % 2 == 0 else TAKE_NAME)) for i in range(4)]
    got = [(r.status, r.stdout) for r in results]
    assert got == [("ok", "left\n"), ("ok", "bound\n")] * 2, [r.stderr[-300:] for r in results]


@needs_bwrap
def test_a_pooled_session_worker_carries_no_socket_into_the_next_session() -> None:
    """A session worker given back is reused for the next session only without leftovers."""
    from components.sandbox.session import SessionPool

    with SessionPool(sandbox_config(mode="warm", concurrency=1), 1) as pool:
        with pool.open(60) as session:
            kept = session.exec(["python3", "-I", "-S", "-c", KEEP_NAME])
        with pool.open(60) as session:
            taken = session.exec(["python3", "-I", "-S", "-c", TAKE_NAME])
    assert (kept.status, kept.stdout) == ("ok", "left\n"), kept.stderr
    assert (taken.status, taken.stdout) == ("ok", "bound\n"), taken.stderr[-300:]
