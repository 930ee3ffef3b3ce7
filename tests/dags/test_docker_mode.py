"""The DAG in ``docker`` mode: one whole iteration of the tiny recipe with every stage in
its own container, started by Airflow's DockerOperator through podman's Docker-compatible
socket, against SeaweedFS and an MLflow server on loopback; compared with an in-process
run of the same recipe.

The images come from ``make images`` (the ``stage_images`` fixture builds them from the
Debian-made base, or reuses them when their inputs are unchanged). What must be equal:
every manifest (config digest, outputs byte for byte, facts, metrics; run roots and the
machine-measured columns aside), the registry's versions, and the eval table. The
sandbox stage inside its container must report bubblewrap isolation, not the weak
fallback. Slow: minutes (an image build when the sources changed).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from components import __version__
from components.core.storage import Store
from tests.fixtures.runs import (
    MEASURED,
    TINY,
    TINY_STAGES_PER_ITERATION,
    cli_env,
    manifests,
    registry_versions,
    registry_versions_at,
    run_posttrain,
)
from tests.fixtures.s3 import S3Server, unique_prefix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # a cold image build is part of the first test

VOLATILE_MANIFEST_KEYS = ("mlflow_run_id", "timings")  # a run's own ids and wall times
VOLATILE_INFO_KEYS = ("parent_run_id", "run_id")  # MLflow run ids, one set per tracking server
SANDBOX_VOLATILE = (*MEASURED, "isolation")  # measured per machine; isolation is checked on its own


def _env(server: S3Server, home: Path, root: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in cli_env(home, **extra).items() if not k.startswith("AWS_")}
    return {**env, **server.env(), "POSTTRAIN_RUN_ROOT": root}


def _normal(data: bytes, root: str) -> dict:
    """A manifest with its run root replaced by ``ROOT`` and the run's own ids dropped (and
    so the digests of its inputs' manifests, which cover those ids; each of those manifests
    is compared on its own)."""
    manifest = json.loads(data.decode().replace(root, "ROOT"))
    for key in (*VOLATILE_MANIFEST_KEYS, "content_digest"):
        manifest.pop(key, None)
    for key in VOLATILE_INFO_KEYS:
        manifest["info"].pop(key, None)
    for ref in manifest["inputs"].values():  # an upstream manifest's digest covers its MLflow run ids
        ref.pop("digest")
    manifest["metrics"] = {k: v for k, v in manifest["metrics"].items() if not k.endswith(("_s", "_s_mean", "_mb_max"))}
    return manifest


def _executions(store: Store, rel_manifest: str) -> tuple[list[dict], set[str]]:
    meta = json.loads(store.read_bytes(rel_manifest))["outputs"]["executions"]
    table = store.read_table(meta["path"])
    return table.drop_columns(list(SANDBOX_VOLATILE)).to_pylist(), set(table.column("isolation").to_pylist())


def _operators(home: Path) -> dict[str, tuple[str, str]]:
    db = sqlite3.connect(home / "airflow" / "airflow.db", timeout=30)
    try:
        rows = db.execute("select task_id || coalesce('#' || nullif(map_index, -1), ''), operator, state "
                          "from task_instance").fetchall()
    finally:
        db.close()
    return {task: (operator, state) for task, operator, state in rows}


@pytest.fixture(scope="module")
def both_runs(s3_server: S3Server, mlflow_server, podman_socket: str, stage_images, tmp_path_factory):
    """The tiny recipe's first iteration twice: in-process, then with every stage in a container."""
    tmp = tmp_path_factory.mktemp("docker-mode")
    inproc_root = f"s3://{s3_server.bucket}/{unique_prefix('inprocess')}"
    docker_root = f"s3://{s3_server.bucket}/{unique_prefix('docker')}"
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    inproc = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "1"], tmp / "a",
                           _env(s3_server, tmp / "a" / ".posttrain", inproc_root))
    assert inproc.returncode == 0, inproc.stdout[-3000:] + inproc.stderr[-3000:]
    docker = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "1"], tmp / "b",
                           _env(s3_server, tmp / "b" / ".posttrain", docker_root, POSTTRAIN_EXECUTION="docker",
                                DOCKER_HOST=podman_socket, POSTTRAIN_IMAGE_PREFIX="localhost/",
                                POSTTRAIN_IMAGE_TAG=__version__, MLFLOW_TRACKING_URI=mlflow_server.uri),
                           timeout=1800)
    assert docker.returncode == 0, docker.stdout[-5000:] + docker.stderr[-5000:]
    return {"inprocess": (tmp / "a" / ".posttrain", inproc_root), "docker": (tmp / "b" / ".posttrain", docker_root),
            "mlflow": mlflow_server.uri, "stdout": docker.stdout}


def test_every_stage_ran_in_its_own_container(both_runs) -> None:
    home, _ = both_runs["docker"]
    tasks = _operators(home)
    stages = {t: v for t, v in tasks.items() if t.split("#")[0] in
              ("bootstrap", "taskgen", "rollout", "sandbox", "reward", "validation", "trainer", "evaluation")}
    assert len(stages) == 1 + TINY_STAGES_PER_ITERATION  # bootstrap + the iteration's tasks, shards counted
    assert {v for v in stages.values()} == {("StageContainer", "success")}
    assert tasks["plan"] == ("_PythonDecoratedOperator", "success")


def test_containers_left_what_an_in_process_run_leaves(both_runs, s3_env) -> None:
    (_, inproc_root), (_, docker_root) = both_runs["inprocess"], both_runs["docker"]
    a, b = Store(inproc_root), Store(docker_root)
    found_a, found_b = manifests(a), manifests(b)
    assert sorted(found_a) == sorted(found_b) and len(found_a) == 1 + TINY_STAGES_PER_ITERATION
    for rel in found_a:
        left, right = _normal(found_a[rel], inproc_root), _normal(found_b[rel], docker_root)
        if "/sandbox/" in rel:  # the executions' file differs only in the measured columns and the isolation
            rows_a, _ = _executions(a, rel)
            rows_b, _ = _executions(b, rel)
            assert rows_a == rows_b, f"{rel}: executions differ"
            for m in (left, right):  # the file's bytes (and so its digest and size) carry those columns
                m["outputs"]["executions"].pop("sha256")
                m["outputs"]["executions"].pop("size", None)
        assert left == right, f"{rel} differs between the in-process and the container run"
    report_a = a.read_json("tiny/iter-000001/evaluation/report.json")
    report_b = b.read_json("tiny/iter-000001/evaluation/report.json")
    assert report_a["pass_rates"] == report_b["pass_rates"] and report_a["pass_rates"]  # the eval table
    assert (report_b["candidate"], report_b["baseline"]) == ("2", "1")


def test_registry_versions_match(both_runs) -> None:
    (home, inproc_root), (_, docker_root) = both_runs["inprocess"], both_runs["docker"]
    local = {v: src.replace(inproc_root, "ROOT") for v, src in registry_versions(home).items()}
    served = {v: src.replace(docker_root, "ROOT") for v, src in registry_versions_at(both_runs["mlflow"]).items()}
    assert served == local == {1: "ROOT/tiny/bootstrap/checkpoint", 2: "ROOT/tiny/iter-000001/trainer/checkpoint"}


def test_sandbox_in_its_container_is_not_weak(both_runs, s3_env) -> None:
    _, docker_root = both_runs["docker"]
    store = Store(docker_root)
    isolation: set[str] = set()
    for i in range(2):
        isolation |= _executions(store, f"tiny/iter-000001/sandbox/shard-{i:05d}-of-00002/_MANIFEST.json")[1]
    assert isolation and all(s.startswith("bwrap:user,pid,net") and "WEAK" not in s for s in isolation), isolation


def _taskgen_container(podman_socket: str, monkeypatch, recipe: str, **env: str):
    from components.core.stages import resources, spec
    from dags.execution import docker as docker_mode

    for name, value in {"DOCKER_HOST": podman_socket, "POSTTRAIN_IMAGE_PREFIX": "localhost/", "POSTTRAIN_IMAGE_TAG": __version__,
                        "POSTTRAIN_RUN_ROOT": "s3://posttrain-nowhere/runs", **env}.items():
        monkeypatch.setenv(name, value)
    docker_mode.container_flags.cache_clear()
    cls, kwargs = docker_mode.operator(spec("taskgen"), resources("taskgen"))
    args = ["--recipe", recipe, "--run-root", "s3://posttrain-nowhere/runs", "--iteration", "1"]
    return cls(task_id="taskgen", command=args, **kwargs)


def test_a_user_mistake_in_a_container_fails_at_once(podman_socket: str, stage_images, monkeypatch) -> None:
    """Exit 2 in the container (no such recipe file in the image): AirflowFailException, so
    Airflow does not retry it; the message is the stage's one line."""
    from airflow.sdk.exceptions import AirflowFailException

    from components.core.errors import UserError
    from dags import wiring

    monkeypatch.setattr(wiring, "FINAL_ERRORS", [])
    op = _taskgen_container(podman_socket, monkeypatch, "/nonexistent/recipe.yaml")
    with pytest.raises(AirflowFailException) as failed:
        op.execute({})
    assert str(failed.value) == ("stage container exited 2: posttrain: error: --recipe='/nonexistent/recipe.yaml': "
                                 "no such recipe file; fix: pass a YAML file such as recipes/demo.yaml")
    # and `posttrain run` ends with that line and exit 2, as in-process (it exited 1)
    assert [(type(e), e.line()) for e in wiring.FINAL_ERRORS] == [
        (UserError, "--recipe='/nonexistent/recipe.yaml': no such recipe file; fix: pass a YAML file such as "
                    "recipes/demo.yaml")]


def test_an_outage_in_a_container_is_left_to_the_retries(podman_socket: str, stage_images, monkeypatch) -> None:
    """Exit 1 (the store cannot be reached): the provider's own failure, which Airflow retries."""
    from airflow.providers.docker.exceptions import DockerContainerFailedException

    op = _taskgen_container(podman_socket, monkeypatch, "s3://posttrain-nowhere/runs/recipes/x.yaml",
                            AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s",
                            AWS_MAX_ATTEMPTS="1")
    with pytest.raises(DockerContainerFailedException) as failed:
        op.execute({})
    assert op.cli.status == 1
    assert failed.value.logs[-1].startswith("posttrain: unreachable: --recipe unreachable at "
                                            "'s3://posttrain-nowhere/runs/recipes/x.yaml': EndpointConnectionError")
