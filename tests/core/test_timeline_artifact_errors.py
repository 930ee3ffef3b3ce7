"""``timeline.record``: a failed upload of the pass-rate plot prints one line and is not
raised (it ran after the manifest was written, so a lasting artifact-store error failed
every rerun, cache hits included); the metrics are logged on every run first."""

from __future__ import annotations

import pytest

from components.core import timeline, tracking
from components.core.storage import Store


@pytest.fixture
def said(monkeypatch) -> list[str]:
    """The lines the timeline says (recorded, not read back from a shared stdout)."""
    lines: list[str] = []
    monkeypatch.setattr(timeline, "say", lines.append)
    return lines


def test_a_failed_plot_upload_prints_one_line_and_the_metrics_are_logged(tmp_path, posttrain_home, monkeypatch,
                                                                         said):
    from mlflow.tracking import MlflowClient

    def refuse(*args, **kwargs):
        raise OSError("[Errno 28] No space left on device")

    monkeypatch.setattr(MlflowClient, "log_figure", refuse)
    monkeypatch.setattr(timeline, "headline", lambda store, pipeline, k: {"pass_at_1/mean": 0.5})
    monkeypatch.setattr(timeline, "history", lambda store, pipeline, k: [timeline.Scores(2, {"math": 0.5}, 10)])
    store = Store(f"file://{tmp_path / 'store'}")
    parent = tracking.client().create_run(tracking.experiment_id("tl")).info.run_id
    assert timeline.record(store, "tl", 2, parent) == {"pass_at_1/mean": 0.5}
    summary = tracking.pipeline_run("tl", store.uri)
    for run_id in (parent, summary):  # the parent's failed plot did not keep the summary run's metrics out
        history = tracking.client().get_metric_history(run_id, "pass_at_1/mean")
        assert [(m.step, m.value) for m in history] == [(2, 0.5)]
    lines = [line for line in said if "not logged" in line]
    assert lines == ["iter 2 | timeline | plot timeline/pass_rates.png not logged "
                     "(OSError: [Errno 28] No space left on device); its metrics are"]


def test_each_plot_that_fails_prints_its_own_line(tmp_path, posttrain_home, monkeypatch, said):
    from mlflow.tracking import MlflowClient

    def refuse(client, run_id, figure, path):
        raise OSError(f"refused {path}")

    monkeypatch.setattr(MlflowClient, "log_figure", refuse)
    monkeypatch.setattr(timeline, "headline", lambda store, pipeline, k: {})
    monkeypatch.setattr(timeline, "history", lambda store, pipeline, k: [timeline.Scores(1, {"math": 0.5}, 10)])
    monkeypatch.setattr(timeline, "reward_history", lambda store, pipeline, k: [(1, {"math": 0.25})])
    timeline.record(Store(f"file://{tmp_path / 'store'}"), "tl", 1, "")
    lines = [line for line in said if "not logged" in line]
    assert lines == ["iter 1 | timeline | plot timeline/pass_rates.png not logged (OSError: refused "
                     "timeline/pass_rates.png); its metrics are",
                     "iter 1 | timeline | plot timeline/rewards.png not logged (OSError: refused "
                     "timeline/rewards.png); its metrics are"]


def test_an_interrupt_during_the_plot_upload_propagates(tmp_path, posttrain_home, monkeypatch):
    from mlflow.tracking import MlflowClient

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(MlflowClient, "log_figure", interrupt)
    monkeypatch.setattr(timeline, "headline", lambda store, pipeline, k: {})
    monkeypatch.setattr(timeline, "history", lambda store, pipeline, k: [])
    with pytest.raises(KeyboardInterrupt):
        timeline.record(Store(f"file://{tmp_path / 'store'}"), "tl", 1, "")
