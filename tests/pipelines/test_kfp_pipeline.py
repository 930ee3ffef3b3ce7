"""The Kubeflow pipeline: compiled YAML in sync, its shape, and a real ``kfp.local`` run.

    pytest tests/pipelines/test_kfp_pipeline.py                 # fast: compile + shape + cluster settings
    pytest tests/pipelines/test_kfp_pipeline.py -m slow         # the local run (~2 min)

The local run executes every stage of one tiny iteration as a subprocess through
``kfp.local.SubprocessRunner(use_venv=False)``, with the store and MLflow inside
``tmp_path``. The cluster settings (``kfp-kubernetes``) are checked in the compiled
YAML's second document, ``platforms.kubernetes.deploymentSpec``, against the stage
registry and against what ``infra/terraform/`` creates. Not covered here: running the
stage images (``DockerRunner`` or a KFP cluster) -- ``tests/containers/`` checks the
Dockerfiles only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from collections.abc import MutableMapping
from pathlib import Path

import pytest
import yaml

from components import SHARDED_STAGES, STAGES, __version__
from components.core.stages import registered
from pipelines.compile import COMPILED, compile_pipeline, main
from pipelines.post_training_iteration import CONFIG_MAP, CONFIG_MAP_KEYS, CONFIG_MAP_OPTIONAL_KEYS, GPU_NODE_SELECTOR, S3_SECRET

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny.yaml"
# Fields that change with the installed kfp patch release, not with our wiring.
VOLATILE = ("sdkVersion",)


def _load(path: Path) -> dict:
    """The pipeline spec, with the platform spec (the file's second YAML document) under ``platforms``."""
    spec, *platform = yaml.safe_load_all(path.read_text())
    for doc in platform:
        spec.update(doc)
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
    assert sorted(executors) == sorted(["exec-plan", "exec-shards", "exec-shards-2", "exec-shards-3", "exec-hand-back",
                                        *(f"exec-{s}" for s in STAGES)])
    for stage in STAGES:
        container = executors[f"exec-{stage}"]["container"]
        assert container["image"] == f"posttrain-{stage}:{__version__}"
        assert container["args"][-1] == stage  # --function_to_execute <stage>
        # install_kfp_package=False: the stage image already has kfp; no pip at run time
        assert "pip install" not in " ".join(container["command"])


def _body(compiled) -> dict[str, dict]:
    """The tasks of the iteration: those inside the exit handler (the pipeline's root holds
    only it and the exit task)."""
    return compiled["components"]["comp-exit-handler-1"]["dag"]["tasks"]


def _tasks(compiled) -> dict[str, tuple[dict, str]]:
    """Every stage task: (its spec, the loop it runs in or '')."""
    out = {name: (task, "") for name, task in _body(compiled).items() if not name.startswith("for-loop")}
    for name, comp in compiled["components"].items():
        if name.startswith("comp-for-loop"):
            for inner, task in comp["dag"]["tasks"].items():
                out[inner] = (task, name[len("comp-"):])
    return out


def test_the_exit_task_runs_after_the_iteration_whatever_its_end(compiled):
    """``hand-back`` (``hand_back``) hands a failed run's lease back, as the DAG's failure
    callback does: it waits for the whole iteration, and runs whether it failed or not."""
    root = compiled["root"]["dag"]["tasks"]
    assert sorted(root) == ["exit-handler-1", "hand-back"]
    exit_task = root["hand-back"]
    assert exit_task["dependentTasks"] == ["exit-handler-1"]
    assert exit_task["triggerPolicy"] == {"strategy": "ALL_UPSTREAM_TASKS_COMPLETED"}
    assert "retryPolicy" not in exit_task and exit_task["cachingOptions"] == {}
    assert exit_task["inputs"]["parameters"]["holder"] == {"componentInputParameter": "holder"}


def test_the_wiring_follows_the_stage_registry(compiled):
    """Each stage waits for exactly its registry upstream (bootstrap for the plan); sharded
    stages run in a loop over the shard list of that stage."""
    tasks = _tasks(compiled)
    root = _body(compiled)
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


def test_every_task_but_plan_retries_and_none_uses_the_kfp_cache(compiled):
    """``plan`` retries outages itself: KFP retrying it would run a bad recipe three times."""
    tasks = {name: task for name, (task, _) in _tasks(compiled).items()}
    assert sorted(tasks) == sorted(["plan", "shards", "shards-2", "shards-3", *STAGES])
    assert "retryPolicy" not in tasks["plan"]
    for name, task in tasks.items():
        if name == "plan":
            continue
        assert task["retryPolicy"]["maxRetryCount"] == 2, name
        assert task["retryPolicy"]["backoffDuration"] == "10s", name
        if name.startswith("shards"):  # a recipe reaches them only once plan has checked it
            assert task["dependentTasks"] == ["plan"], name
        assert task["cachingOptions"] == {}, name  # enableCache absent = false: manifests are the cache
        if not name.startswith("shards"):
            assert task["inputs"]["parameters"]["run_id"] == {"runtimeValue": {"constant": "{{$.pipeline_job_uuid}}"}}


def test_pipeline_parameters_default_to_the_environment(compiled):
    params = compiled["root"]["inputDefinitions"]["parameters"]
    assert {k: (v["parameterType"], v["defaultValue"]) for k, v in params.items()} == {
        "recipe": ("STRING", ""), "run_root": ("STRING", ""),  # empty: POSTTRAIN_RECIPE / POSTTRAIN_RUN_ROOT
        "holder": ("STRING", "")}  # empty: kfp:<job id> holds the iteration's lease


def test_image_prefix_names_a_registry(tmp_path):
    spec = _load(compile_pipeline(tmp_path / "p.yaml", image_prefix="registry.example.com/ml/"))
    images = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    assert images == {f"registry.example.com/ml/posttrain-{s}:{__version__}" for s in STAGES}


def _platform(compiled: dict) -> dict[str, dict]:
    return compiled["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def _env_from(executor: dict) -> tuple[dict[str, tuple[str, bool]], dict[str, tuple[str, bool]]]:
    """({env var: (config map, optional)}, {env var: (secret, optional)}) of one executor."""
    maps = {k["envVar"]: (c["configMapName"], c["optional"]) for c in executor.get("configMapAsEnv", []) for k in c["keyToEnv"]}
    secrets = {k["envVar"]: (s["secretName"], s["optional"]) for s in executor.get("secretAsEnv", []) for k in s["keyToEnv"]}
    return maps, secrets


def test_every_task_gets_the_stage_environment_and_runs_as_the_image_user(compiled):
    platform = _platform(compiled)
    assert sorted(platform) == sorted(compiled["deploymentSpec"]["executors"])
    for name, executor in platform.items():
        maps, secrets = _env_from(executor)
        assert maps == {"POSTTRAIN_RUN_ROOT": ("posttrain-stage-env", False), "MLFLOW_TRACKING_URI": ("posttrain-stage-env", False),
                        "AWS_REGION": ("posttrain-stage-env", False), "AWS_ENDPOINT_URL": ("posttrain-stage-env", True)}, name
        # optional: on EKS the service account's IRSA role grants the store and there is no such secret
        assert secrets == {"AWS_ACCESS_KEY_ID": ("posttrain-s3", True), "AWS_SECRET_ACCESS_KEY": ("posttrain-s3", True)}, name
        assert executor["securityContext"] == {"runAsUser": "10001", "runAsGroup": "10001", "runAsNonRoot": True}, name


def test_stage_resources_gpus_and_placement_follow_the_registry(compiled):
    platform, executors = _platform(compiled), compiled["deploymentSpec"]["executors"]
    for spec in registered():
        executor, resources = platform[f"exec-{spec.id}"], executors[f"exec-{spec.id}"]["container"]["resources"]
        assert resources["resourceCpuRequest"] == spec.cpu, spec.id
        assert resources["resourceMemoryRequest"] == resources["resourceMemoryLimit"] == spec.memory, spec.id
        assert executor["podMetadata"]["labels"] == {"posttrain.io/stage": spec.id}
        assert executor["activeDeadlineSeconds"] == str(spec.timeout_s), spec.id
        if spec.gpus:
            assert resources["accelerator"]["resourceType"] == "nvidia.com/gpu", spec.id
            assert resources["accelerator"]["resourceCount"] == str(spec.gpus), spec.id
            assert executor["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
            assert executor["nodeSelector"] == {"labels": {"posttrain.io/pool": "gpu"}}, spec.id
        else:
            assert "accelerator" not in resources, spec.id
            assert "tolerations" not in executor and "nodeSelector" not in executor, spec.id
        annotations = executor["podMetadata"].get("annotations", {})
        assert annotations == ({"container.apparmor.security.beta.kubernetes.io/main": "unconfined"} if spec.sandboxed else {})
        # the registry's scratch as two sized emptyDirs, as the DAG's pods (kfp-kubernetes sets neither a read-only
        # root nor an ephemeral-storage limit: pipelines/post_training_iteration.py says so)
        assert executor["emptyDirMounts"] == [
            {"volumeName": "scratch-tmp", "mountPath": "/tmp", "sizeLimit": spec.scratch},
            {"volumeName": "scratch-home", "mountPath": "/home/posttrain", "sizeLimit": spec.scratch}], spec.id
    assert {s.id for s in registered() if s.gpus} == {"bootstrap", "rollout", "trainer", "evaluation"}
    for helper in ("exec-plan", "exec-shards", "exec-shards-2", "exec-shards-3"):  # no GPU, no stage deadline
        assert not {"tolerations", "nodeSelector", "activeDeadlineSeconds", "emptyDirMounts"} & set(platform[helper]), helper
        assert "accelerator" not in executors[helper]["container"].get("resources", {}), helper


def test_the_config_map_keys_are_the_ones_terraform_writes():
    tf = (REPO / "infra" / "terraform" / "kubernetes.tf").read_text()
    block = re.search(r'resource "kubernetes_config_map_v1" "stage_env" \{.*?\n  data = \{\n(.*?)\n  \}', tf, re.S)
    assert block, "infra/terraform/kubernetes.tf: the stage_env config map is gone"
    written = set(re.findall(r"^\s+(\w+)\s+=", block.group(1), re.M))
    assert set(CONFIG_MAP_KEYS) <= written, f"the pipeline needs {sorted(set(CONFIG_MAP_KEYS) - written)} in posttrain-stage-env"
    assert not set(CONFIG_MAP_OPTIONAL_KEYS) & set(CONFIG_MAP_KEYS)


def test_cluster_names_are_compile_options(tmp_path):
    spec = _load(compile_pipeline(tmp_path / "p.yaml", config_map="stage-env", s3_secret="", gpu_node_selector=""))
    for name, executor in _platform(spec).items():
        maps, secrets = _env_from(executor)
        assert {m for m, _ in maps.values()} == {"stage-env"} and secrets == {}, name
        assert "nodeSelector" not in executor, name
    assert _platform(spec)["exec-trainer"]["tolerations"]  # the GPU taint is still tolerated
    spec = _load(compile_pipeline(tmp_path / "q.yaml", gpu_node_selector="karpenter.sh/nodepool=gpu, accel=h100"))
    assert _platform(spec)["exec-rollout"]["nodeSelector"] == {"labels": {"karpenter.sh/nodepool": "gpu", "accel": "h100"}}


@pytest.mark.parametrize(("option", "value", "problem"), [
    ("--config-map", "", "not a Kubernetes name"),  # required: the tasks take their environment from it
    ("--config-map", "Stage_Env", "not a Kubernetes name"),
    ("--s3-secret", "Not_A Secret", "not a Kubernetes name"),
    ("--gpu-node-selector", "bad key!=v a=l=ue", "'bad key!=v a=l=ue' is not a node label 'key=value'"),
    ("--gpu-node-selector", "gpu", "'gpu' is not a node label 'key=value'"),
    ("--gpu-node-selector", f"pool={'x' * 64}", "is not a node label"),  # a label value is at most 63
    ("--image-prefix", "a//", "makes 'a//posttrain-bootstrap', which is not an image name"),
    ("--image-prefix", "reg.io:99999999/", "which is not an image name"),  # no port past 65535
])
def test_a_name_the_dag_refuses_is_refused_before_anything_is_written(option, value, problem, tmp_path, capsys):
    """Before, these compiled (exit 0) into a pipeline whose pods the cluster rejects at run
    time (configMapName '', secretName 'Not_A Secret', image 'a//posttrain-bootstrap:0.1.0'),
    which KFP retried twice; the DAG refuses the same values of POSTTRAIN_STAGE_CONFIGMAP,
    POSTTRAIN_STAGE_SECRET, POSTTRAIN_GPU_NODE_SELECTOR and POSTTRAIN_IMAGE_PREFIX with one
    line. compile.py runs the DAG's own checks and names its option instead."""
    out = tmp_path / "p.yaml"
    with pytest.raises(SystemExit) as exit_:
        main(["--output", str(out), option, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f": error: {option}={value!r}: " in err[-1] and problem in err[-1], err
    assert "; fix: " in err[-1]
    if option == "--s3-secret":  # the option's default is a name: "no secret" is the option passed empty
        assert err[-1].endswith("or pass --s3-secret ''") and "unset" not in err[-1]
    assert list(tmp_path.iterdir()) == []  # no output, no temporary file


def test_the_same_values_the_dag_refuses(monkeypatch):
    """The checks are the DAG's (dags/execution/cluster.py, dags.execution.check_image_prefix),
    not a copy: the pipeline's names and the DAG's settings accept and refuse alike."""
    from components.core.errors import UserError
    from dags.execution import cluster, image_for
    from pipelines.post_training_iteration import cluster_names, parse_node_selector, stage_image

    def dag_reads(var: str, value: str, setting):
        with monkeypatch.context() as env:
            env.setenv(var, value)
            try:
                return setting()
            except UserError:
                return None

    for selector in ("", "posttrain.io/pool=gpu", "a=b, c=", "bad key=v", "=v", "k", f"pool={'x' * 64}"):
        expected = dag_reads(cluster.GPU_NODE_SELECTOR_VAR, selector, lambda: cluster.cluster_settings().gpu_node_selector)
        try:
            assert parse_node_selector(selector) == expected, selector
        except UserError as exc:
            assert expected is None and exc.field == "gpu_node_selector", selector
    for field, var, attr in (("config_map", cluster.CONFIGMAP_VAR, "config_map"), ("s3_secret", cluster.SECRET_VAR, "secret")):
        for name in ("", "stage-env", " stage-env ", "Stage_Env", "a.b", "a" * 254):
            expected = dag_reads(var, name, lambda attr=attr: getattr(cluster.cluster_settings(), attr))
            try:
                assert getattr(cluster_names(**{field: name}), attr) == expected, (field, name)
            except UserError as exc:
                assert expected is None and exc.field == field, (field, name)
    for prefix in ("", "registry.example.com/ml/", "UPPER/", "reg:port/", "a" * 250 + "/"):
        with monkeypatch.context() as env:
            env.setenv("POSTTRAIN_IMAGE_TAG", __version__)
            expected = dag_reads("POSTTRAIN_IMAGE_PREFIX", prefix, lambda: image_for("trainer"))
        try:
            assert stage_image("trainer", prefix) == expected, prefix
        except UserError as exc:
            assert expected is None and exc.field == "image_prefix", prefix
    assert cluster_names("stage-env", "", "") == cluster_names(" stage-env ", " ", " ")


class _WatchedEnviron(MutableMapping):
    """``os.environ`` that records every name read or written through it."""

    def __init__(self, real):
        self.real, self.touched = real, []

    def __getitem__(self, name):
        self.touched.append(("read", name))
        return self.real[name]

    def __setitem__(self, name, value):
        self.touched.append(("write", name))
        self.real[name] = value

    def __delitem__(self, name):
        self.touched.append(("write", name))
        del self.real[name]

    def __iter__(self):
        self.touched.append(("read", "*"))
        return iter(self.real)

    def __len__(self):
        return len(self.real)


@pytest.mark.parametrize(("option", "value", "refused"), [
    (None, None, False),  # all defaults
    ("--image-prefix", "registry.example.com/ml/", False),
    ("--image-prefix", "a//", True),
    ("--config-map", "stage-env", False),
    ("--config-map", "Stage_Env", True),
    ("--s3-secret", "", False),
    ("--s3-secret", "Not_A Secret", True),
    ("--gpu-node-selector", "karpenter.sh/nodepool=gpu, accel=h100", False),
    ("--gpu-node-selector", "gpu", True),
])
def test_compile_checks_neither_read_nor_set_the_environment(option, value, refused, tmp_path, monkeypatch):
    """Before, compile.py checked its options by setting POSTTRAIN_STAGE_CONFIGMAP & co. in
    os.environ around the DAG's checks, which read them from there (and restored them after):
    not thread-safe. Now the checks take the option's value, and nothing reads the
    environment: the variables the DAG would read, set to values it refuses, change nothing."""
    from components.core.errors import UserError
    from dags.execution import cluster
    from pipelines import compile as compile_module

    for var in (cluster.CONFIGMAP_VAR, cluster.SECRET_VAR, cluster.GPU_NODE_SELECTOR_VAR, "POSTTRAIN_IMAGE_PREFIX",
                "POSTTRAIN_IMAGE_TAG", cluster.NAMESPACE_VAR):
        monkeypatch.setenv(var, "Refused By_The DAG!")

    class Refused(Exception):
        pass

    class Parser:
        def error(self, message):
            raise Refused(message)

    args = argparse.Namespace(output=str(tmp_path / "p.yaml"), image_prefix="", config_map=CONFIG_MAP,
                              s3_secret=S3_SECRET, gpu_node_selector=GPU_NODE_SELECTOR)
    if option:
        setattr(args, option[2:].replace("-", "_"), value)
    watched = _WatchedEnviron(os.environ)
    monkeypatch.setattr(os, "environ", watched)
    if refused:
        with pytest.raises(Refused) as exc:
            compile_module._check_options(Parser(), args)
        assert str(exc.value).startswith(f"{option}={value!r}: ") and "; fix: " in str(exc.value), exc.value
    else:
        compile_module._check_options(Parser(), args)
    assert watched.touched == []  # nothing read, nothing set
    with pytest.raises(UserError, match=r"^POSTTRAIN_NAMESPACE="):  # the DAG's own reading, through the same watch
        cluster.cluster_settings()
    assert ("read", cluster.NAMESPACE_VAR) in watched.touched


def test_a_plug_in_stage_is_refused_rather_than_skipped(tmp_path, monkeypatch, capsys):
    """The DAG runs a plug-in stage (entry point ``posttrain.stages``); the pipeline's
    components are the built-in stages only, and compiled it silently left the plug-in out."""
    from components.core import stages
    from components.core.stages import BUILTIN, StageSpec, _splice
    from pipelines import post_training_iteration as pti

    dedup = StageSpec("dedup", "components.validation.stage", upstream=("reward",), before=("validation",))
    monkeypatch.setattr(pti, "registered", lambda: tuple(_splice(list(BUILTIN), dedup)))
    with pytest.raises(SystemExit) as exit_:
        main(["--output", str(tmp_path / "p.yaml")])
    assert exit_.value.code == 2
    assert ("error: entry point posttrain.stages='dedup': the Kubeflow pipeline runs only the built-in stages "
            "['bootstrap', 'taskgen', 'rollout', 'sandbox', 'reward', 'validation', 'trainer', 'evaluation'], so it "
            "would skip these plug-in stages; fix: run this pipeline with the Airflow DAG") in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()
    assert stages.registered() == BUILTIN  # the real registry: nothing plugged in here


@pytest.mark.parametrize(("args", "needle"), [
    (["--image-prefix", "registry.example.com/ml"], "--image-prefix='registry.example.com/ml': not a registry path ending in '/'"),
    (["--image-prefix", "UPPER CASE/"], "--image-prefix='UPPER CASE/': not a registry path"),
    (["--output", "/nonexistent/dir/x.yaml"], "--output='/nonexistent/dir/x.yaml': its folder does not exist"),
    (["--output", "/dev/null"], "--output='/dev/null': not a .yaml file"),  # kfp would have replaced the device
])
def test_a_bad_image_prefix_or_output_is_refused_before_compiling(args, needle, tmp_path, capsys):
    """Before, a prefix without its '/' wrote 'registry.example.com/mlposttrain-bootstrap'
    into every step, and a missing folder was kfp's FileNotFoundError traceback."""
    with pytest.raises(SystemExit) as exit_:
        main(["--output", str(tmp_path / "p.yaml"), *args])
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_is_a_folder_is_refused(tmp_path, capsys):
    """Before: IsADirectoryError's traceback, exit 1."""
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(SystemExit) as exit_:
        main(["--output", str(tmp_path / "d.yaml")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--output={str(tmp_path / 'd.yaml')!r}: is a folder; name the file to write in it" in err
    assert "Traceback" not in err and list((tmp_path / "d.yaml").iterdir()) == []


def test_the_yaml_is_renamed_onto_the_output_whole(tmp_path, monkeypatch, capsys):
    """kfp opens the target with 'w' and writes into it: an interrupted compile of the
    default output left the checked-in YAML truncated. Now kfp writes a temporary file in
    the same folder, which replaces the output (os.replace) only once complete."""
    from kfp import compiler

    out = tmp_path / "p.yaml"
    out.write_text("the previous pipeline\n")
    out.chmod(0o640)
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (replaced.append((Path(src), Path(dst))), real_replace(src, dst)))
    assert main(["--output", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    [(src, dst)] = replaced
    assert src.parent == dst.parent == tmp_path and dst == out and src.suffix == ".yaml" and not src.exists()
    assert _load(out) == _load(COMPILED) and oct(out.stat().st_mode & 0o777) == oct(0o640)  # mode kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]

    def interrupted(self, pipeline_func, package_path, **kwargs):
        Path(package_path).write_text("half a pipel")
        raise KeyboardInterrupt

    monkeypatch.setattr(compiler.Compiler, "compile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["--output", str(out)])
    assert _load(out) == _load(COMPILED)  # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]  # no temporary file left


def test_a_new_output_gets_the_umask_mode(tmp_path):
    """mkstemp makes its file 0600; the YAML gets what open() would have given it."""
    umask = os.umask(0o027)
    try:
        path = compile_pipeline(tmp_path / "new.yaml")
    finally:
        os.umask(umask)
    assert oct(path.stat().st_mode & 0o777) == oct(0o640)


def test_the_docstring_says_kfp_retries_a_timed_out_stage():
    """The DAG fails a stage that ran past its time limit at once (dags/wiring.py); KFP's
    retry policy retries it like any failure (a pod past activeDeadlineSeconds), up to
    three limits. The module docstring lists the differences from the DAG: this one too."""
    from pipelines import post_training_iteration as pti

    doc = " ".join(pti.__doc__.split())
    assert "a stage that ran past its time limit" in doc and "activeDeadlineSeconds" in doc
    assert "up to three limits in all before the run fails" in doc and "The DAG fails a timed-out task at once" in doc


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You may be attemping to run a task:RuntimeWarning")  # by design: no containers
def test_local_run_of_the_tiny_recipe(tmp_path, monkeypatch, capsys):
    """``posttrain kfp-local``: one iteration of the pipeline under kfp.local, whose output
    (printed by kfp.local) is the evaluation manifest's digest."""
    from mlflow.tracking import MlflowClient

    from components.cli import main

    home, store = tmp_path / "home", tmp_path / "store"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSTTRAIN_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("POSTTRAIN_RUN_ROOT", raising=False)

    # What a failed or killed earlier run on this home leaves: iteration 1 leased to the home
    # (``local:<home>``). Before, each kfp.local run leased its iteration as ``kfp:<job id>``, so
    # a rerun met that lease for its 6 hours; now the pipeline's holder is the home's.
    from components.core.planner import plan
    from components.core.recipe import load_recipe
    from components.core.storage import Store

    assert plan(Store(str(store)), load_recipe(str(TINY)), f"local:{home}") == 1
    assert main(["kfp-local", "--recipe", str(TINY), "--run-root", str(store), "--iterations", "1"]) == 0

    iteration = store / "tiny" / "iter-000001"
    evaluation = json.loads((iteration / "evaluation" / "_MANIFEST.json").read_text())
    assert evaluation["stage"] == "evaluation" and evaluation["iteration"] == 1
    out = capsys.readouterr()
    assert evaluation["content_digest"] in out.out + out.err  # the pipeline's output: the evaluation manifest digest
    assert (home / "kfp").is_dir()  # kfp.local's pipeline root is in the home
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
    assert sorted(p.name for p in (store / "tiny" / "_leases").iterdir()) == ["iter-000001", "writer"]  # planned, leased
    assert parent.data.tags["posttrain.iteration"] == "1"
    assert parent.data.tags["posttrain.orchestrator_run_id"] != ""  # the KFP job id reached MLflow


@pytest.mark.parametrize(("recipe", "needle"), [
    ("pipeline: tiny\nrollout: {group_size: 1}\n", "rollout.group_size=1: Input should be greater than or equal to 2"),
    ("pipeline: tiny\ntaskgen: {task_file: missing.jsonl}\n", "taskgen.task_file='missing.jsonl'"),
])
def test_kfp_local_refuses_a_bad_recipe_before_any_task(recipe, needle, tmp_path, monkeypatch, capsys):
    """Before, a bad recipe went into the pipeline as is: KFP retried its first task's
    UserError with backoff, 13 tracebacks over about 2 minutes."""
    from components.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "r.yaml").write_text(recipe)
    assert main(["kfp-local", "--recipe", "r.yaml", "--run-root", str(tmp_path / "store")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("posttrain: error: ") and needle in lines[0], lines
    assert not (tmp_path / "store").exists() and not (tmp_path / "home" / "kfp").exists()


@pytest.mark.filterwarnings("ignore:You may be attemping to run a task:RuntimeWarning")  # by design: no containers
def test_a_bad_recipe_fails_the_plan_task_once(tmp_path, monkeypatch, capfd):
    """The pipeline run straight under kfp.local, as on a cluster (no ``posttrain
    kfp-local`` checks first): ``plan`` meets the bad recipe, is not retried (it was twice,
    after 10 s and 20 s), no other task starts, and the run ends with the recipe's line."""
    from components.core.errors import UserError
    from pipelines import local

    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "home"))
    (tmp_path / "bad.yaml").write_text("pipeline: tiny\nrollout: {group_size: 1}\n")
    local.prepare(tmp_path / "home", 1)
    with pytest.raises(UserError) as err:
        local.run_iteration(str(tmp_path / "bad.yaml"), str(tmp_path / "store"), f"local:{tmp_path / 'home'}")
    assert err.value.line().startswith(f"{tmp_path / 'bad.yaml'}: rollout.group_size=1: Input should be greater")
    out = re.sub(r"\x1b\[[0-9;]*m", "", "".join(capfd.readouterr()))
    assert re.findall(r"Executing task '([\w-]+)'", out) == ["plan", "hand-back"]  # the exit task runs after it
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You may be attemping to run a task:RuntimeWarning")  # by design: no containers
def test_kfp_local_ends_with_a_tasks_user_error_and_exit_2(tmp_path, monkeypatch, capsys):
    """A mistake only a stage can see (a task file whose rows are all eval-suite tasks,
    which taskgen skips): once KFP's retries are spent, ``posttrain kfp-local`` ends with
    the task's line and exit 2, as ``posttrain run`` does (it ended with exit 1)."""
    import yaml

    from components.cli import main
    from tests.dags.test_failures import eval_suite_as_task_file

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("POSTTRAIN_RUN_ROOT", raising=False)
    tasks = eval_suite_as_task_file(tmp_path)
    recipe = yaml.safe_load(TINY.read_text())
    recipe["taskgen"]["task_file"] = str(tasks)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(recipe))

    assert main(["kfp-local", "--recipe", "bad.yaml", "--run-root", str(tmp_path / "store")]) == 2
    assert "POSTTRAIN_KFP_USER_ERROR" not in os.environ  # set for the pipeline's tasks only
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"posttrain: error: taskgen.task_file='{tasks}': has no train tasks for the weighted domains "
        "['arithmetic', 'code']; fix: add tasks of those domains (rows marked split 'eval' and tasks equal to eval "
        "tasks are skipped) or change the weights")


@pytest.mark.slow
def test_sigterm_to_kfp_local_alone_stops_the_task_and_a_rerun_resumes(tmp_path):
    """SIGTERM to ``posttrain kfp-local`` alone (not its process group) reaches the task
    subprocess kfp.local waits for: exit 143, the stage's MLflow run KILLED, no manifest, no
    process left. Before, the command waited for the task's stage to finish, however long."""
    import signal

    from mlflow.tracking import MlflowClient

    from tests.dags.test_stagehost import alive, children, end, start_at_failpoint
    from tests.fixtures.runs import TINY as TINY_RECIPE
    from tests.fixtures.runs import cli_env, run_posttrain

    proc, seen, home = start_at_failpoint(tmp_path, "kfp-local")
    try:
        tasks = children(proc.pid)
        assert len(tasks) == 1, f"children of posttrain kfp-local: {tasks}"
        proc.send_signal(signal.SIGTERM)  # the parent only
        rest, _ = proc.communicate(timeout=120)
    finally:
        end(proc)
    assert proc.returncode == 143, "".join(seen) + rest
    assert rest.splitlines()[-1] == "posttrain: stopped by SIGTERM; run the same command again to resume"
    assert not any(alive(pid) for pid in tasks)
    c = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name("tiny").experiment_id], "attributes.run_name = 'bootstrap'")
    assert [r.info.status for r in runs] == ["KILLED"]
    assert not list((home / "store" / "tiny").glob("bootstrap/_MANIFEST.json"))

    again = run_posttrain(["kfp-local", "--recipe", str(TINY_RECIPE)], tmp_path, cli_env(home))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert (home / "store" / "tiny" / "iter-000001" / "evaluation" / "_MANIFEST.json").exists()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You may be attemping to run a task:RuntimeWarning")  # by design: no containers
def test_a_failed_run_hands_its_lease_back(tmp_path, monkeypatch):
    """The pipeline run straight under kfp.local, as on a cluster: a stage fails after
    ``plan`` leased the iteration to ``kfp:<job id>``. The exit task ends the iteration's
    MLflow run FAILED and hands the lease back, so the next run (here: another holder)
    plans iteration 1 at once; before, it met a live lease for 6 hours (``LeaseHeld``)."""
    import kfp.local
    import yaml

    from components.core import lease
    from components.core.planner import plan as plan_iteration
    from components.core.recipe import load_recipe
    from components.core.storage import Store
    from pipelines import local
    from pipelines.post_training_iteration import post_training_iteration
    from tests.dags.test_failures import eval_suite_as_task_file

    home, store = tmp_path / "home", Store(str(tmp_path / "store"))
    monkeypatch.setenv("POSTTRAIN_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # plan's checks pass (every row is valid), taskgen fails (each row is an eval-suite task)
    data = yaml.safe_load(TINY.read_text())
    data["taskgen"]["task_file"] = str(eval_suite_as_task_file(tmp_path))
    recipe = tmp_path / "notasks.yaml"
    recipe.write_text(yaml.safe_dump(data))
    local.prepare(home, 1)
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(home / "kfp"),
                   raise_on_error=False)
    post_training_iteration(recipe=str(recipe), run_root=store.uri, holder="")
    assert store.exists("tiny/bootstrap/_MANIFEST.json") and not store.exists("tiny/iter-000001/taskgen/_MANIFEST.json")
    leased = lease.current(store, "tiny", 1)
    assert leased is not None and leased.holder == "", leased  # handed back (the released record has no holder)
    assert plan_iteration(store, load_recipe(str(recipe)), "local:elsewhere") == 1


@pytest.mark.filterwarnings("ignore:You may be attemping to run a task:RuntimeWarning")  # by design: no containers
def test_a_missing_task_file_fails_the_plan_task_once_and_leases_nothing(tmp_path, monkeypatch, capfd):
    """On a cluster (the pipeline run straight, no ``posttrain kfp-local`` checks first),
    ``plan`` made only the recipe's and the store's checks: a missing task file was leased
    an iteration, bootstrapped, and failed at taskgen, retried. Now ``plan`` makes the
    DAG's plan task's checks (``check_before_run``): one line, no retry, no run root."""
    from components.core.errors import UserError
    from pipelines import local

    home, missing = tmp_path / "home", tmp_path / "nowhere" / "tasks.jsonl"
    monkeypatch.setenv("POSTTRAIN_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "r.yaml").write_text(TINY.read_text().replace("taskgen: {", f"taskgen: {{task_file: '{missing}', "))
    local.prepare(home, 1)
    with pytest.raises(UserError) as err:
        local.run_iteration(str(tmp_path / "r.yaml"), str(tmp_path / "store"), "")
    assert err.value.line() == (f"taskgen.task_file='{missing}': no such file; fix: pass an existing .parquet, .jsonl "
                                "or .json file (local path, file:// or s3:// URI)")
    out = re.sub(r"\x1b\[[0-9;]*m", "", "".join(capfd.readouterr()))
    assert re.findall(r"Executing task '([\w-]+)'", out) == ["plan", "hand-back"]
    assert not (tmp_path / "store").exists()  # nothing leased, no run root made


def test_plan_waits_out_an_iteration_another_run_holds(tmp_path, monkeypatch, capsys):
    """A run that finds its iteration leased by another waits (10 s, 20 s, 40 s, as the
    DAG's plan task's retries) and takes it once that run hands it back; it failed at once.
    ``plan`` called as its component calls it, with the waits recorded (no sleeping)."""
    from components.core import errors, lease
    from components.core.planner import plan as plan_iteration
    from components.core.recipe import load_recipe
    from components.core.storage import Store
    from pipelines.post_training_iteration import plan

    home, store = tmp_path / "home", Store(str(tmp_path / "store"))
    monkeypatch.setenv("POSTTRAIN_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("POSTTRAIN_RETRY_DELAY_S", raising=False)
    assert plan_iteration(store, load_recipe(str(TINY)), "local:elsewhere") == 1
    waits: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:  # the other run ends during the second wait
        if threading.current_thread() is not threading.main_thread():
            return real_sleep(seconds)  # another test's thread still running in this process
        waits.append(seconds)
        if len(waits) == 2:
            assert lease.release(store, "tiny", 1, "local:elsewhere")

    monkeypatch.setattr(errors.time, "sleep", sleep)
    assert plan(str(TINY), store.uri, "job-1", "") == 1
    assert waits == [10, 20]
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 2 and all(line.startswith("plan: iteration 1 of pipeline 'tiny' is held by 'local:elsewhere' "
                                                  "(lease expires in ") for line in said), said
    assert said[0].endswith("(attempt 1 of 4; again in 10 s)") and said[1].endswith("(attempt 2 of 4; again in 20 s)")
    assert lease.current(store, "tiny", 1).holder == "kfp:job-1"


@pytest.mark.filterwarnings("ignore:You may be attemping to run a task:RuntimeWarning")  # by design: no containers
def test_a_held_iteration_fails_the_plan_task_after_its_waits(tmp_path, monkeypatch, capfd):
    """Under kfp.local, as on a cluster: the lease stays held, ``plan`` tries 4 times
    (``POSTTRAIN_RETRY_DELAY_S`` shortens the waits) and fails the run naming the holder."""
    import kfp.local

    from components.core import lease
    from components.core.planner import plan as plan_iteration
    from components.core.recipe import load_recipe
    from components.core.storage import Store
    from pipelines import local
    from pipelines.post_training_iteration import post_training_iteration

    home, store = tmp_path / "home", Store(str(tmp_path / "store"))
    monkeypatch.setenv("POSTTRAIN_HOME", str(home))
    monkeypatch.setenv("POSTTRAIN_RETRY_DELAY_S", "0.01")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert plan_iteration(store, load_recipe(str(TINY)), "local:elsewhere") == 1
    local.prepare(home, 1)
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(home / "kfp"),
                   raise_on_error=False)
    post_training_iteration(recipe=str(TINY), run_root=store.uri, holder="")
    out = re.sub(r"\x1b\[[0-9;]*m", "", "".join(capfd.readouterr()))
    assert re.findall(r"Executing task '([\w-]+)'", out) == ["plan", "hand-back"]
    waits = re.findall(r"plan: iteration 1 of pipeline 'tiny' is held by 'local:elsewhere' .*"
                       r"\(attempt (\d) of 4; again in ([\d.]+) s\)", out)
    assert waits == [("1", "0.01"), ("2", "0.02"), ("3", "0.04")]
    assert "LeaseHeld: iteration 1 of pipeline 'tiny' is held by 'local:elsewhere'" in out
    assert lease.current(store, "tiny", 1).holder == "local:elsewhere"  # still the other run's


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You may be attemping to run a task:RuntimeWarning")  # by design: no containers
def test_a_resubmitted_run_ends_its_iteration_run_finished(tmp_path, monkeypatch):
    """A run failed after taskgen (its exit task ended the iteration's MLflow run FAILED);
    the resubmitted run resumed the iteration from the cache and finished it, but the
    iteration's run stayed FAILED: the KFP ``plan`` did not set it RUNNING again, as the
    DAG's plan task does, and a cache-hit taskgen does not either."""
    import kfp.local
    from mlflow.tracking import MlflowClient

    from components.core.storage import Store
    from pipelines import local
    from pipelines.post_training_iteration import post_training_iteration

    home, store = tmp_path / "home", Store(str(tmp_path / "store"))
    monkeypatch.setenv("POSTTRAIN_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    bad = tmp_path / "badlora.yaml"  # only the trainer sees the mistake: every stage before it runs and is cached
    bad.write_text(TINY.read_text().replace("trainer: {", "trainer: {lora: {rank: 4, target_modules: [no_such_proj]}, "))
    local.prepare(home, 1)
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(home / "kfp"),
                   raise_on_error=False)
    with local.process_state_restored():  # kfp.local's print wrapper must not outlive the run
        post_training_iteration(recipe=str(bad), run_root=store.uri, holder="")
    assert store.exists("tiny/iter-000001/validation/_MANIFEST.json")
    assert not store.exists("tiny/iter-000001/trainer/_MANIFEST.json")
    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny").experiment_id
    [parent] = client.search_runs([experiment], "tags.`posttrain.stage` = 'iteration'")
    assert parent.info.status == "FAILED"
    taskgen = store.read_bytes("tiny/iter-000001/taskgen/_MANIFEST.json")

    with local.process_state_restored():
        post_training_iteration(recipe=str(TINY), run_root=store.uri, holder="")  # the recipe fixed, resubmitted
    assert store.exists("tiny/iter-000001/evaluation/_MANIFEST.json")
    assert store.read_bytes("tiny/iter-000001/taskgen/_MANIFEST.json") == taskgen  # a cache hit
    [again] = client.search_runs([experiment], "tags.`posttrain.stage` = 'iteration'")
    assert again.info.run_id == parent.info.run_id and again.info.status == "FINISHED"  # reopened, then finished
    assert client.search_runs([experiment], "attributes.status = 'RUNNING'") == []


def test_a_run_puts_back_the_print_kfp_local_wrapped(tmp_path, monkeypatch, capsys):
    """kfp.local wraps ``builtins.print`` per task (``indented_print``: spaces before every
    print, on stdout even for ``file=sys.stderr``), from several threads at once under a
    ParallelFor, and a wrap restored out of order stays: every later print of the process
    (an in-process test run's, ``posttrain kfp-local``'s own) began with 4 spaces per leaked
    wrap (124 were seen). The leak is made here as that race leaves it."""
    import builtins
    import sys

    import pipelines.post_training_iteration as pti
    from pipelines import local

    original = builtins.print
    monkeypatch.setattr(builtins, "print", original)  # put back after the test even if the run does not

    def leaks_a_wrap(**_: str) -> None:
        wrapped = builtins.print

        def indented(*args, **kwargs):
            wrapped("    ", end="")
            return wrapped(*args, **kwargs)

        builtins.print = indented  # never put back

    monkeypatch.setattr(pti, "post_training_iteration", leaks_a_wrap)
    local.prepare(tmp_path / "home", 1)
    assert local.run_iteration(str(TINY), str(tmp_path / "store"), "") == "success"
    assert builtins.print is original
    capsys.readouterr()
    print("posttrain: error: a line", file=sys.stderr)
    assert capsys.readouterr() == ("", "posttrain: error: a line\n")


def test_process_state_restored_puts_back_print_and_the_root_logger() -> None:
    """What kfp.local's task threads leave behind (``indented_print``, a handler of its own)
    is undone around a run, even one that raises."""
    import builtins
    import logging

    from pipelines import local

    printer, root = builtins.print, logging.getLogger()
    handlers, level = root.handlers[:], root.level
    with pytest.raises(RuntimeError), local.process_state_restored():
        builtins.print = lambda *a, **k: None
        root.addHandler(logging.NullHandler())
        root.setLevel(logging.CRITICAL)
        raise RuntimeError("a task failed")
    assert builtins.print is printer and root.handlers == handlers and root.level == level
