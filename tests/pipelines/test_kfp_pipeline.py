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
from components.core.stages import registered
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
    assert sorted(executors) == sorted(["exec-plan", "exec-shards", "exec-shards-2", "exec-shards-3", *(f"exec-{s}" for s in STAGES)])
    for stage in STAGES:
        container = executors[f"exec-{stage}"]["container"]
        assert container["image"] == f"posttrain-{stage}:{__version__}"
        assert container["args"][-1] == stage  # --function_to_execute <stage>
        # install_kfp_package=False: the stage image already has kfp; no pip at run time
        assert "pip install" not in " ".join(container["command"])


def _tasks(compiled) -> dict[str, tuple[dict, str]]:
    """Every stage task: (its spec, the loop it runs in or '')."""
    out = {name: (task, "") for name, task in compiled["root"]["dag"]["tasks"].items() if not name.startswith("for-loop")}
    for name, comp in compiled["components"].items():
        if name.startswith("comp-for-loop"):
            for inner, task in comp["dag"]["tasks"].items():
                out[inner] = (task, name[len("comp-"):])
    return out


def test_the_wiring_follows_the_stage_registry(compiled):
    """Each stage waits for exactly its registry upstream (bootstrap for the plan); sharded
    stages run in a loop over the shard list of that stage."""
    tasks = _tasks(compiled)
    root = compiled["root"]["dag"]["tasks"]
    loop_of = {loop: name for name, (_, loop) in tasks.items() if loop}
    lister = {t["inputs"]["parameters"]["stage"]["runtimeValue"]["constant"]: name
              for name, (t, _) in tasks.items() if name.startswith("shards")}
    assert sorted(tasks) == sorted(["plan", "shards", "shards-2", "shards-3", *STAGES])
    assert sorted(lister) == sorted(SHARDED_STAGES)
    for spec in registered():
        task, loop = tasks[spec.id]
        outer = root[loop] if loop else task
        waits = {loop_of.get(d, d) for d in outer.get("dependentTasks", [])} - set(lister.values())
        assert waits == (set(spec.upstream) or {"plan"}), spec.id
        assert bool(loop) == spec.sharded, spec.id
        if loop:
            channel = f"pipelinechannel--{lister[spec.id]}-Output"
            assert root[loop]["parameterIterator"]["items"] == {"inputParameter": channel}
            assert task["inputs"]["parameters"]["shard"] == {"componentInputParameter": f"{channel}-loop-item"}


def test_every_task_retries_and_skips_the_kfp_cache(compiled):
    tasks = {name: task for name, (task, _) in _tasks(compiled).items()}
    assert sorted(tasks) == sorted(["plan", "shards", "shards-2", "shards-3", *STAGES])
    for name, task in tasks.items():
        assert task["retryPolicy"]["maxRetryCount"] == 2, name
        assert task["retryPolicy"]["backoffDuration"] == "10s", name
        assert task["cachingOptions"] == {}, name  # enableCache absent = false: manifests are the cache
        if not name.startswith("shards"):
            assert task["inputs"]["parameters"]["run_id"] == {"runtimeValue": {"constant": "{{$.pipeline_job_uuid}}"}}


def test_pipeline_parameters_default_to_the_environment(compiled):
    params = compiled["root"]["inputDefinitions"]["parameters"]
    assert {k: (v["parameterType"], v["defaultValue"]) for k, v in params.items()} == {
        "recipe": ("STRING", ""), "run_root": ("STRING", "")}  # empty: POSTTRAIN_RECIPE / POSTTRAIN_RUN_ROOT


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

    task = post_training_iteration(recipe=str(TINY), run_root=str(store))

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
    assert [p.name for p in (store / "tiny" / "_leases").iterdir()] == ["iter-000001"]  # planned and leased
    assert parent.data.tags["posttrain.iteration"] == "1"
    assert parent.data.tags["posttrain.orchestrator_run_id"] != ""  # the KFP job id reached MLflow
