"""A stage's progress line (``runner.headline``): counts as integers, not ``1.1e+03``, and
its overall metrics, not the first few per-domain ones (which hid domains)."""

from __future__ import annotations

import pytest

from components.core.runner import headline, number


@pytest.mark.parametrize(("value", "text"), [(1100.0, "1100"), (866048.0, "866048"), (-0.0, "0"), (0.2512, "0.251"),
                                             (1e20, "1e+20"), (float("nan"), "nan"), (3.0e-5, "3e-05")])
def test_number(value: float, text: str) -> None:
    assert number(value) == text


def test_headline_shows_the_overall_metrics_first_four() -> None:
    named = {"taskgen/tasks": 960.0, "taskgen/code/tasks": 192.0, "taskgen/math/tasks": 192.0, "taskgen/duration_s": 1.2}
    assert headline(named) == "tasks 960"
    named = {f"trainer/m{i}": float(i) for i in range(6)} | {"trainer/code/loss": 0.5}
    assert headline(named) == "m0 0 | m1 1 | m2 2 | m3 3"


def test_the_sandbox_line_says_how_its_jobs_ended() -> None:
    named = {"sandbox/jobs": 1210.0, "sandbox/jobs_run": 402.0, "sandbox/status/failed": 300.0, "sandbox/status/ok": 905.0,
             "sandbox/status/timeout": 5.0, "sandbox/duration_s": 10.7}
    assert headline(named) == "jobs 1210 | jobs_run 402 | failed 300, ok 905, timeout 5"
