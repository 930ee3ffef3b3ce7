"""One writer per pipeline: ``posttrain run`` holds an exclusive lock on its home and the
pipeline's writer lease in the store; a second run on the same home, or on the same
pipeline in the same run root, is refused with exit status 2 and one line naming the
holder (host, pid, start time). A killed run's lease is taken over.

The lease rules run on a ``file://`` store directly; the rest starts ``posttrain run`` in
subprocesses as a user would.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from components.core import lease
from components.core.storage import Store
from dags.orchestrate import holder_text, stale_on_this_host
from tests.fixtures.runs import TINY, cli_env, posttrain, read_until, run_posttrain

HOLDER_LINE = re.compile(r"^posttrain: error: .*posttrain run on host (\S+) pid (\d+) started (\S+Z) home .*; fix: .*$")


def test_a_live_writer_lease_refuses_another_holder(tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}/store")
    first = lease.acquire_writer(store, "p", "A")
    with pytest.raises(lease.LeaseHeld) as info:
        lease.acquire_writer(store, "p", "B")
    assert "'A'" in str(info.value)
    assert lease.renew_writer(store, "p", "A")
    assert lease.current(store, "p", lease.WRITER).generation == first.generation + 1
    assert lease.release_writer(store, "p", "A")
    assert lease.acquire_writer(store, "p", "B").holder == "B"  # released: taken at once
    assert not lease.renew_writer(store, "p", "A")
    assert lease.held_by(store, "p", "B") == []  # the writer lease is no iteration lease


def test_a_stale_writer_lease_is_taken_over_by_exactly_one(tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}/store")
    lease.acquire_writer(store, "p", "dead")
    won: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def take(name: str) -> None:
        start.wait()
        try:
            got = lease.acquire_writer(store, "p", name, stale=lambda cur: cur.holder == "dead")
            won.append(got.holder)
        except lease.LeaseHeld as exc:
            errors.append(exc)

    threads = [threading.Thread(target=take, args=(f"t{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(errors) == 7, (won, errors)
    assert lease.current(store, "p", lease.WRITER).holder == won[0]


def test_a_dead_process_of_this_host_is_stale(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = subprocess.Popen(["true"])
    proc.wait()
    dead = holder_text(tmp_path / "elsewhere").replace(f"pid {os.getpid()}", f"pid {proc.pid}")
    alive = holder_text(tmp_path / "elsewhere")
    same_home = holder_text(home)
    other_host = dead.replace(f"host {socket.gethostname()}", "host some-other-machine")
    now = time.time()
    judge = stale_on_this_host(home)

    def lease_of(holder: str) -> lease.Lease:
        return lease.Lease(iteration=lease.WRITER, holder=holder, generation=0, acquired_at=now, expires_at=now + 60)

    assert judge(lease_of(dead)) and judge(lease_of(same_home))
    assert not judge(lease_of(alive)) and not judge(lease_of(other_host)) and not judge(lease_of("local:/x"))


def _one_line(stderr: str) -> re.Match:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr[-3000:]
    m = HOLDER_LINE.match(lines[0])
    assert m is not None, lines[0]
    return m


@pytest.mark.slow
def test_two_runs_on_one_fresh_home_one_runs_the_other_exits_2(tmp_path: Path) -> None:
    """Both start at once on a home with no MLflow database yet: the loser stops at the
    home's lock, before it touches MLflow (no schema-migration traceback)."""
    home = tmp_path / ".posttrain"
    args = posttrain("run", "--recipe", str(TINY), "--iterations", "1")
    procs = [subprocess.Popen(args, cwd=tmp_path, env=cli_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [(p.returncode, o[1][-2000:]) for p, o in zip(procs, outs, strict=True)]
    winner, loser = (0, 1) if procs[0].returncode == 0 else (1, 0)
    m = _one_line(outs[loser][1])
    assert (m[1], int(m[2])) == (socket.gethostname(), procs[winner].pid)
    assert "Traceback" not in outs[winner][0] + outs[winner][1]
    assert "Traceback" not in outs[loser][0] + outs[loser][1]


@pytest.mark.slow
def test_a_second_run_on_the_same_run_root_is_refused_then_takes_over_once_the_first_is_killed(tmp_path: Path) -> None:
    """Two homes (two machines, say), one run root and one tracking database: the second
    run is refused while the first one lives, and takes over its writer lease and its
    iteration once it is killed."""
    root = f"file://{tmp_path}/shared-store"
    tracking = f"sqlite:///{tmp_path}/shared-mlflow.db"
    first_home, second_home = tmp_path / "a" / ".posttrain", tmp_path / "b" / ".posttrain"
    args = ["run", "--recipe", str(TINY), "--iterations", "1", "--run-root", root]
    first = subprocess.Popen(posttrain(*args), cwd=tmp_path,
                             env=cli_env(first_home, MLFLOW_TRACKING_URI=tracking,
                                         POSTTRAIN_FAILPOINT="before-manifest:taskgen"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        read_until(first.stdout, "failpoint before-manifest:taskgen reached", [])
        refused = run_posttrain(args, tmp_path, cli_env(second_home, MLFLOW_TRACKING_URI=tracking))
        assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
        m = _one_line(refused.stderr)
        assert int(m[2]) == first.pid and f"run_root='{root}'" in refused.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    resumed = run_posttrain(args, tmp_path, cli_env(second_home, MLFLOW_TRACKING_URI=tracking))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    store = Store(root)
    assert store.exists("tiny/iter-000001/evaluation/_MANIFEST.json")
    assert lease.current(store, "tiny", 1).holder == f"local:{second_home}"
    assert lease.current(store, "tiny", lease.WRITER).holder == ""  # handed back at the end


@pytest.fixture
def sigterm_raises():
    """SIGTERM raises ``tracking.Terminated`` in this (main) thread, as under ``posttrain run``;
    the handlers and the recorded stop signals are put back after."""
    from components.core import runner

    before = {sig: signal.getsignal(sig) for sig in runner.STOP_SIGNALS}
    runner.stop_on_sigterm()
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)
    runner._stop_signals.clear()


def _hold_until_stopped() -> None:
    for _ in range(400):  # a stage running: only the lease's SIGTERM ends it
        time.sleep(0.05)
    raise AssertionError("the run was not stopped after losing its writer lease")


@pytest.mark.timeout(60)
def test_a_run_whose_writer_lease_is_taken_over_stops(tmp_path: Path, monkeypatch, sigterm_raises) -> None:
    from components.core.errors import UserError
    from dags.orchestrate import writer_lease

    monkeypatch.setattr(lease, "WRITER_TTL_S", 1.0)  # renewed every 0.2 s
    store = Store(f"file://{tmp_path}/store")
    with pytest.raises(UserError) as info:
        with writer_lease(store, "p", tmp_path / "home") as holder:
            assert lease.current(store, "p", lease.WRITER).holder == holder
            lease.acquire_writer(store, "p", "posttrain run on host elsewhere", stale=lambda cur: True)
            _hold_until_stopped()
    assert info.value.field == "run_root"
    assert "writer lease of pipeline 'p' was taken over by posttrain run on host elsewhere, so it stopped" in str(info.value)
    assert lease.current(store, "p", lease.WRITER).holder == "posttrain run on host elsewhere"  # not released by the loser


@pytest.mark.timeout(60)
def test_a_run_that_cannot_renew_for_the_lease_lifetime_stops(tmp_path: Path, monkeypatch, sigterm_raises) -> None:
    from components.core.errors import UserError
    from dags.orchestrate import writer_lease

    monkeypatch.setattr(lease, "WRITER_TTL_S", 1.0)
    store = Store(f"file://{tmp_path}/store")

    def unreachable(*args, **kwargs):
        raise ConnectionError("store down")

    with pytest.raises(UserError) as info:
        with writer_lease(store, "p", tmp_path / "home"):
            monkeypatch.setattr(lease, "renew_writer", unreachable)
            _hold_until_stopped()
    assert "was not renewed for 1 s (ConnectionError: the store is unreachable) and has expired" in str(info.value)


def test_a_run_that_keeps_its_writer_lease_releases_it(tmp_path: Path, monkeypatch) -> None:
    from dags.orchestrate import writer_lease

    monkeypatch.setattr(lease, "WRITER_TTL_S", 1.0)
    store = Store(f"file://{tmp_path}/store")
    with writer_lease(store, "p", tmp_path / "home") as holder:
        first = lease.current(store, "p", lease.WRITER).generation
        time.sleep(0.7)  # three renewals' time: the lease is renewed, not lost
        assert lease.current(store, "p", lease.WRITER).holder == holder
        assert lease.current(store, "p", lease.WRITER).generation > first
    assert lease.current(store, "p", lease.WRITER) is None or not lease.current(store, "p", lease.WRITER).live()
