"""The Kubeflow pipeline: compiled YAML in sync, its shape, and a real ``kfp.local`` run.

    pytest tests/pipelines/test_kfp_pipeline.py                 # fast: compile + shape
    pytest tests/pipelines/test_kfp_pipeline.py -m slow         # the local run (~2 min)

The local run executes every stage of one tiny iteration as a subprocess through
``kfp.local.SubprocessRunner(use_venv=False)``, with the store and MLflow inside
``tmp_path``. Not covered here: running the stage images (``DockerRunner`` or a KFP
cluster) -- ``tests/containers/`` checks the Dockerfiles only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from components import SHARDED_STAGES, STAGES, __version__
from pipelines.compile import COMPILED, compile_pipeline

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny.yaml"
# Fields that change with the installed kfp patch release, not with our wiring.
VOLATILE = ("sdkVersion",)


def _load(path: Path) -> dict:
    spec = yaml.safe_load(path.read_text())
    for key in VOLATILE:
        spec.pop(key, None)
    return spec


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    return _load(compile_pipeline(tmp_path_factory.mktemp("kfp") / "pipeline.yaml"))


def test_checked_in_yaml_matches_a_fresh_compile(compiled):
    assert COMPILED.exists(), f"{COMPILED} is missing: run `python pipelines/compile.py`"
    assert _load(COMPILED) == compiled, (
        f"{COMPILED.relative_to(REPO)} is out of date with pipelines/post_training_iteration.py: "
        "run `python pipelines/compile.py` and commit the result")


def test_one_component_per_stage_in_its_stage_image(compiled):
    executors = compiled["deploymentSpec"]["executors"]
    assert sorted(executors) == sorted(f"exec-{s}" for s in STAGES)
    for stage in STAGES:
        container = executors[f"exec-{stage}"]["container"]
        assert container["image"] == f"posttrain-{stage}:{__version__}"
        assert container["args"][-1] == stage  # --function_to_execute <stage>
        # install_kfp_package=False: the stage image already has kfp; no pip at run time
        assert "pip install" not in " ".join(container["command"])


def test_shards_fan_out_in_a_parallel_for_and_fan_in_at_validation(compiled):
    root = compiled["root"]["dag"]["tasks"]
    assert sorted(root) == sorted(["bootstrap", "taskgen", "for-loop-1", "validation", "trainer", "evaluation"])
    loop = root["for-loop-1"]
    assert loop["parameterIterator"]["items"] == {"inputParameter": "pipelinechannel--taskgen-Output"}
    assert loop["dependentTasks"] == ["taskgen"]
    body = compiled["components"]["comp-for-loop-1"]["dag"]["tasks"]
    assert sorted(body) == sorted(SHARDED_STAGES)
    assert body["sandbox"]["dependentTasks"] == ["rollout"]
    assert body["reward"]["dependentTasks"] == ["sandbox"]
    for stage in SHARDED_STAGES:
        assert body[stage]["inputs"]["parameters"]["shard"] == {
            "componentInputParameter": "pipelinechannel--taskgen-Output-loop-item"}
    collected = root["validation"]["inputs"]["parameters"]["rewards"]["taskOutputParameter"]
    assert collected == {"outputParameterKey": "pipelinechannel--reward-Output", "producerTask": "for-loop-1"}
    assert root["taskgen"]["dependentTasks"] == ["bootstrap"]
    assert root["trainer"]["dependentTasks"] == ["validation"]
    assert root["evaluation"]["dependentTasks"] == ["trainer"]


def test_every_task_retries_and_skips_the_kfp_cache(compiled):
    tasks = dict(compiled["root"]["dag"]["tasks"])
    tasks.update(compiled["components"]["comp-for-loop-1"]["dag"]["tasks"])
    tasks.pop("for-loop-1")
    assert sorted(tasks) == sorted(STAGES)
    for name, task in tasks.items():
        assert task["retryPolicy"]["maxRetryCount"] == 2, name
        assert task["retryPolicy"]["backoffDuration"] == "10s", name
        assert task["cachingOptions"] == {}, name  # enableCache absent = false: manifests are the cache
        assert task["inputs"]["parameters"]["run_id"] == {"runtimeValue": {"constant": "{{$.pipeline_job_uuid}}"}}


def test_pipeline_parameters_and_defaults(compiled):
    params = compiled["root"]["inputDefinitions"]["parameters"]
    assert {k: (v["parameterType"], v["defaultValue"]) for k, v in params.items()} == {
        "recipe": ("STRING", "recipes/demo.yaml"),
        "run_root": ("STRING", ".posttrain/store"),
        "iteration": ("NUMBER_INTEGER", 1.0),
    }


def test_image_prefix_names_a_registry(tmp_path):
    spec = _load(compile_pipeline(tmp_path / "p.yaml", image_prefix="registry.example.com/ml/"))
    images = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    assert images == {f"registry.example.com/ml/posttrain-{s}:{__version__}" for s in STAGES}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You may be attemping to run a task:RuntimeWarning")  # by design: no containers
def test_local_run_of_the_tiny_recipe(tmp_path, monkeypatch):
    import kfp.local
    from mlflow.tracking import MlflowClient

    from pipelines.post_training_iteration import post_training_iteration

    home, store = tmp_path / "home", tmp_path / "store"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSTTRAIN_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("POSTTRAIN_RUN_ROOT", raising=False)
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp-root"),
                   raise_on_error=True)

    task = post_training_iteration(recipe=str(TINY), run_root=str(store), iteration=1)

    iteration = store / "tiny" / "iter-000001"
    evaluation = json.loads((iteration / "evaluation" / "_MANIFEST.json").read_text())
    assert evaluation["stage"] == "evaluation" and evaluation["iteration"] == 1
    assert task.output == evaluation["content_digest"]  # the pipeline's output is the evaluation manifest digest
    for stage in SHARDED_STAGES:
        shards = sorted(p.parent.name for p in (iteration / stage).glob("shard-*/_MANIFEST.json"))
        assert shards == ["shard-00000-of-00002", "shard-00001-of-00002"], stage
    for stage in ("taskgen", "validation", "trainer"):
        assert (iteration / stage / "_MANIFEST.json").exists(), stage
    assert (store / "tiny" / "bootstrap" / "_MANIFEST.json").exists()

    mlflow = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    versions = sorted(int(v.version) for v in mlflow.search_model_versions("name='tiny-policy'"))
    assert versions == [1, 2]  # v1 from bootstrap, v2 from this iteration's trainer
    parent = mlflow.get_run(json.loads((iteration / "taskgen" / "_MANIFEST.json").read_text())["info"]["parent_run_id"])
    assert parent.data.tags["posttrain.iteration"] == "1"
    assert parent.data.tags["posttrain.orchestrator_run_id"] != ""  # the KFP job id reached MLflow
