"""A trainer node other than the leader says it is still training while its workers run.

Before, a PyTorchJob worker pod's log showed "node r of n | N steps under torchrun" and
nothing else until the stage's end (hours, which looks like a hang): the step count is
rank 0's ``PROGRESS`` file, on the leader's disk, and the others' bar had 0 steps. Here
torchrun is a stand-in process that polls as ``_launch`` waits on it, each poll a minute
on the patched clock: no torchrun, no test waits.
"""

from __future__ import annotations

import subprocess

from components.core import progress
from components.core.nodes import Node
from components.trainer import distributed


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class Torchrun:
    """Runs ``polls`` polls of a minute each, then exits 0."""

    def __init__(self, clock: Clock, polls: int) -> None:
        self.clock, self.left = clock, polls

    def __call__(self, cmd, **kw):
        self.cmd = cmd
        return self

    def wait(self, timeout=None):
        if self.left == 0:
            return 0
        self.left -= 1
        self.clock.now += 60.0
        raise subprocess.TimeoutExpired("torchrun", timeout)

    def poll(self):
        return 0 if self.left == 0 else None


def launch(monkeypatch, tmp_path, node: Node, steps: int, polls: int) -> list[str]:
    clock, said = Clock(), []
    monkeypatch.setattr(progress, "_clock", clock)
    monkeypatch.setattr(progress, "_is_terminal", lambda: False)
    monkeypatch.setattr(progress, "say", said.append)
    monkeypatch.setattr(distributed.subprocess, "Popen", Torchrun(clock, polls))
    monkeypatch.setattr(distributed, "POLL_S", 0.0)
    distributed._launch(tmp_path, 2, 3600.0, node, steps=steps)
    return said


def test_a_worker_node_beats_every_five_minutes(monkeypatch, tmp_path) -> None:
    said = launch(monkeypatch, tmp_path, Node(count=2, rank=1, master_addr="h", master_port=1), 0, polls=12)
    assert said == ["  trainer (node 1 of 2, 2 processes) still training, 5m",
                    "  trainer (node 1 of 2, 2 processes) still training, 10m"]


def test_the_leader_shows_steps_and_no_heartbeat(monkeypatch, tmp_path) -> None:
    (tmp_path / distributed.OUT).mkdir()
    (tmp_path / distributed.OUT / distributed.STATS).write_text("{}")
    (tmp_path / distributed.PROGRESS).write_text("3")
    said = launch(monkeypatch, tmp_path, Node(count=2, rank=0, master_addr="h", master_port=1), 3, polls=12)
    assert said[0] == "  trainer (2 processes) 0/3 started"
    assert not any("still training" in line for line in said)
