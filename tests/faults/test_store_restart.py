"""A SeaweedFS restart in the middle of rollout and of the trainer: the stage's first
attempt meets the dead server when it writes its manifest, fails as an outage, Airflow
retries that one task once the server is back, and the run finishes; no later stage
ever reads an object that is not complete and manifested.

``posttrain run`` runs through ``tests/fixtures/pausing.py``, which holds the stage still
once its data files are written (for rollout: the first shard to get there; the other
shard runs on). The server is SIGKILLed while the stage is held, the stage goes on, and
the server is started again on the same ports and data once Airflow has put the task up
for retry.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.core.storage import Store
from tests.fixtures.pausing import wait_for
from tests.fixtures.runs import REPO, TINY, TINY_STAGES_PER_ITERATION, cli_env, manifests, rollout_ids, task_instances
from tests.fixtures.s3 import RestartableS3, apply_env

pytestmark = pytest.mark.slow

RETRY_DELAY_S = 5.0  # longer than SeaweedFS takes to start again (about 1 s)
FAILED_STATE_TIMEOUT_S = 180.0


def up_for_retry(home: Path, stage: str) -> list[str]:
    """Task ids (``rollout#1`` for a mapped one) of ``stage`` that Airflow put up for retry after one try."""
    if not (home / "airflow" / "airflow.db").exists():
        return []
    return [name for tis in task_instances(home).values() for name, state in tis.items()
            if name.split("#")[0] == stage and state == ("up_for_retry", 1)]


@pytest.mark.parametrize("stage", ["rollout", "trainer"])
def test_store_restart_mid_stage_is_retried_and_nothing_partial_is_read(
        stage: str, restartable_s3: RestartableS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = apply_env(monkeypatch, restartable_s3.server)
    home = tmp_path / ".posttrain"
    root = f"s3://{server.bucket}/restart-{stage}"
    store = Store(root)
    pause = tmp_path / "pause"
    pause.mkdir()
    log = tmp_path / "run.log"
    env = {k: v for k, v in cli_env(home).items() if not k.startswith("AWS_")} | server.env() | {
        "POSTTRAIN_RUN_ROOT": root, "PYTHONPATH": str(REPO), "POSTTRAIN_TEST_PAUSE": stage,
        "POSTTRAIN_TEST_PAUSE_DIR": str(pause), "POSTTRAIN_RETRY_DELAY_S": str(RETRY_DELAY_S)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.fixtures.pausing", "run", "--recipe", str(TINY),
                                 "--iterations", "1"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for(pause / "paused", proc, log)
        first = json.loads((pause / "paused").read_text())
        held = {rel for rel in manifests(store) if f"/{stage}/" in rel}
        restartable_s3.kill()
        (pause / "go").touch()  # the stage goes on: its manifest write meets a dead server
        deadline = time.monotonic() + FAILED_STATE_TIMEOUT_S
        while not (retried := up_for_retry(home, stage)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.2)
        restartable_s3.start()
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-5000:]
    assert f"store unreachable at '{root}'" in text
    assert retried

    # Every task ran once, but the stage's tasks that met the dead server (the held one;
    # for rollout perhaps the other shard too), which succeeded on their second try.
    (tis,) = task_instances(home).values()
    again = {name for name, ti in tis.items() if ti == ("success", 2)}
    assert set(retried) <= again and {name.split("#")[0] for name in again} == {stage}, tis
    assert {name: ti for name, ti in tis.items() if name not in again and ti != ("success", 1)} == {}

    # Nothing partial: every manifest lists complete objects with its digests, and every
    # stage read exactly what its upstream manifests list.
    found = manifests(store)
    assert len(found) == 1 + TINY_STAGES_PER_ITERATION
    for rel, data in found.items():
        for name, meta in json.loads(data)["outputs"].items():
            if name != "checkpoint":
                assert hashlib.sha256(store.read_bytes(meta["path"])).hexdigest() == meta["sha256"], f"{rel}: {name}"
    retried_manifest = next(json.loads(data) for rel, data in found.items()
                            if f"/{stage}/" in rel and rel not in held and
                            {k: v["sha256"] for k, v in json.loads(data)["outputs"].items()} == first["outputs"])
    assert retried_manifest["stage"] == stage  # the retry wrote the same bytes as the first attempt
    ids = rollout_ids(store, 1)
    assert len(ids) == len(set(ids)) == 8 * 4
    report = json.loads(store.read_bytes("tiny/iter-000001/evaluation/report.json"))
    assert (report["candidate"], report["baseline"]) == ("2", "1")
