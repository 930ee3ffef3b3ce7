"""Lineage in MLflow after bootstrap + one full iteration of recipes/tiny.yaml.

The registry version the trainer made must lead back to the trainer's run, that run to the
rollout and reward files it trained on (as MLflow datasets with the manifest digests), to
the policy version it started from, and to the iteration's parent run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from components.core import models, settings, tracking
from components.core.facts import Checkpoint, Decision, Scored, StartingPolicy
from components.core.manifest import Manifest
from components.core.runner import run_stage
from components.core.storage import Store
from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients, use_home

ITERATION = [("taskgen", None), ("rollout", "0/2"), ("rollout", "1/2"), ("sandbox", "0/2"), ("sandbox", "1/2"),
             ("reward", "0/2"), ("reward", "1/2"), ("validation", None), ("trainer", None), ("evaluation", None)]
MODEL = "tiny-policy"


@dataclass
class Iteration:
    store: Store
    manifests: dict[str, Manifest]  # "bootstrap", "taskgen", "rollout[0/2]", ...


@pytest.fixture(scope="module")
def iteration(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("lineage")
    root = f"file://{base / 'store'}"
    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, base / ".posttrain")
        manifests = {"bootstrap": run_stage("bootstrap", TINY_RECIPE, root, 0)}
        for stage, shard in ITERATION:
            manifests[f"{stage}[{shard}]" if shard else stage] = run_stage(stage, TINY_RECIPE, root, 1, shard)
        yield Iteration(store=Store(root), manifests=manifests)
        reset_tracking_clients()


@pytest.fixture
def client(iteration: Iteration):
    return tracking.client()


def test_trainer_registered_version_2_from_its_run(iteration: Iteration, client) -> None:
    trainer = iteration.manifests["trainer"]
    mv = client.get_model_version(MODEL, "2")
    assert mv.run_id == trainer.mlflow_run_id
    assert trainer.facts(Checkpoint).version == "2"
    assert models.checkpoint_of(mv) == trainer.facts(Checkpoint).checkpoint_uri == iteration.store.url(trainer.outputs["checkpoint"].path)
    assert mv.tags["posttrain.parent_version"] == "1"
    assert mv.tags["posttrain.iteration"] == "1"
    v1 = client.get_model_version(MODEL, "1")
    assert v1.run_id == iteration.manifests["bootstrap"].mlflow_run_id
    assert models.checkpoint_of(v1) == iteration.manifests["bootstrap"].facts(Scored).checkpoint_uri
    assert sorted(int(v.version) for v in client.search_model_versions(f"name = '{MODEL}'")) == [1, 2]


def test_trainer_run_lists_the_files_it_trained_on(iteration: Iteration, client) -> None:
    trainer = iteration.manifests["trainer"]
    inputs = client.get_run(trainer.mlflow_run_id).inputs.dataset_inputs
    training = {d.dataset.name: d.dataset for d in inputs
                if {t.key: t.value for t in d.tags}.get("mlflow.data.context") == "training"}
    assert set(training) == {"rollouts[0/2]", "rollouts[1/2]", "rewards[0/2]", "rewards[1/2]"}
    for stage, name in (("rollout", "rollouts"), ("reward", "rewards")):
        for shard in ("0/2", "1/2"):
            out = iteration.manifests[f"{stage}[{shard}]"].outputs[name]
            ds = training[f"{name}[{shard}]"]
            assert json.loads(ds.source)["uri"] == iteration.store.url(out.path)
            assert out.path.endswith(f"/{name}.parquet")
            assert ds.digest == out.sha256[:36]


def test_stage_inputs_are_logged_with_manifest_digests(iteration: Iteration, client) -> None:
    trainer = iteration.manifests["trainer"]
    inputs = client.get_run(trainer.mlflow_run_id).inputs.dataset_inputs
    logged = {d.dataset.name: d.dataset for d in inputs
              if {t.key: t.value for t in d.tags}.get("mlflow.data.context") == "input"}
    assert set(logged) == set(trainer.inputs) == {"validation", "rollout[0/2]", "rollout[1/2]", "reward[0/2]",
                                                   "reward[1/2]", "policy"}
    for key, ref in trainer.inputs.items():
        assert json.loads(logged[key].source)["uri"] == ref.uri
        assert logged[key].digest == ref.digest[:36]
    assert trainer.inputs["reward[1/2]"].digest == iteration.manifests["reward[1/2]"].content_digest


def test_trainer_run_names_its_parent_policy(iteration: Iteration, client) -> None:
    tags = client.get_run(iteration.manifests["trainer"].mlflow_run_id).data.tags
    assert tags["posttrain.parent_policy_version"] == "1"
    assert tags["posttrain.parent_policy_uri"] == iteration.manifests["bootstrap"].facts(Scored).checkpoint_uri
    assert tags[tracking.TAG_STAGE] == "trainer"
    assert tags[tracking.TAG_ITERATION] == "1"


def test_aliases_follow_the_evaluation_decision(iteration: Iteration, client) -> None:
    evaluation = iteration.manifests["evaluation"]
    assert evaluation.facts(Decision).promoted is True  # this seeded iteration promotes (its expected values
    # came from the decision itself, so a wrong decision and aliases that followed it passed)
    assert str(client.get_model_version_by_alias(MODEL, "candidate").version) == "2"
    assert str(client.get_model_version_by_alias(MODEL, "champion").version) == "2"
    assert models.resolve_alias("tiny", "champion")[0] == "2"
    assert client.get_model_version(MODEL, "2").tags["posttrain.decision"] == "promoted"


def test_every_stage_run_hangs_under_the_iteration_run(iteration: Iteration, client) -> None:
    parent_id = iteration.manifests["taskgen"].facts(StartingPolicy).parent_run_id
    parent = client.get_run(parent_id)
    assert parent.data.tags[tracking.TAG_STAGE] == "iteration"
    assert parent.data.tags[tracking.TAG_ITERATION] == "1"
    assert parent.data.tags[tracking.TAG_RUN_ROOT] == iteration.store.uri
    for key, m in iteration.manifests.items():
        tags = client.get_run(m.mlflow_run_id).data.tags
        if key == "bootstrap":
            assert "mlflow.parentRunId" not in tags
        else:
            assert tags["mlflow.parentRunId"] == parent_id, key
    assert len({m.mlflow_run_id for m in iteration.manifests.values()}) == len(iteration.manifests)


def test_artifacts_live_beside_the_embedded_database(iteration: Iteration, client) -> None:
    home = settings.home()
    assert tracking.tracking_uri() == f"sqlite:///{home / 'mlflow.db'}"
    assert (home / "mlflow.db").is_file()
    exp = client.get_experiment_by_name("tiny")
    assert exp.artifact_location == (home / "mlartifacts" / "tiny").as_uri() == f"file://{home}/mlartifacts/tiny"
    assert client.get_run(iteration.manifests["trainer"].mlflow_run_id).info.experiment_id == exp.experiment_id


# Kept last: it re-runs taskgen of a finished iteration (which must be a cache hit).
def test_rerunning_a_finished_iterations_taskgen_is_a_cache_hit(iteration: Iteration) -> None:
    assert iteration.manifests["evaluation"].facts(Decision).promoted is True  # the alias moved to version 2
    again = run_stage("taskgen", TINY_RECIPE, iteration.store.uri, 1)
    assert again.facts(StartingPolicy).policy_version == "1"
    assert again == iteration.manifests["taskgen"]
