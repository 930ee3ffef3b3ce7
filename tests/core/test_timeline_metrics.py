"""``timeline.log_changed``: a headline metric is logged again at its step when its value
changed (a re-run stage), each metric judged on its own, and the new value is the latest
at that step (by timestamp, as ``get_metric_history`` orders them and as MLflow picks a
run's latest value); an unchanged value adds nothing. Real MLflow (the test home's
SQLite database). A re-run stage of a real iteration: ``test_timeline_reruns.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

from components.core import timeline, tracking


def at(run_id: str, key: str, step: int) -> list[float]:
    """The values of ``key`` at ``step``, oldest first."""
    history = sorted(tracking.client().get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return [m.value for m in history if m.step == step]


def test_each_changed_metric_is_logged_again_at_its_step(posttrain_home: Path) -> None:
    run = tracking.client().create_run(tracking.experiment_id("tl")).info.run_id
    first = {"groups_kept": 3.0, "trainer/loss": 0.5, "sandbox/ok": 16.0}
    assert timeline.log_changed(run, first, 2) == first
    # only trainer/loss changed: the first metric (groups_kept) being logged does not keep it out
    assert timeline.log_changed(run, {**first, "trainer/loss": 0.25, "reward/code": 0.1}, 2) == {
        "trainer/loss": 0.25, "reward/code": 0.1}
    assert at(run, "trainer/loss", 2) == [0.5, 0.25]
    assert at(run, "groups_kept", 2) == [3.0] and at(run, "reward/code", 2) == [0.1]
    assert tracking.client().get_run(run).data.metrics == {"groups_kept": 3.0, "trainer/loss": 0.25, "sandbox/ok": 16.0,
                                                            "reward/code": 0.1}
    assert timeline.log_changed(run, {**first, "trainer/loss": 0.25, "reward/code": 0.1}, 2) == {}
    assert at(run, "trainer/loss", 2) == [0.5, 0.25]


def test_a_lower_value_logged_in_the_same_millisecond_is_still_the_latest(posttrain_home: Path) -> None:
    """MLflow breaks a timestamp tie by the larger value: the new value is stamped after the old."""
    run = tracking.client().create_run(tracking.experiment_id("tl")).info.run_id
    for value in (0.9, 0.1, 0.05):
        timeline.log_changed(run, {"pass_at_1/mean": value}, 1)
    history = tracking.client().get_metric_history(run, "pass_at_1/mean")
    assert [m.value for m in sorted(history, key=lambda m: m.timestamp)] == [0.9, 0.1, 0.05]
    assert len({m.timestamp for m in history}) == 3
    assert tracking.client().get_run(run).data.metrics["pass_at_1/mean"] == 0.05


def test_other_steps_are_not_looked_at_and_nan_equals_nan(posttrain_home: Path) -> None:
    run = tracking.client().create_run(tracking.experiment_id("tl")).info.run_id
    timeline.log_changed(run, {"trainer/kl": 0.2, "trainer/loss": math.nan}, 1)
    assert sorted(timeline.log_changed(run, {"trainer/kl": 0.2, "trainer/loss": math.nan}, 2)) == ["trainer/kl",
                                                                                                    "trainer/loss"]
    assert at(run, "trainer/kl", 1) == [0.2] and at(run, "trainer/kl", 2) == [0.2]
    assert timeline.log_changed(run, {"trainer/loss": math.nan}, 2) == {}
    assert len(at(run, "trainer/loss", 2)) == 1
