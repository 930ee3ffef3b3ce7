"""``progress.bar`` outside a terminal (Airflow logs, CI): a start line, the 25% lines and
the final line, and a heartbeat line when an item finishes 30 s or more after the last
line (before, a trainer of 2 steps taking 99 s printed nothing until its end). The clock
is patched: no test waits."""

from __future__ import annotations

import pytest

from components.core import progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.said: list[str] = []

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(progress, "_clock", fake)
    monkeypatch.setattr(progress, "_is_terminal", lambda: False)
    monkeypatch.setattr(progress, "say", fake.said.append)  # the lines themselves, not a shared stdout
    return fake


def lines(clock) -> list[str]:
    """The lines said since the last call."""
    said, clock.said[:] = list(clock.said), []
    return said


def run(label: str, seconds: list[float], clock: Clock) -> None:
    """A job of ``len(seconds)`` items, the n-th finishing at ``seconds[n]``."""
    with progress.bar(label, len(seconds)) as advance:
        for t in seconds:
            clock.now = t
            advance(1)


def test_a_small_slow_job_says_it_started_and_beats_every_30_seconds(clock) -> None:
    run("trainer", [50.0, 99.0], clock)
    assert lines(clock) == ["  trainer 0/2 started", "  trainer 1/2 (50.0s)", "  trainer 2/2 (99.0s)"]


def test_a_small_fast_job_prints_the_start_and_the_end_only(clock) -> None:
    run("sandbox", [1.0, 2.0, 29.5], clock)
    assert lines(clock) == ["  sandbox 0/3 started", "  sandbox 3/3 (29.5s)"]


def test_the_25_percent_lines_are_kept_and_a_slow_stretch_adds_a_beat(clock) -> None:
    run("rollout[0/2]", [float(t) for t in range(1, 101)], clock)  # 1 s an item: no 30 s gap
    assert lines(clock) == ["  rollout[0/2] 0/100 started", "  rollout[0/2] 25/100 (25.0s)",
                             "  rollout[0/2] 50/100 (50.0s)", "  rollout[0/2] 75/100 (75.0s)",
                             "  rollout[0/2] 100/100 (100.0s)"]
    clock.now = 0.0
    run("rollout[1/2]", [2.0 * t for t in range(1, 101)], clock)  # 2 s an item
    assert lines(clock) == ["  rollout[1/2] 0/100 started", "  rollout[1/2] 15/100 (30.0s)",
                             "  rollout[1/2] 25/100 (50.0s)", "  rollout[1/2] 40/100 (80.0s)",
                             "  rollout[1/2] 50/100 (100.0s)", "  rollout[1/2] 65/100 (130.0s)",
                             "  rollout[1/2] 75/100 (150.0s)", "  rollout[1/2] 90/100 (180.0s)",
                             "  rollout[1/2] 100/100 (200.0s)"]


def test_one_item_has_no_start_line_and_an_empty_job_prints_nothing(clock) -> None:
    run("eval", [40.0], clock)
    run("none", [], clock)
    assert lines(clock) == ["  eval 1/1 (40.0s)"]


def test_a_heartbeat_says_the_wait_goes_on_every_interval_and_is_quiet_in_between(clock) -> None:
    with progress.heartbeat("trainer (node 1 of 2, 2 processes)", 300.0, "still training") as beat:
        for t in range(0, 3700, 1):  # a poll a second for just over an hour
            clock.now = float(t)
            beat()
    said = lines(clock)
    assert said[:2] == ["  trainer (node 1 of 2, 2 processes) still training, 5m",
                        "  trainer (node 1 of 2, 2 processes) still training, 10m"]
    assert said[-1] == "  trainer (node 1 of 2, 2 processes) still training, 1h 00m"
    assert len(said) == 12


def test_a_heartbeat_of_no_interval_says_nothing(clock) -> None:
    with progress.heartbeat("x", 0) as beat:
        clock.now = 1e6
        beat()
    assert lines(clock) == []
