"""What MLflow shows after stages of finished iterations are run again, on bootstrap and two
iterations of recipes/tiny.yaml run in this process (``run_stage``, as ``posttrain stage``
runs them; the test home's SQLite MLflow, a file store).

- Re-running iteration 1's evaluation after iteration 2 finished (a cache hit ends the
  iteration again) leaves the summary run's plots showing iterations 0..2 and iteration
  1's own plots 0..1, byte for byte what they were.
- An iteration the orchestrator ended FAILED and that is then finished through
  ``posttrain stage`` ends FINISHED, at its evaluation and at the next plan
  (``close_finished_iterations``).
- A stage run of another shard count left RUNNING (a SIGKILLed attempt before the
  recipe's ``shards`` changed back) ends KILLED when the iteration ends.
- Iteration 2 re-run from its rollout with another ``rollout.group_size``: its parent run
  and the summary run show the new headline values at step 2 (the old ones stay earlier
  in the history), every earlier stage run is marked superseded by its re-run.

Kept in this order: the last test changes iteration 2.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from components.core import models, timeline, tracking
from components.core.facts import StartingPolicy
from components.core.manifest import Manifest
from components.core.recipe import parse_recipe
from components.core.runner import close_finished_iterations, run_stage
from components.core.storage import Store
from tests.core.test_timeline import expected
from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients, use_home

ITERATION = [("taskgen", None), ("rollout", "0/2"), ("rollout", "1/2"), ("sandbox", "0/2"), ("sandbox", "1/2"),
             ("reward", "0/2"), ("reward", "1/2"), ("validation", None), ("trainer", None), ("evaluation", None)]


@dataclass
class Ran:
    root: str
    store: Store
    manifests: dict[tuple[int, str], Manifest]  # (iteration, "rollout[0/2]"): the manifest

    def parent(self, k: int) -> str:
        return self.manifests[(k, "taskgen")].facts(StartingPolicy).parent_run_id


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("reruns")
    root = f"file://{base / 'store'}"
    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, base / ".posttrain")
        mp.setenv("POSTTRAIN_TORCH_THREADS", "1")
        manifests = {(0, "bootstrap"): run_stage("bootstrap", TINY_RECIPE, root, 0)}
        for k in (1, 2):
            for stage, shard in ITERATION:
                manifests[(k, f"{stage}[{shard}]" if shard else stage)] = run_stage(stage, TINY_RECIPE, root, k, shard)
        yield Ran(root, Store(root), manifests)
        reset_tracking_clients()


def status(run_id: str) -> str:
    return tracking.client().get_run(run_id).info.status


def plots(run_id: str, into: Path) -> dict[str, str]:
    """The sha256 of each of the run's timeline plots."""
    c = tracking.client()
    return {name: hashlib.sha256(Path(c.download_artifacts(run_id, f"timeline/{name}", str(into / run_id / name[:-4])))
                                 .read_bytes()).hexdigest() for name in ("pass_rates.png", "rewards.png")}


def test_rerunning_an_older_iteration_leaves_the_summary_plots_whole(ran: Ran, tmp_path: Path) -> None:
    summary = tracking.pipeline_run("tiny", ran.root)
    before = {run: plots(run, tmp_path / "before") for run in (summary, ran.parent(1), ran.parent(2))}
    assert timeline.latest_finished(ran.store, "tiny") == 2
    assert before[summary] == before[ran.parent(2)]  # both drawn from iterations 0..2
    assert before[summary]["pass_rates.png"] != before[ran.parent(1)]["pass_rates.png"]  # 0..1: another picture

    again = run_stage("evaluation", TINY_RECIPE, ran.root, 1)  # a cache hit: iteration 1 ends again
    assert again.mlflow_run_id == ran.manifests[(1, "evaluation")].mlflow_run_id
    after = {run: plots(run, tmp_path / "after") for run in before}
    assert after == before


def failed(parent: str, end: str = "FAILED") -> None:
    """The iteration was resumed (its parent RUNNING again), then the orchestrator gave up on it."""
    tracking.client().update_run(parent, status="RUNNING")
    tracking.end_if_running(parent, end)  # what fail_iteration does (FAILED)


def test_an_iteration_finished_after_the_orchestrator_failed_it_ends_finished(ran: Ran) -> None:
    failed(ran.parent(1))
    assert status(ran.parent(1)) == "FAILED"
    run_stage("evaluation", TINY_RECIPE, ran.root, 1)  # posttrain stage evaluation --iteration 1: done
    assert status(ran.parent(1)) == "FINISHED"

    failed(ran.parent(1))
    failed(ran.parent(2), "KILLED")
    assert close_finished_iterations(ran.store, "tiny") == [1, 2]  # the next plan
    assert (status(ran.parent(1)), status(ran.parent(2))) == ("FINISHED", "FINISHED")
    assert close_finished_iterations(ran.store, "tiny") == []


def test_a_stage_run_of_another_shard_count_left_running_ends_killed_with_the_iteration(ran: Ran) -> None:
    c = tracking.client()
    exp = tracking.experiment_id("tiny")
    leftover = c.create_run(exp, run_name="rollout[2/3] · iter-000001", tags={
        tracking.TAG_PARENT: ran.parent(1), tracking.TAG_STAGE: "rollout", tracking.TAG_ITERATION: "1",
        tracking.TAG_RUN_ROOT: ran.store.uri, tracking.TAG_SHARD: "2/3"}).info.run_id  # SIGKILLed under shards: 3
    run_stage("evaluation", TINY_RECIPE, ran.root, 1)
    assert (status(leftover), status(ran.parent(1))) == ("KILLED", "FINISHED")
    running = c.search_runs([exp], filter_string="attributes.status = 'RUNNING'")
    assert [r.info.run_name for r in running] == []


def at_step(run_id: str, key: str, step: int) -> list[float]:
    history = sorted(tracking.client().get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return [m.value for m in history if m.step == step]


def test_a_rerun_iteration_shows_its_new_headline_values(ran: Ran) -> None:
    summary, parent = tracking.pipeline_run("tiny", ran.root), ran.parent(2)
    old = expected(ran.store, 2)
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["rollout"]["group_size"] = 2  # half the rollouts: other sandbox counts
    recipe = parse_recipe(data)
    rerun = {label: run_stage(stage, recipe, ran.root, 2, shard)
             for stage, shard in ITERATION[1:] for label in [f"{stage}[{shard}]" if shard else stage]}
    new = expected(ran.store, 2)
    assert (old["sandbox/ok"], new["sandbox/ok"]) == (16.0, 8.0)
    for run_id in (parent, summary):
        latest = {key: at_step(run_id, key, 2)[-1] for key in new}
        assert latest == pytest.approx(new), run_id
        assert at_step(run_id, "sandbox/ok", 2) == [16.0, 8.0]  # the old value stays, before the new one
    assert tracking.client().get_run(parent).data.metrics == pytest.approx(new)  # what the runs table shows
    assert tracking.client().get_run(summary).data.metrics["sandbox/ok"] == 8.0

    c = tracking.client()
    for label, manifest in rerun.items():
        first = ran.manifests[(2, label)].mlflow_run_id
        assert first != manifest.mlflow_run_id, label
        assert c.get_run(first).data.tags[tracking.TAG_SUPERSEDED_BY] == manifest.mlflow_run_id, label
        assert tracking.TAG_SUPERSEDED_BY not in c.get_run(manifest.mlflow_run_id).data.tags, label
    report = json.loads(ran.store.read_bytes(rerun["evaluation"].outputs["report"].path))
    mv = c.get_model_version("tiny-policy", report["candidate"])
    assert mv.tags[models.TAG_SOURCE_RUN] == rerun["trainer"].mlflow_run_id
