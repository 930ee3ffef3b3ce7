"""Which stage run is current, and no stage run left RUNNING (``components.core.tracking``).

- A stage run that ends FINISHED tags the earlier FINISHED runs of the same stage,
  iteration, shard and run root ``posttrain.superseded_by`` = its id; KILLED and FAILED
  attempts, other shards and other run roots are left alone.
- A new attempt of a shard also ends KILLED the RUNNING runs of the stage, iteration and
  run root under another shard count (the recipe's ``shards`` changed after a kill);
  shards of its own count, which run side by side, stay RUNNING.
- ``finish_iteration`` ends the iteration's RUNNING stage runs KILLED and its parent
  FINISHED from RUNNING, FAILED or KILLED.
- All of it under a run root holding an apostrophe (``/data/bob's runs``, which MLflow's
  filter quotes with double quotes): before, those runs were never found, so neither
  marked superseded nor KILLED.

Real MLflow (the test home's SQLite database). The runner's use of these after a real
stage is ``tests/core/test_timeline_reruns.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core import tracking

ROOT = "file:///runs/root"
OTHER_ROOT = "file:///runs/other"
ROOTS = pytest.mark.parametrize("root", [ROOT, "file:///runs/bob's root"], ids=["plain", "apostrophe"])


def status(run_id: str) -> str:
    return tracking.client().get_run(run_id).info.status


def superseded(run_id: str) -> str | None:
    return tracking.client().get_run(run_id).data.tags.get(tracking.TAG_SUPERSEDED_BY)


def attempt(label: str, root: str = ROOT, fail: bool = False) -> str:
    """One ``stage_run`` of iteration 2's ``label`` (``rollout[1/2]``); FAILED with ``fail``."""
    shard = label.partition("[")[2].rstrip("]")
    tags = {tracking.TAG_ITERATION: "2", tracking.TAG_RUN_ROOT: root, **({tracking.TAG_SHARD: shard} if shard else {})}
    name = tracking.stage_run_name(label, 2)
    try:
        with tracking.stage_run("sup", label.partition("[")[0], name, None, {}, tags=tags) as run_id:
            if fail:
                raise ValueError("a stage error")
    except ValueError:
        pass
    return run_id


@ROOTS
def test_a_finished_rerun_marks_the_earlier_finished_runs_superseded(posttrain_home: Path, root: str) -> None:
    first = attempt("rollout[1/2]", root)
    failed = attempt("rollout[1/2]", root, fail=True)
    shard0 = attempt("rollout[0/2]", root)
    elsewhere = attempt("rollout[1/2]", root=OTHER_ROOT)
    assert superseded(first) is None  # nothing finished after it yet
    second = attempt("rollout[1/2]", root)
    assert (superseded(first), superseded(second)) == (second, None)
    assert (status(failed), superseded(failed)) == ("FAILED", None)
    assert superseded(shard0) is None and superseded(elsewhere) is None
    third = attempt("rollout[1/2]", root)
    assert [superseded(r) for r in (first, second, third)] == [third, third, None]


@ROOTS
def test_a_stage_without_shards_is_marked_too(posttrain_home: Path, root: str) -> None:
    first, second = attempt("trainer", root), attempt("trainer", root)
    assert tracking.client().get_run(second).info.run_name == "trainer · iter-000002"
    assert (superseded(first), superseded(second)) == (second, None)


@ROOTS
def test_running_runs_of_another_shard_count_end_killed_at_the_next_attempt(posttrain_home: Path, root: str) -> None:
    c = tracking.client()

    def left_running(label: str) -> str:
        shard = label.partition("[")[2].rstrip("]")
        return c.create_run(tracking.experiment_id("sup"), run_name=tracking.stage_run_name(label, 2), tags={
            tracking.TAG_STAGE: "rollout", tracking.TAG_ITERATION: "2", tracking.TAG_RUN_ROOT: root,
            tracking.TAG_SHARD: shard}).info.run_id

    three = [left_running(f"rollout[{i}/3]") for i in range(3)]  # SIGKILLed under shards: 3
    sibling = left_running("rollout[1/2]")  # running beside the new attempt: same count
    stale = left_running("rollout[0/2]")  # the same attempt, SIGKILLed
    new = attempt("rollout[0/2]", root)
    assert [status(r) for r in three] == ["KILLED", "KILLED", "KILLED"]
    assert (status(stale), status(sibling), status(new)) == ("KILLED", "RUNNING", "FINISHED")


def test_finishing_an_iteration_ends_its_leftover_stage_runs_and_a_failed_parent(posttrain_home: Path) -> None:
    c = tracking.client()
    parent = tracking.iteration_run("sup", 3, ROOT)
    leftover = c.create_run(tracking.experiment_id("sup"), run_name="rollout[2/3] · iter-000003", tags={
        "mlflow.parentRunId": parent, tracking.TAG_STAGE: "rollout"}).info.run_id
    done = c.create_run(tracking.experiment_id("sup"), run_name="evaluation · iter-000003", tags={
        "mlflow.parentRunId": parent, tracking.TAG_STAGE: "evaluation"}).info.run_id
    c.set_terminated(done, "FINISHED")
    tracking.end_if_running(parent, "FAILED")  # the orchestrator gave up on it
    assert tracking.finish_iteration(parent) == [leftover]
    assert (status(parent), status(leftover), status(done)) == ("FINISHED", "KILLED", "FINISHED")
    assert tracking.finish_iteration(parent) == [] and status(parent) == "FINISHED"


@pytest.mark.parametrize("before", ["RUNNING", "FAILED", "KILLED"])
def test_unfinished_iteration_runs_are_found_in_every_unfinished_status(posttrain_home: Path, before: str) -> None:
    parent = tracking.iteration_run("sup", 4, ROOT)
    finished = tracking.iteration_run("sup", 5, ROOT)
    tracking.client().set_terminated(finished, "FINISHED")
    if before != "RUNNING":
        tracking.client().set_terminated(parent, before)
    assert tracking.unfinished_iteration_runs("sup", ROOT) == {4: parent}
    assert tracking.unfinished_iteration_runs("sup", OTHER_ROOT) == {}
