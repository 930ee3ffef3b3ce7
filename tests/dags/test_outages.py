"""Outages, for real: the store or the tracking server goes away in the middle of a stage,
and the run still succeeds, through Airflow's retry of that one task.

``posttrain run`` runs in a subprocess through ``tests/fixtures/pausing.py``, which holds one
stage still once its outputs are written (its metrics not yet logged to MLflow, its
manifest not yet written) so the test can cut the service off at that point: the
SeaweedFS server is SIGKILLed during the trainer (clients get "connection refused") and
started again on the same ports and data; the MLflow server is SIGSTOPped during
evaluation (clients connect and hear nothing) and SIGCONTed. The first attempt fails as an
outage (InfraError), Airflow retries the task (``RETRY`` in dags/wiring.py, its delay
shortened through POSTTRAIN_RETRY_DELAY_S), and the second attempt finishes the
iteration with the same bytes the first had written.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from components.core.storage import Store
from tests.fixtures.mlflow_server import MlflowServer
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


def paused_run(tmp_path: Path, env: dict[str, str], stage: str, retry_delay_s: float,
               recipe: Path = TINY) -> tuple[subprocess.Popen, Path, Path]:
    """Start ``posttrain run --iterations 1`` with ``stage``'s first attempt paused;
    returns the process, the pause folder and the log (stdout and stderr)."""
    pause = tmp_path / "pause"
    pause.mkdir()
    log = tmp_path / "run.log"
    env = {**env, "PYTHONPATH": str(REPO), "POSTTRAIN_TEST_PAUSE": stage, "POSTTRAIN_TEST_PAUSE_DIR": str(pause),
           "POSTTRAIN_RETRY_DELAY_S": str(retry_delay_s)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.fixtures.pausing", "run", "--recipe", str(recipe),
                                 "--iterations", "1"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, pause, log


def wait_until_failed_once(home: Path, proc: subprocess.Popen, log: Path, task: str) -> None:
    """Until Airflow has put ``task`` up for retry."""
    deadline = time.monotonic() + FAILED_STATE_TIMEOUT_S
    while True:
        runs = task_instances(home) if (home / "airflow" / "airflow.db").exists() else {}
        states = [tis.get(task) for tis in runs.values()]
        if ("up_for_retry", 1) in states:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{task} was never up for retry (states {states}, exit {proc.poll()}):\n"
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


def assert_only_retried(home: Path, task: str, why: str = "") -> None:
    """``task`` succeeded at its second try, every other task at its first; ``why`` is added
    to a failure's message (what the outage took, for a retry that came too early)."""
    (tis,) = task_instances(home).values()  # one DAG run
    assert len(tis) == 1 + 3 + 1 + 1 + TINY_STAGES_PER_ITERATION  # plan, shard lists, announce_champion, bootstrap
    assert tis.pop(task) == ("success", 2), why
    assert {name: ti for name, ti in tis.items() if ti != ("success", 1)} == {}


def test_store_outage_mid_stage_is_retried_and_the_run_succeeds(restartable_s3: RestartableS3, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    server = apply_env(monkeypatch, restartable_s3.server)
    home = tmp_path / ".posttrain"
    root = f"s3://{server.bucket}/outage"
    env = {k: v for k, v in cli_env(home).items() if not k.startswith("AWS_")} | server.env() | \
        {"POSTTRAIN_RUN_ROOT": root}
    proc, pause, log = paused_run(tmp_path, env, "trainer", STORE_RETRY_DELAY_S)
    try:
        wait_for(pause / "paused", proc, log)
        first = json.loads((pause / "paused").read_text())["outputs"]
        store = Store(root)
        assert store.exists("tiny/iter-000001/trainer/checkpoint/model.safetensors")
        assert not store.exists("tiny/iter-000001/trainer/_MANIFEST.json")

        restartable_s3.kill()
        down = time.monotonic()
        (pause / "go").touch()  # the trainer goes on: its manifest write meets a dead server
        wait_until_failed_once(home, proc, log, "trainer")
        back_after = restartable_s3.start()
        outage_s = time.monotonic() - down
        text = finish(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()

    assert f"InfraError: store unreachable at '{root}'" in text
    assert_only_retried(home, "trainer", f"the store was down {outage_s:.1f} s; SeaweedFS took {back_after:.1f} s "
                                         f"to start again, against a {STORE_RETRY_DELAY_S} s retry delay")
    trainer = json.loads(store.read_bytes("tiny/iter-000001/trainer/_MANIFEST.json"))
    assert {k: v["sha256"] for k, v in trainer["outputs"].items()} == first  # the retry wrote the same bytes
    assert len(manifests(store)) == 1 + TINY_STAGES_PER_ITERATION
    assert json.loads(store.read_bytes("tiny/iter-000001/evaluation/report.json"))["candidate"] == "2"
    assert registry_versions(home) == {1: f"{root}/tiny/bootstrap/checkpoint",
                                       2: f"{root}/tiny/iter-000001/trainer/checkpoint"}
    ids = rollout_ids(store, 1)
    assert len(ids) == len(set(ids)) == 8 * 4


@dataclass(frozen=True)
class TrackingOutage:
    home: Path
    store: Store
    pipeline: str
    log_text: str
    first: dict  # the paused attempt's outputs: {"outputs": {name: sha256}, "paths": {name: path}}
    first_files: dict[str, bytes]  # and their bytes, read while it was paused
    outage_s: float


def tracking_outage_during(stage: str, server: MlflowServer, s3: S3Server, tmp_path: Path) -> TrackingOutage:
    """``posttrain run --iterations 1`` of a pipeline of its own, with a tracking server and
    the run root in S3 (a deployment's set-up: a server takes no local checkpoint as a
    registry source); the server is SIGSTOPped once ``stage`` has written its outputs,
    and SIGCONTed once Airflow has put the task up for retry."""
    home = tmp_path / ".posttrain"
    pipeline = f"tiny-{stage}"  # the server is shared by this module's tests
    recipe = tmp_path / f"{pipeline}.yaml"
    recipe.write_text(TINY.read_text().replace("pipeline: tiny\n", f"pipeline: {pipeline}\n"))
    root = f"s3://{s3.bucket}/{unique_prefix(f'tracking-outage-{stage}')}"
    store = Store(root)
    env = cli_env(home, MLFLOW_TRACKING_URI=server.uri, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
                  MLFLOW_HTTP_REQUEST_TIMEOUT="5", POSTTRAIN_RUN_ROOT=root)
    proc, pause, log = paused_run(tmp_path, env, stage, TRACKING_RETRY_DELAY_S, recipe)
    try:
        wait_for(pause / "paused", proc, log)
        first = json.loads((pause / "paused").read_text())
        first_files = {name: store.read_bytes(path) for name, path in first["paths"].items() if name != "checkpoint"}
        server.pause()
        down = time.monotonic()
        (pause / "go").touch()  # the stage goes on: logging its metrics meets a hung server
        wait_until_failed_once(home, proc, log, stage)
        server.resume()
        outage_s = time.monotonic() - down
        text = finish(proc, log)
    finally:
        if server.paused:
            server.resume()
        if proc.poll() is None:
            proc.kill()
    return TrackingOutage(home, store, pipeline, text, first, first_files, outage_s)


def test_tracking_server_outage_mid_stage_is_retried_and_the_run_succeeds(mlflow_server: MlflowServer,
                                                                          s3_env: S3Server, tmp_path: Path) -> None:
    """MLflow's client would retry a refused connection for minutes on its own; with its
    retries off and a 5 s timeout, a hung server fails the trainer, and Airflow retries it."""
    run = tracking_outage_during("trainer", mlflow_server, s3_env, tmp_path)
    assert f"InfraError: tracking server unreachable at '{mlflow_server.uri}'" in run.log_text
    assert_only_retried(run.home, "trainer", f"the tracking server was stopped {run.outage_s:.1f} s")
    it = f"{run.pipeline}/iter-000001"
    trainer = json.loads(run.store.read_bytes(f"{it}/trainer/_MANIFEST.json"))
    assert {k: v["sha256"] for k, v in trainer["outputs"].items()} == run.first["outputs"]  # the same bytes
    root = run.store.uri
    assert registry_versions_at(mlflow_server.uri, run.pipeline) == {
        1: f"{root}/{run.pipeline}/bootstrap/checkpoint", 2: f"{root}/{it}/trainer/checkpoint"}
    assert json.loads(run.store.read_bytes(f"{it}/evaluation/report.json"))["candidate"] == "2"
    assert not (run.home / "mlflow.db").exists(), "nothing may go to the embedded SQLite MLflow"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    exp = client.get_experiment_by_name(run.pipeline).experiment_id
    runs = client.search_runs([exp], filter_string="tags.`posttrain.stage` = 'trainer'")
    assert len(runs) == 2  # one per attempt
    done = [r for r in runs if r.info.status == "FINISHED"]
    assert len(done) == 1 and done[0].info.run_id == trainer["mlflow_run_id"]
    assert done[0].data.metrics["trainer/steps"] == trainer["metrics"]["trainer/steps"]


def test_evaluation_retried_after_it_promoted_keeps_its_baseline(mlflow_server: MlflowServer,
                                                                 s3_env: S3Server, tmp_path: Path) -> None:
    """The server hangs in the middle of evaluation, after the first attempt has moved the
    champion alias to the candidate: the retry must write the same report (same baseline)."""
    run = tracking_outage_during("evaluation", mlflow_server, s3_env, tmp_path)
    assert_only_retried(run.home, "evaluation")
    it = f"{run.pipeline}/iter-000001"
    from mlflow.tracking import MlflowClient

    champion = MlflowClient(tracking_uri=mlflow_server.uri).get_model_version_by_alias(f"{run.pipeline}-policy",
                                                                                      "champion")
    assert str(champion.version) == "2"
    report = json.loads(run.store.read_bytes(f"{it}/evaluation/report.json"))
    assert report == json.loads(run.first_files["report"])
    assert (report["candidate"], report["baseline"], report["promoted"]) == ("2", "1", True)
    manifest = json.loads(run.store.read_bytes(f"{it}/evaluation/_MANIFEST.json"))
    assert {k: v["sha256"] for k, v in manifest["outputs"].items()} == run.first["outputs"]


def test_tracking_server_with_a_local_run_root_is_refused_in_one_line(mlflow_server: MlflowServer,
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
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # gives up, no hang
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"posttrain: unreachable: store unreachable at '{root}': "
                               "EndpointConnectionError: Could not connect to the endpoint URL")
    assert server.endpoint.removeprefix("http://") in lines[0] and lines[0].endswith("; retry once it is back")

    restartable_s3.start()
    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert registry_versions(home) == {1: f"{root}/tiny/bootstrap/checkpoint"}
