"""The docker and kubernetes modes' stage tasks, without an engine or a cluster: what a
failed stage container or pod leaves for ``posttrain run`` (``dags.wiring.FINAL_ERRORS``),
and which folders a stage container gets mounted.

The docker mode's ``StageContainer`` runs here against a stand-in for docker-py's
``APIClient`` that answers as an engine does for a container that printed some lines and
exited with a given status (the real engine's behaviour is in ``test_docker_mode.py``,
which needs podman and the stage images); the kubernetes mode's ``StagePod`` against a
finished pod object, as in ``test_kubernetes_mode.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from components.core.errors import DataQualityError, UserError
from components.core.stages import resources, spec

RECIPE_LINE = ("--recipe='/nonexistent/recipe.yaml': no such recipe file; fix: pass a YAML file such as "
               "recipes/demo.yaml")
GATE_LINE = "validation failed for iteration 1 (tiny): 3 of 8 rows have an empty completion"


class FakeEngine:
    """docker-py's ``APIClient`` as the DockerOperator uses it: one container, which prints
    ``output`` and exits ``status``; the host config and container asked for are kept."""

    def __init__(self, output: str, status: int) -> None:
        self.output, self.status = output, status
        self.host_config: dict = {}
        self.container: dict = {}

    def images(self, name: str) -> list[dict]:
        return [{"Id": name}]  # present: no pull

    def create_host_config(self, **kwargs) -> dict:
        self.host_config = kwargs
        return kwargs

    def create_container(self, **kwargs) -> dict:
        self.container = kwargs
        return {"Id": "c0ffee"}

    def attach(self, **kwargs):
        return iter([self.output.encode()])

    def start(self, container: str) -> None:
        pass

    def wait(self, container: str) -> dict:
        return {"StatusCode": self.status, "Error": None}

    def remove_container(self, container: str, force: bool = False) -> None:
        pass


@pytest.fixture
def final_errors(monkeypatch) -> list:
    from dags import wiring

    monkeypatch.setattr(wiring, "FINAL_ERRORS", [])  # as at the start of an iteration of `posttrain run`
    return wiring.FINAL_ERRORS


def _container(monkeypatch, tmp_path: Path, engine: FakeEngine, run_root: str, parsed_root: str | None = None):
    """The taskgen task's operator as the DAG makes it (``POSTTRAIN_RUN_ROOT`` read when it
    is made), with ``run_root`` as its ``--run-root`` argument and ``engine`` as its engine."""
    from dags.execution import docker as docker_mode

    monkeypatch.setenv("POSTTRAIN_RUN_ROOT", parsed_root or "s3://posttrain-nowhere/runs")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no.sock")
    docker_mode.container_flags.cache_clear()
    cls, kwargs = docker_mode.operator(spec("taskgen"), resources("taskgen"))
    args = ["--recipe", "s3://posttrain-nowhere/runs/recipes/r.yaml", "--run-root", run_root, "--iteration", "1",
            "--orchestrator-run-id", "manual__1"]
    op = cls(task_id="taskgen", command=args, **kwargs)
    op.__dict__["hook"] = SimpleNamespace(api_client=engine)  # DockerOperator.hook is a cached property
    return op


def test_a_container_that_exits_2_leaves_its_user_error_for_posttrain_run(monkeypatch, tmp_path, final_errors):
    """Before, the task failed at once but FINAL_ERRORS stayed empty: ``posttrain run`` in
    docker mode said "run ended failed" and exited 1, where the in-process run exits 2."""
    from airflow.sdk.exceptions import AirflowFailException

    engine = FakeEngine(f"loading the recipe\nposttrain: error: {RECIPE_LINE}\n", 2)
    op = _container(monkeypatch, tmp_path, engine, "s3://posttrain-nowhere/runs")
    with pytest.raises(AirflowFailException) as failed:
        op.execute({})
    assert str(failed.value) == f"stage container exited 2: posttrain: error: {RECIPE_LINE}"
    assert len(final_errors) == 1 and type(final_errors[0]) is UserError
    error = final_errors[0]
    assert (error.field, error.value, error.problem, error.fix) == (
        "--recipe", "/nonexistent/recipe.yaml", "no such recipe file", "pass a YAML file such as recipes/demo.yaml")
    assert error.line() == RECIPE_LINE


def test_a_container_that_exits_3_leaves_its_failed_gate(monkeypatch, tmp_path, final_errors):
    from airflow.sdk.exceptions import AirflowFailException

    engine = FakeEngine(f"posttrain: {GATE_LINE}\n", 3)
    op = _container(monkeypatch, tmp_path, engine, "s3://posttrain-nowhere/runs")
    with pytest.raises(AirflowFailException) as failed:
        op.execute({})
    assert str(failed.value) == f"stage container exited 3: posttrain: {GATE_LINE}"
    assert [(type(e), str(e), e.exit_code) for e in final_errors] == [(DataQualityError, GATE_LINE, 3)]


def test_an_exit_2_without_a_user_errors_line_still_ends_posttrain_run_with_2(monkeypatch, tmp_path, final_errors):
    """argparse's usage error exits 2 too, with its own line: a UserError naming the stage
    and carrying that line."""
    from airflow.sdk.exceptions import AirflowFailException

    line = "posttrain stage: error: argument --iteration: invalid int value: 'x'"
    op = _container(monkeypatch, tmp_path, FakeEngine(line, 2), "s3://posttrain-nowhere/runs")
    with pytest.raises(AirflowFailException):
        op.execute({})
    assert [e.line() for e in final_errors] == [
        f"taskgen={line!r}: its container exited 2 (a user's mistake); fix: see the task's log for the stage's output"]


def test_an_outage_in_a_container_leaves_no_final_error(monkeypatch, tmp_path, final_errors):
    from airflow.providers.docker.exceptions import DockerContainerFailedException

    line = "posttrain: unreachable: store unreachable at 's3://b': EndpointConnectionError: x; retry once it is back"
    op = _container(monkeypatch, tmp_path, FakeEngine(line, 1), "s3://posttrain-nowhere/runs")
    with pytest.raises(DockerContainerFailedException):
        op.execute({})
    assert final_errors == []


def _mounts(engine: FakeEngine) -> list[tuple[str, str, str]]:
    return sorted((m["Source"], m["Target"], m["Type"]) for m in engine.host_config["mounts"])


def test_a_runs_own_local_run_root_is_mounted_into_its_container(monkeypatch, tmp_path, final_errors):
    """The DAG mounted only POSTTRAIN_RUN_ROOT as read at its parse; a run given another
    local run root (run conf, ``posttrain run --run-root``) passed that to the container
    unmounted, and every stage exited 2 on a run root it could not see."""
    parsed, own = tmp_path / "parsed", tmp_path / "own"
    engine = FakeEngine("done\n", 0)
    op = _container(monkeypatch, tmp_path, engine, f"file://{own}", parsed_root=str(parsed))
    op.execute({})
    assert _mounts(engine) == [(str(own), str(own), "bind"), (str(parsed), str(parsed), "bind")]
    assert own.is_dir()
    assert engine.container["command"][3] == f"file://{own}"


@pytest.mark.parametrize("run_root", ["parsed", "parsed/sub", "s3://posttrain-nowhere/runs"])
def test_a_run_root_already_mounted_or_in_a_store_adds_no_mount(run_root, monkeypatch, tmp_path, final_errors):
    parsed = tmp_path / "parsed"
    engine = FakeEngine("done\n", 0)
    given = run_root if "://" in run_root else f"file://{tmp_path / run_root}"
    op = _container(monkeypatch, tmp_path, engine, given, parsed_root=str(parsed))
    op.execute({})
    assert _mounts(engine) == [(str(parsed), str(parsed), "bind")]


def _pod_that_printed(code: int, message: str):
    from kubernetes.client import models as k8s

    terminated = k8s.V1ContainerStateTerminated(exit_code=code, message=message)
    status = k8s.V1PodStatus(phase="Failed", container_statuses=[k8s.V1ContainerStatus(
        name="base", image="i", image_id="", ready=False, restart_count=0, state=k8s.V1ContainerState(terminated=terminated))])
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="posttrain-taskgen-x", namespace="posttrain"), status=status)


@pytest.mark.parametrize("code", [2, 3])
def test_a_pod_that_exits_2_or_3_leaves_its_error_for_posttrain_run(code, final_errors):
    """The kubernetes mode: the same, from the pod's termination message (the log's tail).
    Its AirflowFailException ended with the last line of the pod's spec the provider
    appends to its failure, not the stage's."""
    from airflow.sdk.exceptions import AirflowFailException

    from dags.execution import kubernetes as mode

    line = f"posttrain: error: {RECIPE_LINE}" if code == 2 else f"posttrain: {GATE_LINE}"
    cls, kwargs = mode.operator(spec("taskgen"), resources("taskgen"))
    op = cls(task_id="taskgen", arguments=["--iteration", "1"], **kwargs)
    for name in ("patch_already_checked", "process_pod_deletion", "_read_pod_events"):
        setattr(op, name, lambda *a, **k: None)  # no API server here
    op.is_istio_enabled = lambda *a, **k: False
    pod = _pod_that_printed(code, f"loading\n{line}\n")
    with pytest.raises(AirflowFailException) as failed:
        op.cleanup(pod, pod)
    assert str(failed.value) == f"stage pod exited {code}: {line}"
    assert len(final_errors) == 1
    if code == 2:
        assert type(final_errors[0]) is UserError and final_errors[0].line() == RECIPE_LINE
    else:
        assert type(final_errors[0]) is DataQualityError and str(final_errors[0]) == GATE_LINE


TIMEOUT_LINE = ("timeouts.taskgen=7200: the stage ran past its time limit, and a retry would run as long again; fix: "
                "raise timeouts.taskgen in the recipe (seconds), or give the stage less work")


class TimingOut(FakeEngine):
    """A container still running when the task's time limit strikes (Airflow raises
    AirflowTaskTimeout in the task's thread while the operator waits for it)."""

    def __init__(self) -> None:
        super().__init__("working\n", 0)
        self.stopped: list[str] = []
        self.grace: int | None = None

    def wait(self, container: str) -> dict:
        from airflow.sdk.exceptions import AirflowTaskTimeout

        raise AirflowTaskTimeout("Timeout")

    def stop(self, container: str, timeout: int | None = None) -> None:
        self.stopped.append(container)
        self.grace = timeout


def test_a_container_past_its_time_limit_is_stopped_and_fails_unretried(monkeypatch, tmp_path, final_errors):
    """Before, a timed-out container was retried like an outage: three more runs of the same
    limit (4 x 6 h for a trainer)."""
    from datetime import timedelta

    from airflow.sdk.exceptions import AirflowFailException

    engine = TimingOut()
    op = _container(monkeypatch, tmp_path, engine, "s3://posttrain-nowhere/runs")
    op.__dict__["hook"] = SimpleNamespace(api_client=engine, client_created=True)  # the client made the container
    op.execution_timeout = timedelta(hours=2)
    with pytest.raises(AirflowFailException) as failed:
        op.execute({})
    assert str(failed.value) == TIMEOUT_LINE
    assert engine.stopped == ["c0ffee"]  # on_kill: Airflow calls it only for a timeout it sees itself
    assert engine.grace == 10  # SIGTERM first: podman's Docker API without a grace period SIGKILLs at once
    assert [e.line() for e in final_errors] == [TIMEOUT_LINE]


def test_a_pod_past_its_time_limit_is_deleted_and_fails_unretried(monkeypatch, final_errors):
    from datetime import timedelta

    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk.exceptions import AirflowFailException, AirflowTaskTimeout

    from dags.execution import kubernetes as mode

    def times_out(self, context):
        raise AirflowTaskTimeout("Timeout")

    killed: list[str] = []
    monkeypatch.setattr(KubernetesPodOperator, "execute", times_out)  # no API server here: the provider's part
    monkeypatch.setattr(KubernetesPodOperator, "on_kill", lambda self: killed.append(self.task_id))
    cls, kwargs = mode.operator(spec("taskgen"), resources("taskgen"))
    op = cls(task_id="taskgen", arguments=["--iteration", "1"], execution_timeout=timedelta(hours=2), **kwargs)
    with pytest.raises(AirflowFailException) as failed:
        op.execute({})
    assert str(failed.value) == TIMEOUT_LINE and killed == ["taskgen"]
    assert [e.line() for e in final_errors] == [TIMEOUT_LINE]
