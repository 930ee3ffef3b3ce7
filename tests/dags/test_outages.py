"""Outages, for real: the store or the tracking server goes away in the middle of a stage,
and the run still succeeds, through Airflow's retry of that one task.

``posttrain run`` runs in a subprocess through ``tests/fixtures/pausing.py``, which holds the
trainer still once its outputs are written (its metrics not yet logged to MLflow, its
manifest not yet written) so the test can cut the service off at that point: the
SeaweedFS server is SIGKILLed (clients get "connection refused") and started again on the
same ports and data; the MLflow server is SIGSTOPped (clients connect and hear nothing)
and SIGCONTed. The first attempt fails as an outage (InfraError), Airflow retries the task
(``RETRY`` in dags/wiring.py, its delay shortened through POSTTRAIN_RETRY_DELAY_S), and the
second attempt finishes the iteration.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.core.storage import Store
from tests.fixtures.mlflow_server import MlflowServer, mlflow_server  # noqa: F401  (a fixture)
from tests.fixtures.pausing import wait_for
from tests.fixtures.runs import (
    REPO,
    TINY,
    TINY_STAGES_PER_ITERATION,
    cli_env,
    manifests,
    posttrain,
    registry_versions,
    registry_versions_at,
    rollout_ids,
    task_instances,
)
from tests.fixtures.s3 import RestartableS3, S3Server, apply_env, unique_prefix

FAILED_STATE_TIMEOUT_S = 180.0
STORE_RETRY_DELAY_S = 5.0  # longer than SeaweedFS takes to start again (about 1 s)
TRACKING_RETRY_DELAY_S = 2.0  # SIGCONT brings the tracking server back at once


def paused_run(tmp_path: Path, env: dict[str, str], retry_delay_s: float) -> tuple[subprocess.Popen, Path, Path]:
    """Start ``posttrain run --iterations 1`` with the trainer's first attempt paused;
    returns the process, the pause folder and the log (stdout and stderr)."""
    pause = tmp_path / "pause"
    pause.mkdir()
    log = tmp_path / "run.log"
    env = {**env, "PYTHONPATH": str(REPO), "POSTTRAIN_TEST_PAUSE": "trainer", "POSTTRAIN_TEST_PAUSE_DIR": str(pause),
           "POSTTRAIN_RETRY_DELAY_S": str(retry_delay_s)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.fixtures.pausing", "run", "--recipe", str(TINY),
                                 "--iterations", "1"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, pause, log


def wait_until_trainer_failed_once(home: Path, proc: subprocess.Popen, log: Path) -> None:
    """Until Airflow has put the trainer up for retry."""
    deadline = time.monotonic() + FAILED_STATE_TIMEOUT_S
    while True:
        runs = task_instances(home) if (home / "airflow" / "airflow.db").exists() else {}
        states = [tis.get("trainer") for tis in runs.values()]
        if ("up_for_retry", 1) in states:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the trainer was never up for retry (states {states}, exit {proc.poll()}):\n"
                                 + log.read_text(errors="replace")[-4000:])
        time.sleep(0.2)


def finish(proc: subprocess.Popen, log: Path) -> str:
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-5000:]
    return text


def assert_only_the_trainer_retried(home: Path) -> None:
    (tis,) = task_instances(home).values()  # one DAG run
    assert len(tis) == 1 + 3 + 1 + 1 + TINY_STAGES_PER_ITERATION  # plan, shard lists, announce_champion, bootstrap
    assert tis.pop("trainer") == ("success", 2)
    assert {name: ti for name, ti in tis.items() if ti != ("success", 1)} == {}


def test_store_outage_mid_stage_is_retried_and_the_run_succeeds(restartable_s3: RestartableS3, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    server = apply_env(monkeypatch, restartable_s3.server)
    home = tmp_path / ".posttrain"
    root = f"s3://{server.bucket}/outage"
    env = {k: v for k, v in cli_env(home).items() if not k.startswith("AWS_")} | server.env() | \
        {"POSTTRAIN_RUN_ROOT": root}
    proc, pause, log = paused_run(tmp_path, env, STORE_RETRY_DELAY_S)
    try:
        wait_for(pause / "paused", proc, log)
        first = json.loads((pause / "paused").read_text())["outputs"]
        store = Store(root)
        assert store.exists("tiny/iter-000001/trainer/checkpoint/model.safetensors")
        assert not store.exists("tiny/iter-000001/trainer/_MANIFEST.json")

        restartable_s3.kill()
        down = time.monotonic()
        (pause / "go").touch()  # the trainer goes on: its manifest write meets a dead server
        wait_until_trainer_failed_once(home, proc, log)
        back_after = restartable_s3.start()
        outage_s = time.monotonic() - down
        text = finish(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()

    assert 1.0 < outage_s < 60.0, f"the store was down {outage_s:.1f} s"
    assert back_after < STORE_RETRY_DELAY_S, f"SeaweedFS took {back_after:.1f} s to start: the retry may have come first"
    assert f"InfraError: store unreachable at '{root}'" in text
    assert_only_the_trainer_retried(home)
    trainer = json.loads(store.read_bytes("tiny/iter-000001/trainer/_MANIFEST.json"))
    assert {k: v["sha256"] for k, v in trainer["outputs"].items()} == first  # the retry wrote the same bytes
    assert len(manifests(store)) == 1 + TINY_STAGES_PER_ITERATION
    assert json.loads(store.read_bytes("tiny/iter-000001/evaluation/report.json"))["candidate"] == "2"
    assert registry_versions(home) == {1: f"{root}/tiny/bootstrap/checkpoint",
                                       2: f"{root}/tiny/iter-000001/trainer/checkpoint"}
    ids = rollout_ids(store, 1)
    assert len(ids) == len(set(ids)) == 8 * 4


def test_tracking_server_outage_mid_stage_is_retried_and_the_run_succeeds(mlflow_server: MlflowServer,  # noqa: F811
                                                                          s3_env: S3Server, tmp_path: Path) -> None:
    """A deployment's set-up: a tracking server, and the run root in S3 (a server takes no
    local checkpoint as a registry source). MLflow's client would retry a refused
    connection for minutes on its own; with its retries off and a 5 s timeout, a hung
    server fails the stage, and Airflow retries it."""
    home = tmp_path / ".posttrain"
    root = f"s3://{s3_env.bucket}/{unique_prefix('tracking-outage')}"
    env = cli_env(home, MLFLOW_TRACKING_URI=mlflow_server.uri, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
                  MLFLOW_HTTP_REQUEST_TIMEOUT="5", POSTTRAIN_RUN_ROOT=root)
    proc, pause, log = paused_run(tmp_path, env, TRACKING_RETRY_DELAY_S)
    try:
        wait_for(pause / "paused", proc, log)
        first = json.loads((pause / "paused").read_text())["outputs"]
        mlflow_server.pause()
        down = time.monotonic()
        (pause / "go").touch()  # the trainer goes on: logging its metrics meets a hung server
        wait_until_trainer_failed_once(home, proc, log)
        mlflow_server.resume()
        outage_s = time.monotonic() - down
        text = finish(proc, log)
    finally:
        if mlflow_server.paused:
            mlflow_server.resume()
        if proc.poll() is None:
            proc.kill()

    assert 5.0 < outage_s < 90.0, f"the tracking server was stopped {outage_s:.1f} s"
    assert f"InfraError: tracking server unreachable at '{mlflow_server.uri}'" in text
    assert_only_the_trainer_retried(home)
    store = Store(root)
    trainer = json.loads(store.read_bytes("tiny/iter-000001/trainer/_MANIFEST.json"))
    assert {k: v["sha256"] for k, v in trainer["outputs"].items()} == first
    assert registry_versions_at(mlflow_server.uri) == {1: f"{root}/tiny/bootstrap/checkpoint",
                                                       2: f"{root}/tiny/iter-000001/trainer/checkpoint"}
    assert not (home / "mlflow.db").exists(), "nothing may go to the embedded SQLite MLflow"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    exp = client.get_experiment_by_name("tiny").experiment_id
    runs = client.search_runs([exp], filter_string="tags.`posttrain.stage` = 'trainer'")
    assert len(runs) == 2  # one per attempt
    done = [r for r in runs if r.info.status == "FINISHED"]
    assert len(done) == 1 and done[0].info.run_id == trainer["mlflow_run_id"]
    assert done[0].data.metrics["trainer/steps"] == trainer["metrics"]["trainer/steps"]


def test_tracking_server_with_a_local_run_root_is_refused_in_one_line(mlflow_server: MlflowServer,  # noqa: F811
                                                                      tmp_path: Path) -> None:
    """A tracking server accepts no local path as a registry source: a user's mistake
    (exit 2, nothing retried), named with the fix, not a bootstrap that fails four times."""
    home = tmp_path / ".posttrain"
    root = f"file://{tmp_path / 'store'}"
    recipe = tmp_path / "local.yaml"  # its own pipeline: the server is shared with the other tests here
    recipe.write_text(TINY.read_text().replace("pipeline: tiny\n", "pipeline: tiny-local\n"))
    proc = subprocess.run(posttrain("stage", "bootstrap", "--recipe", str(recipe), "--run-root", root), cwd=tmp_path,
                          env=cli_env(home, MLFLOW_TRACKING_URI=mlflow_server.uri), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("posttrain")]
    assert lines == [f"posttrain: error: run_root='{root}/tiny-local/bootstrap/checkpoint': the tracking server at "
                     f"{mlflow_server.uri} refuses this checkpoint as a registry version source (it accepts no local "
                     "paths); fix: put the run root where the server can read it (s3://bucket/prefix), or unset "
                     "MLFLOW_TRACKING_URI to use the embedded SQLite tracking"]
    assert registry_versions_at(mlflow_server.uri, "tiny-local") == {}


def test_stopped_store_at_stage_start_exits_1_naming_the_store(restartable_s3: RestartableS3, tmp_path: Path) -> None:
    """``posttrain stage`` while the S3 server is down: one line naming the store, exit 1
    (worth retrying), not 2 (a user's mistake); and the same command works once it is back."""
    home = tmp_path / ".posttrain"
    server = restartable_s3.server
    root = f"s3://{server.bucket}/stopped"
    env = {k: v for k, v in cli_env(home).items() if not k.startswith("AWS_")} | server.env()
    args = posttrain("stage", "bootstrap", "--recipe", str(TINY), "--run-root", root)
    restartable_s3.kill()
    started = time.monotonic()
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"posttrain: unreachable: store unreachable at '{root}': "
                               "EndpointConnectionError: Could not connect to the endpoint URL")
    assert server.endpoint.removeprefix("http://") in lines[0] and lines[0].endswith("; retry once it is back")
    assert took < 60, f"giving up took {took:.0f} s"

    restartable_s3.start()
    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert registry_versions(home) == {1: f"{root}/tiny/bootstrap/checkpoint"}
