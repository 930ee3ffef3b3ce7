"""A stage container or pod cut short: past its time limit, told to stop (SIGTERM, Ctrl-C,
a lost writer lease under ``posttrain run``), or never started. Through the providers' own
code (``DockerOperator.execute``, ``KubernetesPodOperator.execute_sync`` with its cleanup in
``finally``), with only the engine's or the API server's answers stood in for:

- ``FakeEngine`` (docker-py's ``APIClient``): a container that runs until it is stopped or
  killed (or, at the latest, ends by itself after ``RUNS_AT_MOST_S``), and refuses to be
  removed without force while it runs (HTTP 500), as Docker and podman do;
- ``FakeCluster`` (the ``CoreV1Api`` calls the provider makes): a pod that stays Pending,
  runs until deleted, or has ended with an exit code.

The time limit is Airflow's own (``TimeoutPosix``, SIGALRM raising ``AirflowTaskTimeout``
where the operator waits, as the task runner sets it); the stop is a SIGTERM to this process
inside ``posttrain run``'s ``_signals_kept`` (``dags/local.py``). The same against podman's
socket and a real image is at the end (skipped without podman or the image; nothing is
built here).
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s
from kubernetes.client.exceptions import ApiException

from components.core import runner
from components.core.errors import UserError
from components.core.stages import resources, spec

TIMEOUT_LINE = ("timeouts.taskgen=7200: the stage ran past its time limit, and a retry would run as long again; fix: "
                "raise timeouts.taskgen in the recipe (seconds), or give the stage less work")
RUNS_AT_MOST_S = 8.0  # a fake container or pod nobody stops ends by itself (before the fixes, the tests waited for it)
ARGS = ["--recipe", "s3://posttrain-nowhere/runs/recipes/r.yaml", "--run-root", "s3://posttrain-nowhere/runs",
        "--iteration", "1", "--orchestrator-run-id", "manual__1"]


@pytest.fixture
def final_errors(monkeypatch) -> list:
    from dags import wiring

    monkeypatch.setattr(wiring, "FINAL_ERRORS", [])
    return wiring.FINAL_ERRORS


@pytest.fixture
def posttrain_run(monkeypatch):
    """Signals as ``posttrain run`` has them around ``dag.test()``: the CLI's handlers
    (``stop_on_sigterm(sigint=True)``), recorded between tasks (``_signals_kept``)."""
    from dags.local import _signals_kept

    monkeypatch.setattr(runner, "_stop_signals", [])
    before = {sig: signal.getsignal(sig) for sig in runner.STOP_SIGNALS}
    if not runner.stop_on_sigterm(sigint=True):
        pytest.skip("signal handlers can be installed in the main thread only")
    try:
        with _signals_kept():
            yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def sigterm_in(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.daemon = True
    timer.start()
    return timer


def time_limit(seconds: int):
    """The task runner's time limit: SIGALRM raises AirflowTaskTimeout where execute waits."""
    from airflow.sdk.execution_time.timeout import TimeoutPosix

    return TimeoutPosix(seconds)


# --- docker mode ------------------------------------------------------------------------


class FakeEngine:
    """docker-py's ``APIClient`` as the DockerOperator uses it, for one container that runs
    until stopped (SIGTERM: exit 143) or force-removed, or ends by itself (exit 0) after
    ``RUNS_AT_MOST_S``; removing it without force while it runs is the engine's HTTP 500."""

    def __init__(self, version: dict | None = None) -> None:
        self.host_config: dict = {}
        self.container: dict = {}
        self.created = self.stopped = self.removed = 0
        self.ended = threading.Event()
        self.status = 0
        self.grace: int | None = None
        self.version_answer = version or PODMAN_VERSION

    def version(self, api_version: bool = True) -> dict:
        return self.version_answer

    def images(self, name: str) -> list[dict]:
        return [{"Id": name}]

    def create_host_config(self, **kwargs) -> dict:
        self.host_config = kwargs
        return kwargs

    def create_container(self, **kwargs) -> dict:
        self.container = kwargs
        self.created += 1
        ends = threading.Timer(RUNS_AT_MOST_S, self.ended.set)
        ends.daemon = True
        ends.start()
        return {"Id": "c0ffee"}

    def attach(self, **kwargs):
        def lines():
            yield b"working\n"
            while not self.ended.wait(0.02):
                pass
        return lines()

    def start(self, container: str) -> None:
        pass

    def wait(self, container: str) -> dict:
        while not self.ended.wait(0.02):
            pass
        return {"StatusCode": self.status, "Error": None}

    def stop(self, container: str, timeout: int | None = None) -> None:
        self.stopped += 1
        self.grace = timeout
        self.status = 143
        self.ended.set()

    def remove_container(self, container: str, force: bool = False, **kwargs) -> None:
        from docker.errors import APIError

        if not self.ended.is_set():
            if not force:
                raise APIError(f"500 Server Error: cannot remove container {container} as it is running")
            self.status = 137
            self.ended.set()
        self.removed += 1


PODMAN_VERSION = {"Platform": {"Name": "linux/amd64/debian-12"}, "Version": "4.3.1", "ApiVersion": "1.41",
                  "Components": [{"Name": "Podman Engine", "Version": "4.3.1"}, {"Name": "Conmon", "Version": "2.1.6"}]}
DOCKER_VERSION = {"Platform": {"Name": "Docker Engine - Community"}, "Version": "27.3.1", "ApiVersion": "1.47",
                  "Components": [{"Name": "Engine", "Version": "27.3.1"}, {"Name": "containerd", "Version": "1.7.22"},
                                 {"Name": "runc", "Version": "1.1.14"}, {"Name": "docker-init", "Version": "0.19.0"}]}


def docker_stage(monkeypatch, tmp_path, engine: FakeEngine, stage: str = "taskgen", **extra):
    from dags.execution import docker as docker_mode

    monkeypatch.setenv("POSTTRAIN_RUN_ROOT", "s3://posttrain-nowhere/runs")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no.sock")
    monkeypatch.delenv("POSTTRAIN_CONTAINER_FLAGS", raising=False)
    docker_mode.container_flags.cache_clear()
    cls, kwargs = docker_mode.operator(spec(stage), resources(stage))
    op = cls(task_id=stage, command=ARGS, execution_timeout=timedelta(hours=2), **kwargs, **extra)
    op.__dict__["hook"] = SimpleNamespace(api_client=engine, client_created=True)  # a cached property
    return op


def test_a_container_past_its_time_limit_is_stopped_removed_and_fails_unretried(monkeypatch, tmp_path, final_errors):
    """Before, the provider's cleanup removed the running container without force: the
    engine's HTTP 500 replaced the timeout, the task was retried, the container ran on."""
    from airflow.sdk.exceptions import AirflowFailException

    engine = FakeEngine()
    op = docker_stage(monkeypatch, tmp_path, engine)
    started = time.monotonic()
    with pytest.raises(AirflowFailException) as failed, time_limit(1):
        op.execute({})
    assert str(failed.value) == TIMEOUT_LINE
    assert (engine.created, engine.stopped, engine.removed, engine.status, engine.grace) == (1, 1, 1, 143, 10)
    assert time.monotonic() - started < RUNS_AT_MOST_S / 2
    assert [e.line() for e in final_errors] == [TIMEOUT_LINE]


def test_sigterm_under_posttrain_run_stops_the_container(monkeypatch, tmp_path, final_errors, posttrain_run):
    """Before, SIGTERM (or Ctrl-C, or a lost writer lease) was only recorded while a
    container stage ran: the container ran to its end (here exit 0 after RUNS_AT_MOST_S)
    and the task succeeded. Now it ends as an in-process stage does: stopped (SIGTERM,
    exit 143 in the container), removed, and the task AirflowTaskTerminated (no retry)."""
    from airflow.sdk.exceptions import AirflowTaskTerminated

    engine = FakeEngine()
    op = docker_stage(monkeypatch, tmp_path, engine)
    started = time.monotonic()
    sigterm_in(0.5)
    with pytest.raises(AirflowTaskTerminated) as stopped:
        op.execute({})
    assert str(stopped.value) == "taskgen: stopped by SIGTERM"
    assert (engine.created, engine.stopped, engine.removed, engine.status, engine.grace) == (1, 1, 1, 143, 10)
    assert time.monotonic() - started < RUNS_AT_MOST_S / 2
    assert runner.stopping() and runner.stop_signal() == signal.SIGTERM  # posttrain run exits 143 on it
    assert final_errors == []  # not a user's mistake: the command ends "stopped by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is runner._record  # recorded again between tasks


def test_a_container_task_told_to_stop_before_it_starts_starts_nothing(monkeypatch, tmp_path, posttrain_run):
    from airflow.sdk.exceptions import AirflowTaskTerminated

    engine = FakeEngine()
    op = docker_stage(monkeypatch, tmp_path, engine)
    os.kill(os.getpid(), signal.SIGTERM)  # between two tasks: recorded
    with pytest.raises(AirflowTaskTerminated, match=r"^taskgen: not started, the process was told to stop$"):
        op.execute({})
    assert engine.created == 0


def test_a_container_that_finishes_is_left_to_the_provider(monkeypatch, tmp_path, final_errors, posttrain_run):
    engine = FakeEngine()
    engine.ended.set()
    op = docker_stage(monkeypatch, tmp_path, engine)
    assert op.execute({}) == "working"  # the provider's XCom: the last line
    assert (engine.created, engine.stopped, engine.removed) == (1, 0, 1)


@pytest.mark.parametrize("stage, cpu_shares, shm", [("taskgen", 2048, None), ("sandbox", 4096, None),
                                                     ("trainer", 2048, 32 * 2**30), ("rollout", 2048, 16 * 2**30)])
def test_a_stage_container_gets_its_cpu_request_and_the_pods_dev_shm(stage, cpu_shares, shm, monkeypatch, tmp_path):
    """Before, every container had the provider's 1024 CPU shares whatever ``resources.<stage>.cpu``
    said, and a 64 MiB /dev/shm where the stage's pod gets one in memory (the GPU stages)."""
    engine = FakeEngine()
    engine.ended.set()
    docker_stage(monkeypatch, tmp_path, engine, stage).execute({})
    res = resources(stage)
    assert engine.host_config["cpu_shares"] == cpu_shares  # what the kubelet gives a pod's CPU request
    assert engine.host_config["mem_limit"] == int(res.memory.removesuffix("Gi")) * 2**30
    assert engine.host_config["shm_size"] == shm


def test_the_recipes_cpu_reaches_the_container(monkeypatch, tmp_path):
    from components.core.stages import Resources
    from dags.execution import docker as docker_mode

    monkeypatch.setenv("POSTTRAIN_RUN_ROOT", "s3://posttrain-nowhere/runs")
    for cpu, shares in (("500m", 512), ("2", 2048), ("1.5", 1536), ("16", 16384)):
        _, kwargs = docker_mode.operator(spec("trainer"), Resources(cpu=cpu, memory="3Gi", gpus=1))
        assert (kwargs["cpus"], round(kwargs["cpus"] * 1024), kwargs["shm_size"]) == (
            docker_mode.cpu_count(cpu), shares, 3 * 2**30)
    _, kwargs = docker_mode.operator(spec("trainer"), Resources(cpu="2", memory="3Gi", gpus=0))
    assert "shm_size" not in kwargs  # as its pod: no GPU, no /dev/shm in memory


@pytest.mark.parametrize("stage, size, version, home", [
    ("trainer", 50 * 2**30, PODMAN_VERSION, "U"), ("taskgen", 4 * 2**30, PODMAN_VERSION, "U"),
    ("sandbox", 8 * 2**30, PODMAN_VERSION, "U"),  # a Docker Engine refuses the sandboxed stages (unmask=ALL)
    ("trainer", 50 * 2**30, DOCKER_VERSION, "mode=1777"), ("taskgen", 4 * 2**30, DOCKER_VERSION, "mode=1777"),
], ids=["trainer-podman", "taskgen-podman", "sandbox-podman", "trainer-docker", "taskgen-docker"])
def test_a_stage_container_has_a_read_only_root_and_its_scratch_in_tmpfs(stage, size, version, home, monkeypatch,
                                                                         tmp_path):
    """As its pod: a read-only root, and /tmp and the images' home as tmpfs of the stage's
    ``scratch``, executable (torch loads compiled kernels from there), the home writable by
    uid 10001 (podman's ``U``: podman 4 ignores ``mode`` there; Docker's default 1777
    elsewhere). Before, a stage could write anywhere in its image without a bound."""
    engine = FakeEngine(version)
    engine.ended.set()
    docker_stage(monkeypatch, tmp_path, engine, stage).execute({})
    assert engine.host_config["read_only"] is True
    assert engine.host_config["tmpfs"] == {"/tmp": f"size={size},exec,mode=1777",
                                           "/home/posttrain": f"size={size},exec,{home}"}


def test_the_recipes_scratch_sizes_the_containers_tmpfs(monkeypatch, tmp_path):
    from components.core.recipe import parse_recipe
    from dags.execution import docker as docker_mode

    monkeypatch.setenv("POSTTRAIN_RUN_ROOT", "s3://posttrain-nowhere/runs")
    recipe = parse_recipe({"pipeline": "big", "resources": {"trainer": {"scratch": "100Gi"}}})
    _, kwargs = docker_mode.operator(spec("trainer"), resources("trainer", recipe))
    assert kwargs["read_only"] is True
    assert kwargs["scratch"] == {"/tmp": 100 * 2**30, "/home/posttrain": 100 * 2**30}
    assert docker_mode.tmpfs_options(kwargs["scratch"], podman=True) == {
        "/tmp": f"size={100 * 2**30},exec,mode=1777", "/home/posttrain": f"size={100 * 2**30},exec,U"}


DOCKER_ENGINE_LINE = (
    "DOCKER_HOST='unix://{sock}': the engine there is Docker Engine - Community, which refuses --security-opt "
    "unmask=ALL (podman's; the sandboxed stages need it for bubblewrap's /proc); fix: point DOCKER_HOST at podman's "
    "socket (`podman system service`), use POSTTRAIN_EXECUTION=kubernetes, or unset POSTTRAIN_EXECUTION to run the "
    "stages in this process")


def test_a_sandboxed_stage_on_a_docker_engine_fails_at_once_with_one_line(monkeypatch, tmp_path, final_errors):
    """Before, Docker Engine refused unmask=ALL at every sandboxed container's creation
    (``invalid --security-opt``), which the task took for an outage and retried."""
    from airflow.sdk.exceptions import AirflowFailException

    engine = FakeEngine(DOCKER_VERSION)
    engine.ended.set()
    op = docker_stage(monkeypatch, tmp_path, engine, "sandbox")
    with pytest.raises(AirflowFailException) as failed:
        op.execute({})
    line = DOCKER_ENGINE_LINE.format(sock=f"{tmp_path}/no.sock")
    assert str(failed.value) == line and [e.line() for e in final_errors] == [line]
    assert engine.created == 0
    engine = FakeEngine(DOCKER_VERSION)  # a stage without the sandbox's options runs on Docker Engine
    engine.ended.set()
    docker_stage(monkeypatch, tmp_path, engine, "taskgen").execute({})
    assert engine.created == 1 and "security_opt" not in engine.host_config
    engine = FakeEngine(PODMAN_VERSION)  # and the sandboxed one on podman
    engine.ended.set()
    docker_stage(monkeypatch, tmp_path, engine, "sandbox").execute({})
    assert engine.created == 1 and "unmask=ALL" in engine.host_config["security_opt"]


class _EngineAPI:
    """An engine's HTTP API on a unix socket that answers ``/version`` (and ``/_ping``) only."""

    def __init__(self, path: str, version: dict) -> None:
        import json
        import socketserver
        from http.server import BaseHTTPRequestHandler

        body = json.dumps(version).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok = self.path.split("?")[0].rsplit("/", 1)[-1] in ("version", "_ping")
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def address_string(self) -> str:
                return "unix"

            def log_message(self, *args) -> None:
                pass

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self.server = Server(path, Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("version, refused", [(DOCKER_VERSION, True), (PODMAN_VERSION, False)])
def test_posttrain_run_refuses_a_docker_engine_for_the_sandboxed_stages(version, refused, monkeypatch, tmp_path):
    """``check_engine_here`` (``posttrain run``'s check before any work) asks the engine
    what it is: one line and exit 2, not retried container failures."""
    from dags.execution import check_engine_here
    from dags.execution import docker as docker_mode

    sock = tmp_path / "engine.sock"
    api = _EngineAPI(str(sock), version)
    try:
        monkeypatch.setenv("POSTTRAIN_EXECUTION", "docker")
        monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")
        monkeypatch.delenv("POSTTRAIN_CONTAINER_FLAGS", raising=False)
        docker_mode.container_flags.cache_clear()
        if refused:
            with pytest.raises(UserError) as error:
                check_engine_here()
            assert error.value.line() == DOCKER_ENGINE_LINE.format(sock=sock)
        else:
            check_engine_here()
        flags = tmp_path / "flags"  # flags without podman's options run on Docker Engine too
        flags.write_text("--runtime runc --security-opt seccomp=unconfined --ulimit nofile=1024:1024\n")
        monkeypatch.setenv("POSTTRAIN_CONTAINER_FLAGS", str(flags))
        docker_mode.container_flags.cache_clear()
        check_engine_here()
    finally:
        api.close()
        docker_mode.container_flags.cache_clear()


def test_an_engine_that_does_not_answer_is_left_to_the_tasks(monkeypatch, tmp_path):
    """A socket that is there but answers nothing is an outage the stage tasks retry."""
    import socket

    from dags.execution import check_engine_here
    from dags.execution import docker as docker_mode

    sock = tmp_path / "mute.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock))
    try:
        monkeypatch.setenv("POSTTRAIN_EXECUTION", "docker")
        monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")
        monkeypatch.delenv("POSTTRAIN_CONTAINER_FLAGS", raising=False)
        docker_mode.container_flags.cache_clear()
        check_engine_here()
    finally:
        server.close()


# --- kubernetes mode --------------------------------------------------------------------


class FakeCluster:
    """The ``CoreV1Api`` calls KubernetesPodOperator makes, for pods that do what ``fate``
    says: ``"pending"`` (scheduled, never starts: no GPU node yet), ``"runs"`` (Running until
    deleted, or Succeeded after ``RUNS_AT_MOST_S``), or an exit code (ended already, its
    termination message ``message``). Every read returns a copy, as the API server does."""

    def __init__(self, fate: str | int, message: str = "") -> None:
        self.api_client = ApiClient()
        self.fate, self.message = fate, message
        self.pods: dict[str, k8s.V1Pod] = {}
        self.born: dict[str, float] = {}
        self.created: list[str] = []
        self.deleted: list[str] = []
        self.labelled_checked: list[str] = []

    def live(self) -> list[str]:
        return [name for name in self.pods if name not in self.deleted]

    def _status(self, name: str) -> k8s.V1PodStatus:
        if self.fate == "pending":
            return k8s.V1PodStatus(phase="Pending", conditions=[k8s.V1PodCondition(type="PodScheduled", status="True")])
        if self.fate == "runs" and time.monotonic() - self.born[name] < RUNS_AT_MOST_S:
            state, phase = k8s.V1ContainerState(running=k8s.V1ContainerStateRunning()), "Running"
        else:
            code = 0 if self.fate == "runs" else int(self.fate)
            from datetime import UTC, datetime

            state = k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(
                exit_code=code, message=self.message or None, finished_at=datetime.now(UTC)))
            phase = "Succeeded" if code == 0 else "Failed"
        return k8s.V1PodStatus(phase=phase, container_statuses=[k8s.V1ContainerStatus(
            name="base", image="i", image_id="", ready=phase == "Running", restart_count=0, state=state)])

    def _copy(self, name: str) -> k8s.V1Pod:
        pod = copy.deepcopy(self.pods[name])
        pod.status = self._status(name)
        return pod

    def create_namespaced_pod(self, body: dict, namespace: str, **kwargs) -> k8s.V1Pod:
        meta = body["metadata"]
        self.pods[meta["name"]] = k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name=meta["name"], namespace=namespace, labels=dict(meta.get("labels") or {})),
            spec=k8s.V1PodSpec(containers=[k8s.V1Container(name=c["name"]) for c in body["spec"]["containers"]]))
        self.created.append(meta["name"])
        self.born[meta["name"]] = time.monotonic()
        return self._copy(meta["name"])

    def list_namespaced_pod(self, namespace: str, label_selector: str = "", **kwargs) -> k8s.V1PodList:
        terms = [t for t in label_selector.split(",") if t]
        equal = dict(t.split("=", 1) for t in terms if "!=" not in t and "=" in t)
        unequal = dict(t.split("!=", 1) for t in terms if "!=" in t)
        found = []
        for name in self.live():
            labels = self.pods[name].metadata.labels
            if all(labels.get(k) == v for k, v in equal.items()) and all(labels.get(k) != v for k, v in unequal.items()):
                found.append(self._copy(name))
        return k8s.V1PodList(items=found)

    def read_namespaced_pod(self, name: str, namespace: str, **kwargs) -> k8s.V1Pod:
        if name not in self.live():
            raise ApiException(status=404, reason="Not Found")
        return self._copy(name)

    def read_namespaced_pod_log(self, name: str, namespace: str, **kwargs):
        cluster = self

        class Stream:
            def stream(self, amt=None, decode_content=True):
                yield b"2026-01-01T00:00:00Z working\n"
                while name in cluster.live() and cluster._status(name).phase == "Running":
                    time.sleep(0.02)

            def release_conn(self) -> None:
                pass

            def close(self) -> None:
                pass

        return Stream()

    def delete_namespaced_pod(self, name: str, namespace: str, **kwargs) -> None:
        if name not in self.live():
            raise ApiException(status=404, reason="Not Found")
        self.deleted.append(name)

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict, **kwargs) -> None:
        self.pods[name].metadata.labels.update(body["metadata"]["labels"])
        if body["metadata"]["labels"].get("already_checked") == "True":
            self.labelled_checked.append(name)

    def list_namespaced_event(self, namespace: str, **kwargs) -> k8s.CoreV1EventList:
        return k8s.CoreV1EventList(items=[])


def pod_stage(cluster: FakeCluster, stage: str = "taskgen", try_number: int = 1):
    """The stage's StagePod as the DAG makes it, against ``cluster``; (operator, context)."""
    from dags.execution import kubernetes as mode

    cls, kwargs = mode.operator(spec(stage), resources(stage))
    op = cls(task_id=stage, arguments=ARGS, execution_timeout=timedelta(hours=2), **kwargs)
    op.startup_check_interval_seconds = 0.1  # the provider's poll while a pod is Pending (5 s), shortened
    op.hook._is_in_cluster = False
    op.__dict__["client"] = cluster  # a cached property: the provider's CoreV1Api
    ti = SimpleNamespace(dag_id="post_training_iteration", task_id=stage, map_index=-1, try_number=try_number,
                         xcom_push=lambda **kw: None)
    context = {"ti": ti, "run_id": "manual__1", "dag": SimpleNamespace(), "task": op}
    op.render_template_fields(context)
    return op, context


def test_a_pod_past_its_time_limit_is_deleted_and_fails_unretried(final_errors):
    """Before, the provider's cleanup found the pod not succeeded, kept it (labelled
    checked) and raised "Pod ... returned a failure", which replaced the timeout: the task
    was retried beside the pod still running."""
    from airflow.sdk.exceptions import AirflowFailException

    cluster = FakeCluster("runs")
    op, context = pod_stage(cluster)
    with pytest.raises(AirflowFailException) as failed, time_limit(1):
        op.execute(context)
    assert str(failed.value) == TIMEOUT_LINE
    assert len(cluster.created) == 1 and cluster.deleted == cluster.created and cluster.live() == []
    assert cluster.labelled_checked == []
    assert [e.line() for e in final_errors] == [TIMEOUT_LINE]


def test_a_pod_that_never_starts_is_deleted_before_the_retry(monkeypatch, final_errors):
    """Before, the pod still Pending after the startup timeout was kept and labelled
    checked, so the retry made a second one, and both ran once the node scaled up."""
    from airflow.providers.cncf.kubernetes.utils.pod_manager import PodLaunchFailedException

    from dags.execution import kubernetes as mode

    monkeypatch.setenv(mode.STARTUP_TIMEOUT_VAR, "1")
    cluster = FakeCluster("pending")
    op, context = pod_stage(cluster)
    with pytest.raises(PodLaunchFailedException, match=r"^Pod took too long to start\. More than 1s\."):
        op.execute(context)  # an AirflowException: retried
    assert len(cluster.created) == 1 and cluster.deleted == cluster.created and cluster.live() == []
    assert final_errors == []
    retry, context = pod_stage(cluster, try_number=2)
    with pytest.raises(PodLaunchFailedException):
        retry.execute(context)
    assert len(cluster.created) == 2 and cluster.live() == []  # never two pods of the task at once


def test_sigterm_under_posttrain_run_deletes_the_pod(final_errors, posttrain_run):
    from airflow.sdk.exceptions import AirflowTaskTerminated

    cluster = FakeCluster("runs")
    op, context = pod_stage(cluster)
    started = time.monotonic()
    sigterm_in(0.5)
    with pytest.raises(AirflowTaskTerminated) as stopped:
        op.execute(context)
    assert str(stopped.value) == "taskgen: stopped by SIGTERM"
    assert len(cluster.created) == 1 and cluster.deleted == cluster.created
    assert time.monotonic() - started < RUNS_AT_MOST_S / 2
    assert final_errors == [] and runner.stop_signal() == signal.SIGTERM


@pytest.mark.parametrize("code", [1, 2])
def test_a_pod_that_ran_and_failed_is_kept_for_its_logs(code, final_errors):
    from airflow.exceptions import AirflowException
    from airflow.sdk.exceptions import AirflowFailException

    line = "posttrain: error: --recipe='x': no such recipe file; fix: pass a YAML file such as recipes/demo.yaml"
    cluster = FakeCluster(code, message=f"loading\n{line}\n")
    op, context = pod_stage(cluster)
    with pytest.raises(AirflowException) as failed:
        op.execute(context)
    assert isinstance(failed.value, AirflowFailException) == (code == 2)  # exit 2: a user's mistake, not retried
    if code == 2:
        assert str(failed.value) == f"stage pod exited 2: {line}"
    assert cluster.deleted == [] and cluster.labelled_checked == cluster.created and len(cluster.created) == 1


def test_a_pod_that_succeeds_is_deleted(final_errors):
    cluster = FakeCluster(0)
    op, context = pod_stage(cluster)
    assert op.execute(context) is None
    assert cluster.deleted == cluster.created and len(cluster.created) == 1


# --- against podman's socket ------------------------------------------------------------


def _image(stage: str) -> str:
    from components import __version__

    image = f"localhost/posttrain-{stage}:{__version__}"
    if subprocess.run(["podman", "image", "exists", image], capture_output=True).returncode != 0:
        pytest.skip(f"{image} is not built (make images)")
    return image


def _left(url: str, stage: str) -> list[str]:
    import docker

    client = docker.DockerClient(base_url=url)
    try:
        found = client.containers.list(all=True, filters={"label": f"posttrain.stage={stage}"})
        left = [c.status for c in found]
        for c in found:
            c.remove(force=True)
        return left
    finally:
        client.close()


@pytest.mark.parametrize("how", ["time limit", "SIGTERM"])
def test_a_real_container_cut_short_is_stopped_and_removed(how, podman_socket, monkeypatch, final_errors, posttrain_run):
    """Against podman: the engine's own HTTP 500 for removing a running container, before."""
    from airflow.sdk.exceptions import AirflowFailException, AirflowTaskTerminated

    from dags.execution import docker as docker_mode

    _image("taskgen")
    monkeypatch.setenv("DOCKER_HOST", podman_socket)
    monkeypatch.setenv("POSTTRAIN_IMAGE_PREFIX", "localhost/")
    monkeypatch.setenv("POSTTRAIN_RUN_ROOT", "s3://posttrain-nowhere/runs")
    monkeypatch.delenv("POSTTRAIN_CONTAINER_FLAGS", raising=False)
    docker_mode.container_flags.cache_clear()
    cls, kwargs = docker_mode.operator(spec("taskgen"), resources("taskgen"))
    kwargs["entrypoint"] = ["/bin/sleep"]  # a stage still working
    op = cls(task_id="taskgen", command=["60"], execution_timeout=timedelta(hours=2), **kwargs)
    started = time.monotonic()
    if how == "SIGTERM":
        sigterm_in(3)
        with pytest.raises(AirflowTaskTerminated, match=r"^taskgen: stopped by SIGTERM$"):
            op.execute({})
    else:
        with pytest.raises(AirflowFailException, match=r"^timeouts\.taskgen=7200: "), time_limit(3):
            op.execute({})
    assert time.monotonic() - started < 30
    assert _left(podman_socket, "taskgen") == []
