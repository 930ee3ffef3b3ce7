"""``posttrain run`` in docker mode told to stop while a stage container runs: SIGTERM to the
command alone (as ``kill``, or its own writer-lease thread when the lease is lost). The
stage's container is stopped (its stage gets SIGTERM: its MLflow run ends KILLED) and
removed, and the command ends as in-process (``tests/dags/test_stagehost.py``): exit 143,
"stopped by SIGTERM", no manifest. Before, the SIGTERM was only recorded: the container
ran on to its end (here: through the failpoint's hour) and the command with it.

Against podman's socket, SeaweedFS and an MLflow server on loopback, with the stage images
as they are (skipped when they are not built: this test builds none). Slow: a minute.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from components import __version__
from tests.fixtures.runs import TINY, cli_env, posttrain, read_until
from tests.fixtures.s3 import S3Server, unique_prefix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FAILPOINT = "before-manifest:bootstrap"


def _containers(url: str, stage: str) -> list[str]:
    import docker

    client = docker.DockerClient(base_url=url)
    try:
        return [c.status for c in client.containers.list(all=True, filters={"label": f"posttrain.stage={stage}"})]
    finally:
        client.close()


def test_sigterm_to_posttrain_run_stops_the_stage_container(s3_server: S3Server, s3_env, mlflow_server,
                                                            podman_socket: str, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from components.core.storage import Store

    image = f"localhost/posttrain-bootstrap:{__version__}"
    if subprocess.run(["podman", "image", "exists", image], capture_output=True).returncode != 0:
        pytest.skip(f"{image} is not built (make images)")
    root = f"s3://{s3_server.bucket}/{unique_prefix('docker-stop')}"
    env = {k: v for k, v in cli_env(tmp_path / ".posttrain").items() if not k.startswith("AWS_")}
    env.update(s3_server.env(), POSTTRAIN_RUN_ROOT=root, POSTTRAIN_EXECUTION="docker", DOCKER_HOST=podman_socket,
               POSTTRAIN_IMAGE_PREFIX="localhost/", POSTTRAIN_IMAGE_TAG=__version__,
               MLFLOW_TRACKING_URI=mlflow_server.uri, POSTTRAIN_FAILPOINT=FAILPOINT,
               AIRFLOW__LOGGING__LOGGING_LEVEL="INFO")  # the container's lines reach the command's output
    proc = subprocess.Popen(posttrain("run", "--recipe", str(TINY), "--iterations", "1"), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        read_until(proc.stdout, f"failpoint {FAILPOINT} reached", seen)
        assert _containers(podman_socket, "bootstrap") == ["running"]
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # the command alone, not its process group
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, "".join(seen) + rest
    assert time.monotonic() - started < 60
    assert rest.splitlines()[-1] == "posttrain: stopped by SIGTERM; run the same command again to resume", rest
    assert "posttrain task bootstrap failed: AirflowTaskTerminated: bootstrap: stopped by SIGTERM" in rest, rest
    assert _containers(podman_socket, "bootstrap") == []
    c = MlflowClient(tracking_uri=mlflow_server.uri)
    runs = c.search_runs([c.get_experiment_by_name("tiny").experiment_id], "attributes.run_name = 'bootstrap'")
    assert [r.info.status for r in runs] == ["KILLED"], "".join(seen)[-3000:] + rest[-6000:]  # the stage heard the SIGTERM
    assert Store(root).glob("tiny/bootstrap/_MANIFEST.json") == []
    assert Store(root).glob("tiny/*") != []  # the store is the one the run wrote
