"""The DAG's execution modes, without a container engine: the switch, the docker mode's
operators as the DAG file builds them, the flags file they apply, and what a container
needs from the scheduler side (a recipe in the store, a run root it can use).

    pytest tests/dags/test_execution_modes.py

The whole iteration in containers is ``tests/dags/test_docker_mode.py`` (slow); the
kubernetes mode's pods are ``tests/dags/test_kubernetes_mode.py``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from components import __version__
from components.core.errors import UserError
from components.core.recipe import load_recipe, parse_recipe, publish_recipe
from components.core.stages import registered, resources
from dags.execution import docker as docker_mode
from dags.execution import mode, stage_arguments

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny.yaml"


def _parse_dag(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "dags" / "post_training_iteration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.iteration_dag


@pytest.fixture
def docker_env(monkeypatch):
    for name in ("POSTTRAIN_IMAGE_PREFIX", "POSTTRAIN_IMAGE_TAG", docker_mode.FLAGS_VAR, docker_mode.NETWORK_VAR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("POSTTRAIN_EXECUTION", "docker")
    monkeypatch.setenv("POSTTRAIN_SCHEDULE", "")
    monkeypatch.setenv("POSTTRAIN_RUN_ROOT", "s3://bucket/runs")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    docker_mode.container_flags.cache_clear()
    yield monkeypatch
    docker_mode.container_flags.cache_clear()


def test_the_mode_defaults_to_in_process_and_a_bad_value_names_the_choices(monkeypatch):
    monkeypatch.delenv("POSTTRAIN_EXECUTION", raising=False)
    assert mode() == "inprocess"
    monkeypatch.setenv("POSTTRAIN_EXECUTION", "Docker")
    assert mode() == "docker"
    monkeypatch.setenv("POSTTRAIN_EXECUTION", "docker ")  # was stripped without a word
    with pytest.raises(UserError, match="has white space around it"):
        mode()
    monkeypatch.setenv("POSTTRAIN_EXECUTION", "ecs")
    monkeypatch.setenv("POSTTRAIN_SCHEDULE", "")
    with pytest.raises(UserError) as info:  # a DAG import error of one line
        _parse_dag("ptI_bad_mode")
    assert info.value.line() == ("POSTTRAIN_EXECUTION='ecs': unknown execution mode; "
                                 "fix: use one of inprocess, docker, kubernetes (unset: inprocess)")


def test_the_flags_file_is_what_the_docker_mode_applies():
    flags = docker_mode.ContainerFlags((REPO / "containers" / "podman-run-flags").read_text())
    assert flags.runtime == "runc"
    assert flags.security_opt == ["seccomp=unconfined", "apparmor=unconfined", "unmask=ALL"]
    assert flags.ulimits == [("nofile", 1024, 1024), ("nproc", 1000, 1000)]
    assert docker_mode.ContainerFlags("--ulimit=nofile=64 # comment").ulimits == [("nofile", 64, 64)]
    with pytest.raises(UserError, match=r"^POSTTRAIN_CONTAINER_FLAGS='f': flag '--privileged' is not one the docker "
                                        r"mode applies; fix: use only"):
        docker_mode.ContainerFlags("--privileged true", "f")
    with pytest.raises(UserError, match=r"^POSTTRAIN_CONTAINER_FLAGS='f': flag '--runtime' has no value; "):
        docker_mode.ContainerFlags("--ulimit nofile=1 --runtime", "f")
    with pytest.raises(UserError, match=r"^POSTTRAIN_CONTAINER_FLAGS='f': --ulimit 'nofile=a:b' is not name=soft\[:hard\]; "):
        docker_mode.ContainerFlags("--ulimit nofile=a:b", "f")
    with pytest.raises(UserError, match=r"^POSTTRAIN_CONTAINER_FLAGS='f': not shell words \(No closing quotation\); "):
        docker_mode.ContainerFlags("--runtime 'runc", "f")
    for bad in ("nofile=\u00b2:\u00b2", "nofile=1:99999999999999999999", "nofile=-1"):  # "²" was a ValueError traceback
        with pytest.raises(UserError, match=r"is not name=soft\[:hard\]; fix: write e.g. --ulimit nofile=1024:1024$"):
            docker_mode.ContainerFlags(f"--ulimit {bad}", "f")
    with pytest.raises(UserError, match=r"^POSTTRAIN_CONTAINER_FLAGS='f': --ulimit 'nofile=2048:1024' has a soft limit "
                                        r"above its hard limit; "):
        docker_mode.ContainerFlags("--ulimit nofile=2048:1024", "f")


@pytest.mark.parametrize("network", ["no such\nnet", "a b", "-x", "n" * 256, "container:"])
def test_a_docker_network_no_container_can_join_is_refused_with_the_settings(network, monkeypatch):
    """Before, any text went to every stage container's start (never checked)."""
    from dags.execution import check_settings

    monkeypatch.setenv("POSTTRAIN_EXECUTION", "docker")
    monkeypatch.setenv("POSTTRAIN_IMAGE_PREFIX", "localhost/")
    monkeypatch.setenv(docker_mode.NETWORK_VAR, network)
    with pytest.raises(UserError) as info:
        check_settings()
    assert info.value.field == "POSTTRAIN_DOCKER_NETWORK" and info.value.value == network
    for good in ("host", "bridge", "posttrain_net-1.a", "container:sidecar"):
        monkeypatch.setenv(docker_mode.NETWORK_VAR, good)
        assert docker_mode.network_mode() == good


def test_the_dag_in_docker_mode_runs_every_stage_in_its_image(docker_env):
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    docker_env.setenv("POSTTRAIN_IMAGE_PREFIX", "localhost/")
    dag = _parse_dag("ptI_docker")
    for spec in registered():
        task = dag.get_task(spec.id)
        kwargs = task.partial_kwargs if isinstance(task, MappedOperator) else vars(task)
        assert isinstance(task, MappedOperator) == spec.sharded, spec.id
        assert (task.operator_class if spec.sharded else type(task)).__name__ == "StageContainer"
        assert kwargs["image"] == f"localhost/posttrain-{spec.id}:{__version__}"
        assert kwargs["security_opt"] == (["seccomp=unconfined", "apparmor=unconfined", "unmask=ALL"] if spec.sandboxed else [])
        assert [(u["Name"], u["Soft"], u["Hard"]) for u in kwargs["ulimits"]] == [("nofile", 1024, 1024), ("nproc", 1000, 1000)]
        assert kwargs["runtime"] == "runc" and kwargs["network_mode"] == "host"
        assert kwargs["environment"]["AWS_ACCESS_KEY_ID"] == "AKIDEXAMPLE"
        assert "AWS_SECRET_ACCESS_KEY" not in kwargs["environment"]  # a secret: private, never rendered
        private = kwargs["private_environment"] if spec.sharded else task._private_environment
        assert private["AWS_SECRET_ACCESS_KEY"] == "s3cr3t"
        assert "POSTTRAIN_EXECUTION" not in kwargs["environment"] and "POSTTRAIN_HOME" not in kwargs["environment"]
        assert kwargs["mounts"] == []  # the run root is on S3: nothing to mount
        assert f"{spec.id}_args" in task.upstream_task_ids
        assert kwargs["retries"] == 3 and kwargs["execution_timeout"].total_seconds() == spec.timeout_s
    assert dag.get_task("sandbox").partial_kwargs["pool"] == "posttrain_sandbox"
    assert "evaluation" in dag.get_task("announce_champion").upstream_task_ids


def test_a_uri_with_a_password_goes_as_private_environment(docker_env):
    """A tracking URI holding basic-auth credentials was rendered in the Airflow UI."""
    docker_env.setenv("MLFLOW_TRACKING_URI", "https://alice:pw0rd@mlflow.example:443")
    docker_env.setenv("POSTTRAIN_RUN_ROOT", "s3://bucket/runs")
    env, private = docker_mode.passed_environment()
    assert private["MLFLOW_TRACKING_URI"] == "https://alice:pw0rd@mlflow.example:443"
    assert private["AWS_SECRET_ACCESS_KEY"] == "s3cr3t" and "MLFLOW_TRACKING_URI" not in env
    assert env["AWS_ACCESS_KEY_ID"] == "AKIDEXAMPLE" and env["POSTTRAIN_RUN_ROOT"] == "s3://bucket/runs"


def test_a_local_run_root_is_mounted_at_the_same_path(docker_env, tmp_path):
    docker_env.setenv("POSTTRAIN_RUN_ROOT", str(tmp_path / "store"))
    _, kwargs = docker_mode.operator(registered()[1], resources(registered()[1].id))
    assert [(m["Source"], m["Target"], m["Type"]) for m in kwargs["mounts"]] == \
        [(str(tmp_path / "store"), str(tmp_path / "store"), "bind")]


def test_the_recipe_sets_a_stage_memory_limit(docker_env):
    recipe = parse_recipe({"pipeline": "x", "resources": {"trainer": {"memory": "3Gi"}}})
    _, kwargs = docker_mode.operator(registered()[6], resources("trainer", recipe))
    assert kwargs["mem_limit"] == 3 * 2**30
    _, default = docker_mode.operator(registered()[6], resources("trainer"))
    assert default["mem_limit"] == 32 * 2**30  # the registry's


def test_a_bad_flags_file_fails_the_parse_with_its_name(docker_env, tmp_path):
    docker_env.setenv(docker_mode.FLAGS_VAR, str(tmp_path / "missing"))
    with pytest.raises(UserError, match=r"^POSTTRAIN_CONTAINER_FLAGS='.*missing': no such file; "):
        _parse_dag("ptI_bad_flags")


def test_stage_arguments_put_the_shard_last():
    plan = {"recipe_uri": "s3://b/recipes/a.yaml", "run_root": "s3://b", "iteration": 4}
    assert stage_arguments(plan, "manual__1") == ["--recipe", "s3://b/recipes/a.yaml", "--run-root", "s3://b",
                                                  "--iteration", "4", "--orchestrator-run-id", "manual__1"]
    assert stage_arguments(plan, "manual__1", "1/2")[-2:] == ["--shard", "1/2"]


def test_a_published_recipe_is_content_addressed_and_loads_like_the_file(tmp_path):
    root = f"file://{tmp_path / 'store'}"
    uri = publish_recipe(TINY, root)
    assert uri.startswith(f"{root}/recipes/") and uri.endswith(".yaml")
    assert publish_recipe(TINY, root) == uri and publish_recipe(uri, root) == uri  # idempotent
    assert len(list((tmp_path / "store" / "recipes").iterdir())) == 1
    assert load_recipe(uri) == load_recipe(TINY)
    with pytest.raises(UserError, match="no such recipe file"):
        load_recipe(f"{root}/recipes/0000.yaml")


def test_inside_an_image_a_defaulted_run_root_is_one_line_and_exit_2(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "POSTTRAIN_IMAGE": "1", "POSTTRAIN_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "components.cli", "stage", "taskgen", "--recipe", str(TINY), "--iteration", "1"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "posttrain: error: --run-root='(unset)': inside an image the run root must be given, not defaulted to a local folder; "
        "fix: pass --run-root s3://bucket/prefix (or set POSTTRAIN_RUN_ROOT), or an absolute path to a mounted volume"]
    relative = subprocess.run([*cmd, "--run-root", "store"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert relative.returncode == 2 and "--run-root='store': a relative run root inside an image" in relative.stderr
