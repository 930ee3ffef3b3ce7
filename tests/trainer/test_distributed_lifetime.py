"""No torchrun worker outlives the trainer that launched it (``components/trainer/distributed.py``).

A SIGKILLed stage left torchrun and its workers training to the end, beside the next
attempt's, and its work folder (a copy of the starting checkpoint) in /tmp; a SIGTERMed
one left them until rank 0 next failed to write into the removed folder. A worker killed
by the OOM killer was reported as rank 0's gloo "Connection reset by peer".

Each case runs the tiny policy's steps with 2 processes on gloo, many times over, so the
run is still training when the test steps in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from components.core.errors import InfraError
from components.trainer.distributed import PROGRESS, WORK_PREFIX, sweep_work_folders, train, work_folder
from tests.rollout.helpers import tiny_policy
from tests.trainer.test_distributed import CFG, SEED, TEMPERATURE, make_batches

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 200  # x 3 steps: minutes of training, never reached
STARTED_S = 240  # until rank 0 reports its first step (torchrun's start on a loaded machine)
GONE_S = 5  # until no process naming the work folder is left

CHILD = """
import json, signal, sys
from components.core import tracking
from components.trainer.distributed import train, work_folder
from tests.rollout.helpers import tiny_policy
from tests.trainer.test_distributed import CFG, SEED, TEMPERATURE, make_batches
from tests.trainer.test_distributed_lifetime import ROUNDS

def stop(signum, frame):  # as the stage runner does (runner.stop_on_sigterm)
    raise tracking.Terminated("stopped by SIGTERM")

signal.signal(signal.SIGTERM, stop)
policy = tiny_policy()
with work_folder() as workdir:
    print(json.dumps({"workdir": str(workdir)}), flush=True)
    try:
        train(policy, make_batches(policy) * ROUNDS, CFG, temperature=TEMPERATURE, seed=SEED, iteration=1, workdir=workdir)
    except tracking.Terminated:
        # what is still running the moment the exception leaves train
        from tests.trainer.test_distributed_lifetime import naming
        print(json.dumps({"terminated": True, "left": naming(workdir)}), flush=True)
        raise
"""


def naming(folder: Path | str) -> list[int]:
    """Pids of the live processes whose command line names ``folder`` (torchrun and its workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(folder).encode() in cmdline.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def _wait_for(what, timeout_s: float, step_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(step_s)
    return what()


def _report(proc: subprocess.Popen) -> dict:
    """The child's next JSON line (its progress lines come between)."""
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"the child ended (exit {proc.wait()}) without a report")


def _started(workdir: Path) -> bool:
    return (workdir / PROGRESS).exists()


@pytest.fixture
def child(tmp_path, monkeypatch):
    """``CHILD`` running ``train`` in a process of its own; its workers are SIGKILLed at the
    end whatever the test saw, so a failing test leaves nothing running. The child and this
    process share a temporary folder of their own: a trainer of a test running beside this
    one sweeps the shared /tmp, and would remove a dead owner's folder before this test
    looks at it."""
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(private)})
    workdir = Path(_report(proc)["workdir"])
    yield proc, workdir
    for pid in naming(workdir):
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait()
    sweep_work_folders()


def test_a_sigkilled_trainer_leaves_no_worker_and_its_folder_is_swept(child) -> None:
    proc, workdir = child
    assert workdir.name.startswith(f"{WORK_PREFIX}{proc.pid}-")  # the owner's pid in the name
    assert _wait_for(lambda: _started(workdir), STARTED_S), (workdir / "workers.log").read_text()
    assert len(naming(workdir)) == 3  # torchrun and 2 workers
    proc.kill()
    proc.wait()
    assert _wait_for(lambda: not naming(workdir), GONE_S), naming(workdir)
    assert workdir.exists()  # a SIGKILLed owner removes nothing; the next trainer does
    with work_folder() as mine:
        assert not workdir.exists() and mine.exists()
    assert not mine.exists()


def test_a_sigtermed_trainer_stops_its_workers_before_train_returns(child) -> None:
    proc, workdir = child
    assert _wait_for(lambda: _started(workdir), STARTED_S), (workdir / "workers.log").read_text()
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    report = _report(proc)
    assert report == {"terminated": True, "left": []}  # reaped before the exception left train
    assert proc.wait(timeout=30) != 0 and time.monotonic() - started < 30
    assert not workdir.exists()  # work_folder removed it on the way out
    assert not naming(workdir)


def test_a_worker_killed_by_a_signal_is_named_with_it(tmp_path) -> None:
    """The OOM killer's SIGKILL of rank 1 read as rank 0's "Connection reset by peer"."""
    killed: list[int] = []

    def kill_rank_1() -> None:
        if not _wait_for(lambda: _started(tmp_path), STARTED_S):
            return
        for pid in naming(tmp_path):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"RANK=1" in environ and b"LOCAL_RANK=1" in environ:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    policy = tiny_policy()
    with pytest.raises(InfraError, match=r"torchrun exited with 1: rank 1 killed by SIGKILL \(out of memory\?"):
        train(policy, make_batches(policy) * ROUNDS, CFG, temperature=TEMPERATURE, seed=SEED, iteration=1,
              workdir=tmp_path)
    killer.join()
    assert len(killed) == 1 and not naming(tmp_path)
