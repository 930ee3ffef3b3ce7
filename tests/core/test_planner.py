"""The planner picks iteration k and leases it, on file:// and on a real S3 server.

A finished iteration is one with an evaluation manifest; the tests write that file
directly (only the last one's is read, and it only has to be a manifest of its own
folder), so no stage runs here.
"""

from __future__ import annotations

import time

import pytest

from components.core import lease, planner
from components.core.errors import UserError
from components.core.manifest import MANIFEST, Manifest, stage_prefix
from components.core.recipe import load_recipe
from components.core.storage import Store
from tests.fixtures import race
from tests.fixtures.home import TINY_RECIPE

RACERS = 5


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(TINY_RECIPE)


def finish(store: Store, k: int) -> None:
    done = Manifest(stage="evaluation", pipeline="tiny", iteration=k, shard=None, inputs={}, config_digest="c",
                    code_version="v")
    store.write_json(f"{stage_prefix('tiny', k, 'evaluation')}/{MANIFEST}", done.to_json())


def test_first_plan_is_iteration_1_leased_with_its_recipe(store_uri: str, recipe) -> None:
    store = Store(store_uri)
    assert planner.plan(store, recipe, "alice") == 1
    cur = lease.current(store, "tiny", 1)
    assert (cur.holder, cur.generation, cur.live()) == ("alice", 0, True)
    assert store.read_json("tiny/iter-000001/recipe.json") == recipe.model_dump(mode="json")
    assert planner.finished(store, "tiny") == []


def test_next_iteration_follows_the_last_finished(store_uri: str, recipe) -> None:
    store = Store(store_uri)
    for k in (1, 2, 3):
        finish(store, k)
    store.write_bytes("tiny/iter-000004/taskgen/tasks.parquet", b"half done: no evaluation manifest")
    assert planner.finished(store, "tiny") == [1, 2, 3]
    assert planner.plan(store, recipe, "alice") == 4


@pytest.mark.parametrize("damage", ["cut", "other-iteration"])
def test_a_last_finished_iteration_whose_manifest_is_damaged_is_refused(damage: str, store_uri: str, recipe) -> None:
    """A cut-short evaluation manifest counted as finished: the next iteration ran whole
    and registered a version before its own evaluation tripped over it."""
    store = Store(store_uri)
    for k in (1, 2):
        finish(store, k)
    rel = f"{stage_prefix('tiny', 2, 'evaluation')}/{MANIFEST}"
    text = store.read_bytes(rel)
    store.write_bytes(rel, text[:40] if damage == "cut" else text.replace(b'"iteration": 2', b'"iteration": 1'))
    with pytest.raises(UserError) as err:
        planner.plan(store, recipe, "alice")
    assert err.value.value == store.url(rel) and err.value.fix == "delete it and re-run stage evaluation"
    assert lease.current(store, "tiny", 3) is None  # nothing leased


def test_holder_resumes_its_own_unfinished_iteration(store_uri: str, recipe) -> None:
    store = Store(store_uri)
    assert planner.plan(store, recipe, "alice") == 1
    assert planner.plan(store, recipe, "alice") == 1  # a killed 'posttrain run' started again
    assert lease.current(store, "tiny", 1).generation == 1  # renewed, not taken anew
    finish(store, 1)
    assert planner.plan(store, recipe, "alice") == 2


def test_another_holder_gets_lease_held_naming_the_holder(store_uri: str, recipe) -> None:
    store = Store(store_uri)
    assert planner.plan(store, recipe, "airflow:manual__1") == 1
    with pytest.raises(lease.LeaseHeld) as info:
        planner.plan(store, recipe, "local:/home/x/.posttrain")
    assert str(info.value).startswith("iteration 1 of pipeline 'tiny' is held by 'airflow:manual__1' (lease expires in ")
    assert info.value.lease.holder == "airflow:manual__1"
    assert lease.held_by(store, "tiny", "local:/home/x/.posttrain") == []


def test_replay_returns_the_same_finished_iteration(store_uri: str, recipe) -> None:
    store = Store(store_uri)
    assert planner.plan(store, recipe, "airflow:run-a", replay=True) == 1
    finish(store, 1)
    assert planner.plan(store, recipe, "airflow:run-a", replay=True) == 1  # a cleared, finished DAG run
    assert planner.plan(store, recipe, "airflow:run-a", replay=False) == 2  # without replay: the next one
    assert planner.plan(store, recipe, "airflow:run-a", replay=True) == 2  # the newest it holds
    with pytest.raises(lease.LeaseHeld, match="iteration 2 of pipeline 'tiny' is held by 'airflow:run-a'"):
        planner.plan(store, recipe, "airflow:run-b", replay=True)  # another run neither replays 1 nor takes 2


def test_a_cleared_old_run_does_not_replay_an_iteration_that_is_over(store_uri: str, recipe) -> None:
    """Clearing run-a's finished DAG run once run-b's iteration 2 has started would re-run
    iteration 1 on today's recipe and code, from today's champion."""
    store = Store(store_uri)
    assert planner.plan(store, recipe, "airflow:run-a", replay=True) == 1
    finish(store, 1)
    assert planner.plan(store, recipe, "airflow:run-b", replay=True) == 2
    with pytest.raises(UserError) as err:
        planner.plan(store, recipe, "airflow:run-a", replay=True)
    assert err.value.line() == (
        "iteration=1: iteration 1 of pipeline 'tiny' is over: iteration 2 has started since, and re-running its "
        "stages on today's recipe and code could move the champion back; fix: trigger a new run (its plan picks "
        "the iteration to work on) instead of clearing this one's tasks")
    assert lease.current(store, "tiny", 1).holder == "airflow:run-a"  # nothing was taken or released


def test_a_stage_task_retakes_a_handed_back_lease_and_is_refused_when_it_is_anothers_or_over(store_uri: str,
                                                                                             recipe) -> None:
    store = Store(store_uri)
    assert planner.plan(store, recipe, "airflow:run-a", replay=True) == 1
    planner.check_current(store, "tiny", 1, "airflow:run-a")  # its own, current: nothing raised
    with pytest.raises(UserError) as err:
        planner.check_current(store, "tiny", 1, "airflow:run-z")
    assert err.value.line() == (
        "iteration=1: iteration 1 of pipeline 'tiny' is held by 'airflow:run-a', not by this run ('airflow:run-z'); "
        "fix: wait for that run to finish; trigger a new run (its plan picks the iteration to work on) instead of "
        "clearing this one's tasks")
    assert lease.release(store, "tiny", 1, "airflow:run-a")  # run-a failed and handed its lease back
    planner.check_current(store, "tiny", 1, "airflow:run-a")  # its cleared tasks resume it: the lease is taken again
    assert lease.current(store, "tiny", 1).holder == "airflow:run-a"
    finish(store, 1)
    assert planner.plan(store, recipe, "airflow:run-c", replay=True) == 2
    with pytest.raises(UserError, match=r"^iteration=1: iteration 1 of pipeline 'tiny' is over: iteration 2 has "
                                        r"started since"):
        planner.check_current(store, "tiny", 1, "airflow:run-a")  # a cleared task of run-a: its plan did not run


def test_a_cleared_failed_run_whose_iteration_another_run_finished_is_over(store_uri: str, recipe) -> None:
    """run-a fails and hands iteration 1 back; run-b takes it and finishes it; clearing
    run-a as a whole then planned iteration 2 on run-a's (old) conf instead of replaying 1."""
    store = Store(store_uri)
    assert planner.plan(store, recipe, "airflow:run-a", replay=True) == 1
    assert lease.release(store, "tiny", 1, "airflow:run-a")  # run-a failed: its callback handed the lease back
    assert planner.plan(store, recipe, "airflow:run-b", replay=True) == 1  # the next run resumes it
    finish(store, 1)  # and finishes it
    with pytest.raises(UserError) as err:
        planner.plan(store, recipe, "airflow:run-a", replay=True, cleared=True)
    assert err.value.line() == (
        "iteration=1: iteration 1 of pipeline 'tiny' is over: 'airflow:run-b' took it after this run handed it back "
        "and finished it, and re-running its stages on this run's recipe and today's code could move the champion "
        "back; fix: trigger a new run (its plan picks the iteration to work on) instead of clearing this one's tasks")
    assert lease.current(store, "tiny", 1).holder == "airflow:run-b"  # nothing taken or released
    assert planner.started_after(store, "tiny", 1) is None  # no iteration 2 was planned
    assert planner.plan(store, recipe, "airflow:run-c", replay=True) == 2  # a new run does plan it


def test_a_cleared_failed_run_resumes_its_handed_back_iteration(store_uri: str, recipe) -> None:
    store = Store(store_uri)
    assert planner.plan(store, recipe, "airflow:never-leased", replay=True, cleared=True) == 1  # its plan had failed
    assert lease.release(store, "tiny", 1, "airflow:never-leased")
    assert planner.plan(store, recipe, "airflow:run-a", replay=True) == 1
    assert lease.release(store, "tiny", 1, "airflow:run-a")
    assert planner.plan(store, recipe, "airflow:run-b", replay=True) == 1  # run-b took it and is on it
    with pytest.raises(UserError, match=r"^iteration=1: iteration 1 of pipeline 'tiny' is held by 'airflow:run-b', "
                                        r"not by this run \('airflow:run-a'\)"):
        planner.plan(store, recipe, "airflow:run-a", replay=True, cleared=True)
    assert lease.release(store, "tiny", 1, "airflow:run-b")  # run-b failed too
    assert planner.plan(store, recipe, "airflow:run-a", replay=True, cleared=True) == 1  # resumed, not a new one
    assert lease.current(store, "tiny", 1).holder == "airflow:run-a"
    finish(store, 1)
    assert lease.release(store, "tiny", 1, "airflow:run-a")  # it finished 1, then failed (announce_champion)
    assert planner.plan(store, recipe, "airflow:run-a", replay=True, cleared=True) == 1  # replays its own k


def test_expired_lease_is_taken_over_on_the_same_iteration(store_uri: str, recipe) -> None:
    store = Store(store_uri)
    assert planner.plan(store, recipe, "dead-worker", ttl_s=1.0) == 1
    time.sleep(1.2)
    assert planner.plan(store, recipe, "alice") == 1  # the half-done k, not k+1
    cur = lease.current(store, "tiny", 1)
    assert (cur.holder, cur.generation) == ("alice", 1)
    assert lease.held_by(store, "tiny", "dead-worker") == []


def test_released_lease_is_planned_at_once(store_uri: str, recipe) -> None:
    store = Store(store_uri)
    assert planner.plan(store, recipe, "airflow:failed-run") == 1
    assert lease.release(store, "tiny", 1, "airflow:failed-run") is True
    assert planner.plan(store, recipe, "airflow:next-run") == 1
    assert lease.current(store, "tiny", 1).holder == "airflow:next-run"


@pytest.mark.parametrize("before", ["fresh", "expired", "released"])
def test_racing_planners_one_wins_the_others_are_told_who(store_uri: str, recipe, before: str) -> None:
    """Processes with different holders plan the same pipeline at the same moment: exactly
    one gets iteration 1, every other gets LeaseHeld naming it. ``expired``/``released``:
    an earlier holder's lease on 1 is there and dead, and every racer has listed it."""
    store = Store(store_uri)
    if before == "expired":
        planner.plan(store, recipe, "dead-worker", ttl_s=0.0)
    elif before == "released":
        planner.plan(store, recipe, "failed-run")
        lease.release(store, "tiny", 1, "failed-run")
    holders = [f"racer-{i}" for i in range(RACERS)]
    results = race.race(race.plan, [(store_uri, str(TINY_RECIPE), h, 3600.0) for h in holders])
    won = [h for h, r in zip(holders, results) if r[0] == "won"]
    assert len(won) == 1, race.describe(results)
    winner = won[0]
    for h, r in zip(holders, results):
        if h == winner:
            assert r == ("won", 1)
        else:
            assert r[:3] == ("held", 1, winner), race.describe(results)
            assert r[3].startswith(f"iteration 1 of pipeline 'tiny' is held by '{winner}' (lease expires in ")
    cur = lease.current(store, "tiny", 1)
    assert cur.holder == winner and cur.live()
    assert cur.generation == {"fresh": 0, "expired": 1, "released": 2}[before]
    assert [h for h in holders if lease.held_by(store, "tiny", h)] == [winner]


def test_a_folder_where_the_recipe_snapshot_goes_is_one_line_naming_it(tmp_path, recipe) -> None:
    store = Store(f"file://{tmp_path}")
    (tmp_path / "tiny/iter-000001/recipe.json").mkdir(parents=True)
    with pytest.raises(UserError) as err:
        planner.plan(store, recipe, "alice")
    assert err.value.field == "file"
    assert err.value.value == str(tmp_path / "tiny/iter-000001/recipe.json")
    assert err.value.problem == "is a folder where posttrain writes a file"
    assert [p.name for p in (tmp_path / "tiny/iter-000001").iterdir()] == ["recipe.json"]  # no .tmp- file left


def test_a_file_where_an_iteration_folder_goes_is_one_line_naming_it(tmp_path, recipe) -> None:
    store = Store(f"file://{tmp_path}")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny/iter-000001").write_text("not a folder")
    with pytest.raises(UserError) as err:
        planner.plan(store, recipe, "alice")
    assert (err.value.value, err.value.problem) == (str(tmp_path / "tiny/iter-000001"),
                                                    "is a file where posttrain needs a folder")
    assert (tmp_path / "tiny/iter-000001").read_text() == "not a folder"


@pytest.mark.parametrize("blocked", ["tiny/_leases", "tiny/_leases/writer"])
def test_a_file_where_a_lease_folder_goes_is_one_line_naming_it(blocked: str, tmp_path, recipe) -> None:
    """A lease is written with ``Store.create``, which raised NotADirectoryError or
    FileExistsError where ``write_bytes`` named the file."""
    store = Store(f"file://{tmp_path}")
    (tmp_path / blocked).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / blocked).write_text("x")
    with pytest.raises(UserError) as err:
        lease.acquire_writer(store, "tiny", "alice")
    assert (err.value.value, err.value.problem) == (str(tmp_path / blocked), "is a file where posttrain needs a folder")
