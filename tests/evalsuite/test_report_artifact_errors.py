"""A failed MLflow upload of the layered table or plot prints one line and the evaluation
goes on (a lasting artifact-store error would otherwise fail every rerun); an interrupt
still propagates."""

from __future__ import annotations

import pytest

from components.core import tracking
from components.core.context import RecipeView, StageContext
from components.core.manifest import Shard
from components.core.recipe import parse_recipe
from components.core.storage import Store
from components.evalsuite.report import log_layered
from tests.evalsuite.test_layered_report import results


@pytest.fixture
def said(monkeypatch) -> list[str]:
    """The lines the report and the scorer say (recorded, not read back from a shared stdout)."""
    from components.evalsuite import report, score

    lines: list[str] = []
    monkeypatch.setattr(report, "say", lines.append)
    monkeypatch.setattr(score, "say", lines.append)
    return lines


def context(tmp_path) -> StageContext:
    recipe = parse_recipe({"pipeline": "lay", "domains": ["math", "extraction"]})
    return StageContext(stage="evaluation", recipe=RecipeView(recipe, "evaluation", ("evaluation",)),
                        store=Store(str(tmp_path / "store")), iteration=3, shard=Shard(0, 1))


@pytest.mark.parametrize("method", ["log_figure", "log_table"])
def test_a_failed_upload_prints_one_line_and_returns_the_weakest_slice(tmp_path, posttrain_home, monkeypatch, said,
                                                                        method):
    from mlflow.tracking import MlflowClient

    def refuse(*args, **kwargs):
        raise PermissionError("403 Forbidden: s3://bucket/artifacts\nsecond line")

    monkeypatch.setattr(MlflowClient, method, refuse)
    ctx = context(tmp_path)
    with tracking.stage_run("lay", "evaluation", "evaluation", None, {}) as run_id:
        ctx.mlflow_run_id = run_id
        worst = log_layered(ctx, results())
    assert (worst.name, worst.pass_rate) == ("math/d2/<=32", 0.2)
    assert len(ctx.store.read_json(ctx.outputs["layered"].path)) == 5  # the table is in the store
    lines = [line for line in said if "not logged" in line]
    assert lines == ["iter 3 | evaluation | layered table or plot not logged to MLflow (PermissionError: 403 Forbidden: "
                     "s3://bucket/artifacts); the table is in the store (lay/iter-000003/evaluation/layered.json)"]


def test_an_interrupt_during_the_upload_propagates(tmp_path, posttrain_home, monkeypatch):
    from mlflow.tracking import MlflowClient

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(MlflowClient, "log_figure", interrupt)
    ctx = context(tmp_path)
    with pytest.raises(KeyboardInterrupt), tracking.stage_run("lay", "evaluation", "evaluation", None, {}) as run_id:
        ctx.mlflow_run_id = run_id
        log_layered(ctx, results())


def test_a_failed_samples_upload_prints_one_line(tmp_path, posttrain_home, monkeypatch, said):
    """``evaluate_and_log``'s last upload, ``samples.json``, failed the stage the same way."""
    from components.evalsuite import score

    def refuse(*args, **kwargs):
        raise PermissionError("403 Forbidden: s3://bucket/artifacts")

    monkeypatch.setattr(tracking, "log_artifact_text", refuse)
    ctx = context(tmp_path)
    ctx.mlflow_run_id = "r1"
    score.log_samples(ctx, results())
    lines = [line for line in said if "not logged" in line]
    assert lines == ["iter 3 | evaluation | evaluation/samples.json not logged to MLflow (PermissionError: 403 "
                     "Forbidden: s3://bucket/artifacts); the eval results are in the store"]
