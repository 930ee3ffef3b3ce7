"""The layered eval report: slices by domain x difficulty x context bucket, weakest slice,
store output, MLflow table + plot artifacts, the row `posttrain run` prints, and the Wilson
interval on every slice."""

from __future__ import annotations

import json

import pytest

from components.core.context import RecipeView, StageContext
from components.core.manifest import Shard
from components.core.recipe import parse_recipe
from components.core.records import EvalResult
from components.core.storage import Store
from components.evalsuite.report import log_layered, slices, weakest
from dags.orchestrate import weakest_text


def result(domain: str, difficulty: int, bucket: str, passed: bool, i: int) -> EvalResult:
    return EvalResult(task_id=f"{domain}-{difficulty}-{bucket}-{i}", domain=domain, difficulty=difficulty,
                      context_bucket=bucket, policy_version="2", score=1.0 if passed else 0.0, passed=passed)


def results() -> list[EvalResult]:
    out = []
    out += [result("math", 1, "<=32", i < 5, i) for i in range(6)]  # 5/6
    out += [result("math", 2, "<=32", i < 1, i) for i in range(5)]  # 1/5: the weakest big slice
    out += [result("extraction", 3, "<=512", False, i) for i in range(2)]  # 0/2, too small to count
    out += [result("extraction", 1, "<=128", i < 3, i) for i in range(6)]  # 3/6
    out += [result("extraction", 1, "<=32", i < 4, i) for i in range(5)]  # 4/5
    return out


def test_slices_are_sorted_and_counted():
    rows = slices(results())
    assert [(r["domain"], r["difficulty"], r["context_bucket"], r["tasks"], r["passed"]) for r in rows] == [
        ("extraction", 1, "<=32", 5, 4), ("extraction", 1, "<=128", 6, 3), ("extraction", 3, "<=512", 2, 0),
        ("math", 1, "<=32", 6, 5), ("math", 2, "<=32", 5, 1)]
    assert rows[1]["pass_rate"] == 0.5 and rows[4]["mean_score"] == 0.2


@pytest.mark.parametrize(("min_tasks", "expected"), [
    (5, ("math", 2, "<=32")),
    (1, ("extraction", 3, "<=512")),
    (100, ("extraction", 3, "<=512")),  # no slice is that big: all count
])
def test_weakest_slice(min_tasks, expected):
    w = weakest(slices(results()), min_tasks)
    assert (w["domain"], w["difficulty"], w["context_bucket"]) == expected


def test_log_layered_writes_store_output_mlflow_table_and_plot(tmp_path, posttrain_home):
    from components.core import tracking

    recipe = parse_recipe({"pipeline": "lay", "domains": ["math", "extraction"]})
    ctx = StageContext(stage="evaluation", recipe=RecipeView(recipe, "evaluation", ("evaluation",)), store=Store(str(tmp_path / "store")), iteration=3,
                       shard=Shard(0, 1))
    with tracking.stage_run("lay", "evaluation", "evaluation", None, {}) as run_id:
        ctx.mlflow_run_id = run_id
        worst = log_layered(ctx, results())
    assert (worst.name, worst.pass_rate, worst.tasks, worst.passed) == ("math/d2/<=32", 0.2, 5, 1)
    stored = ctx.store.read_json(ctx.outputs["layered"].path)
    assert ctx.outputs["layered"].path == "lay/iter-000003/evaluation/layered.json" and len(stored) == 5
    client = tracking.client()
    names = sorted(a.path for a in client.list_artifacts(run_id, "evaluation"))
    assert names == ["evaluation/layered.json", "evaluation/pass_rates.png"]
    table = json.loads(open(client.download_artifacts(run_id, "evaluation/layered.json", str(tmp_path))).read())
    assert table["columns"][:3] == ["domain", "difficulty", "context_bucket"] and len(table["data"]) == 5
    png = open(client.download_artifacts(run_id, "evaluation/pass_rates.png", str(tmp_path)), "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert weakest_text(worst) == "math/d2/<=32 0.20 (n=5)"
    assert weakest_text(None) == "-"


def test_trap_tasks_form_their_own_slice_and_can_be_the_weakest():
    """A policy that passes ordinary d2 math and fails its traps: the average (5/8) hides
    it, the trap slice (0/3) shows it."""
    rs = [result("math", 2, "<=32", True, i) for i in range(5)]
    rs += [EvalResult(task_id=f"trap-{i}", domain="math", difficulty=2, context_bucket="<=32", policy_version="2",
                      score=0.0, passed=False, trap=True) for i in range(3)]
    rows = slices(rs)
    assert [(r["trap"], r["tasks"], r["passed"]) for r in rows] == [(False, 5, 5), (True, 3, 0)]
    w = weakest(rows, min_tasks=3)
    assert w["trap"] is True and w["pass_rate"] == 0.0
    from components.evalsuite.report import slice_name

    assert slice_name(w) == "math/d2/<=32/trap"


def test_every_slice_carries_its_wilson_interval():
    rows = slices(results())
    assert [(r["passed"], r["tasks"], round(r["ci_low"], 4), round(r["ci_high"], 4)) for r in rows] == [
        (4, 5, 0.3755, 0.9638), (3, 6, 0.1876, 0.8124), (0, 2, 0.0, 0.6576), (5, 6, 0.4365, 0.9699), (1, 5, 0.0362, 0.6245)]


def test_the_report_uses_the_recipes_confidence(tmp_path, posttrain_home):
    """At evaluation.confidence 0.8 the intervals are narrower than the 0.95 default's."""
    recipe = parse_recipe({"pipeline": "lay", "domains": ["math", "extraction"], "evaluation": {"confidence": 0.8}})
    ctx = StageContext(stage="evaluation", recipe=RecipeView(recipe, "evaluation", ("evaluation",)),
                       store=Store(str(tmp_path / "store")), iteration=3, shard=Shard(0, 1))
    log_layered(ctx, results())
    stored = ctx.store.read_json(ctx.outputs["layered"].path)
    assert [(round(r["ci_low"], 4), round(r["ci_high"], 4)) for r in stored] == [
        (0.5135, 0.9381), (0.2682, 0.7318), (0.0, 0.4509), (0.5747, 0.9487), (0.0619, 0.4865)]
