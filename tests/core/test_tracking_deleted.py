"""Runs deleted in the MLflow UI are gone for posttrain (``components.core.tracking``).

taskgen's manifest pins the iteration's parent run; users delete a parent a killed run
left RUNNING. Before, every later stage nested under the deleted run and the iteration's
end wrote to it: MLflow refused ("must be in the 'active' state"), a traceback on every
resume, for good.

- Unit: ``end_if_running``, ``end_children``, ``finish_iteration``, ``fail_iteration`` and
  ``timeline.log_changed`` leave a deleted run alone; the iteration's live parent that
  replaced it is ended instead; ``stage_run`` nests a stage under the live parent (found by
  tags, or made) when the one it was given is deleted or unknown, and moves the deleted
  parent's stage runs under it.
- The runner (bootstrap and iteration 1 of recipes/tiny.yaml in this process, as
  ``posttrain stage`` runs them): the parent deleted between the trainer and evaluation,
  evaluation succeeds, its run and the earlier stage runs nest under a new live
  ``iter-000001`` that ends FINISHED with the timeline's step 1, and the summary run has
  step 1; a cache-hit rerun whose
  evaluation run and live parent were deleted too succeeds the same way.

Real MLflow (the test home's SQLite database).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core import models, timeline, tracking
from components.core.facts import Decision, StartingPolicy
from components.core.runner import run_stage
from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients, use_home

ROOT = "file:///runs/root"


def run(run_id: str):
    return tracking.client().get_run(run_id)


def status(run_id: str) -> str:
    return run(run_id).info.status


def child(parent: str, name: str, iteration: int = 1) -> str:
    """A stage run nested under ``parent``, left RUNNING (a SIGKILLed attempt)."""
    return tracking.client().create_run(tracking.experiment_id("del"), run_name=name, tags={
        tracking.TAG_PARENT: parent, tracking.TAG_STAGE: name.split(" ")[0], tracking.TAG_ITERATION: str(iteration),
        tracking.TAG_RUN_ROOT: ROOT}).info.run_id


def test_a_deleted_run_is_not_live_and_nothing_ends_or_logs_to_it(posttrain_home: Path) -> None:
    c = tracking.client()
    stage = child(tracking.iteration_run("del", 1, ROOT), "evaluation · iter-000001")
    assert tracking.live(stage)
    c.delete_run(stage)  # killed after its manifest, then deleted in the UI: the next attempt is a cache hit
    assert not tracking.live(stage) and not tracking.live("0" * 32) and not tracking.live("")
    assert tracking.end_if_running(stage) is False  # before: MlflowException "must be in the 'active' state"
    assert timeline.log_changed(stage, {"promoted": 1.0}, 1) == {}
    assert (status(stage), run(stage).info.lifecycle_stage) == ("RUNNING", "deleted")


def test_finishing_an_iteration_whose_parent_was_deleted_ends_its_live_replacement(posttrain_home: Path) -> None:
    c = tracking.client()
    deleted = tracking.iteration_run("del", 1, ROOT, "manual__1")
    before = child(deleted, "rollout[0/2] · iter-000001")  # RUNNING under the parent when it was deleted
    c.delete_run(deleted)
    tags = {tracking.TAG_ITERATION: "1", tracking.TAG_RUN_ROOT: ROOT, tracking.TAG_ORCH: "manual__2"}
    with tracking.stage_run("del", "trainer", "trainer · iter-000001", deleted, {}, tags=tags) as new:
        pass
    live = run(new).data.tags[tracking.TAG_PARENT]  # before: the deleted run
    assert live != deleted and tracking.live(live)
    assert tracking.find_iteration_run("del", 1, ROOT).info.run_id == live
    assert (run(live).info.run_name, run(live).data.tags[tracking.TAG_ORCH]) == ("iter-000001", "manual__2")
    assert run(before).data.tags[tracking.TAG_PARENT] == live  # moved under the live parent
    with tracking.stage_run("del", "evaluation", "evaluation · iter-000001", deleted, {}, tags=tags) as again:
        pass
    assert run(again).data.tags[tracking.TAG_PARENT] == live  # found by its tags, not made twice
    after = child(live, "sandbox[1/2] · iter-000001")
    assert timeline.log_changed(deleted, {"promoted": 1.0}, 1) == {}  # before: MlflowException
    tracking._replaced.clear()  # another process: the replacement is found by the deleted run's tags
    assert sorted(tracking.finish_iteration(deleted)) == sorted([before, after])
    assert (status(live), status(before), status(after), status(new)) == ("FINISHED", "KILLED", "KILLED", "FINISHED")
    assert run(deleted).info.lifecycle_stage == "deleted"


def test_failing_an_iteration_whose_parent_was_deleted_fails_its_live_replacement(posttrain_home: Path) -> None:
    deleted = tracking.iteration_run("del", 2, ROOT)
    tracking.client().delete_run(deleted)
    live = tracking.live_iteration_run(deleted, "del", 2, ROOT)
    assert live != deleted and tracking.live_iteration_run(live, "del", 2, ROOT) == live
    running = child(live, "trainer · iter-000002", 2)
    assert tracking.fail_iteration(deleted) == [running]
    assert (status(live), status(running)) == ("FAILED", "KILLED")
    assert tracking.iteration_run("del", 2, ROOT) == live and status(live) == "RUNNING"  # resumed: the live one


def test_a_stage_given_an_unknown_parent_nests_under_the_live_one(posttrain_home: Path) -> None:
    """A manifest from elsewhere (another tracking database) names a parent unknown here."""
    unknown = "f" * 32
    tags = {tracking.TAG_ITERATION: "3", tracking.TAG_RUN_ROOT: ROOT}
    with tracking.stage_run("del", "taskgen", "taskgen · iter-000003", unknown, {}, tags=tags) as new:
        pass
    live = run(new).data.tags[tracking.TAG_PARENT]
    assert live == tracking.find_iteration_run("del", 3, ROOT).info.run_id
    assert tracking.finish_iteration(unknown) == [] and status(live) == "FINISHED"  # this process replaced it


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory):
    """Bootstrap and iteration 1 of recipes/tiny.yaml up to its trainer; the root."""
    base = tmp_path_factory.mktemp("deleted")
    root = f"file://{base / 'store'}"
    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, base / ".posttrain")
        mp.setenv("POSTTRAIN_TORCH_THREADS", "1")
        run_stage("bootstrap", TINY_RECIPE, root, 0)
        for stage, shard in [("taskgen", None), ("rollout", "0/2"), ("rollout", "1/2"), ("sandbox", "0/2"),
                             ("sandbox", "1/2"), ("reward", "0/2"), ("reward", "1/2"), ("validation", None),
                             ("trainer", None)]:
            run_stage(stage, TINY_RECIPE, root, 1, shard)
        yield root
        reset_tracking_clients()


def test_an_iteration_resumed_after_its_parent_was_deleted_ends_in_a_live_one(resumed: str) -> None:
    from components.core.context import read_manifest
    from components.core.manifest import stage_prefix
    from components.core.storage import Store

    c = tracking.client()
    store = Store(resumed)
    recorded = read_manifest(store, stage_prefix("tiny", 1, "taskgen")).facts(StartingPolicy).parent_run_id
    assert status(recorded) == "RUNNING"
    c.delete_run(recorded)  # deleted in the UI between two stages of the iteration

    evaluation = run_stage("evaluation", TINY_RECIPE, resumed, 1)  # before: MlflowException, for good
    live = run(evaluation.mlflow_run_id).data.tags[tracking.TAG_PARENT]
    assert live != recorded and tracking.live(live)
    assert (run(live).info.run_name, status(live)) == ("iter-000001", "FINISHED")
    assert status(evaluation.mlflow_run_id) == "FINISHED"
    assert "pass_at_1/mean" in run(live).data.metrics  # the timeline went to the live parent
    summary = tracking.pipeline_run("tiny", store.uri)
    assert sorted(m.step for m in c.get_metric_history(summary, "pass_at_1/mean")) == [0, 1]
    assert run(recorded).info.lifecycle_stage == "deleted"
    stages = c.search_runs([tracking.experiment_id("tiny")], f"tags.`{tracking.TAG_ITERATION}` = '1' and "
                           f"tags.`{tracking.TAG_STAGE}` != 'iteration'")
    assert len(stages) == 10 and {r.data.tags[tracking.TAG_PARENT] for r in stages} == {live}  # the UI's walk
    facts = evaluation.facts(Decision)
    description = c.get_model_version(models.model_name("tiny"), facts.version).description
    assert live in description and recorded not in description  # its "iteration run" link

    c.delete_run(evaluation.mlflow_run_id)  # and then the evaluation run and the live parent as well
    c.delete_run(live)
    again = run_stage("evaluation", TINY_RECIPE, resumed, 1)  # a cache hit ends the iteration again
    assert again.mlflow_run_id == evaluation.mlflow_run_id
    [now] = c.search_runs([tracking.experiment_id("tiny")], f"tags.`{tracking.TAG_STAGE}` = 'iteration'")
    assert now.info.run_id not in (recorded, live)
    assert (now.info.run_name, now.info.status) == ("iter-000001", "FINISHED")
    assert "pass_at_1/mean" in now.data.metrics
    running = c.search_runs([tracking.experiment_id("tiny")], "attributes.status = 'RUNNING'")
    assert [r.info.run_name for r in running] == []
