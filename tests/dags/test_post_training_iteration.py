"""The Airflow DAG: it imports cleanly, has the documented shape, and really runs.

The real runs go through ``posttrain run`` in a subprocess, as a user starts it:
Airflow's in-process test runner on a SQLite metadata DB, local store, SQLite MLflow.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from components import STAGES

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny.yaml"


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "POSTTRAIN_"))}
    env["POSTTRAIN_HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _posttrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "components.cli", *args]


DAGBAG = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=%r)
dag = bag.dags["post_training_iteration"]
print(json.dumps({
    "errors": {k: str(v) for k, v in bag.import_errors.items()},
    "parsed": sorted(s.file for s in bag.dagbag_stats),
    "kubernetes_provider": "airflow.providers.cncf.kubernetes.operators.pod" in sys.modules,
    "tasks": sorted(dag.task_ids),
    "max_active_runs": dag.max_active_runs,
    "max_consecutive_failed_dag_runs": dag.max_consecutive_failed_dag_runs,
    "sandbox_pool": dag.get_task("sandbox").pool,
    "trainer_retries": dag.get_task("trainer").retries,
    "trainer_outlets": [o.name for o in dag.get_task("trainer").outlets],
    "params": sorted(dag.params.keys()),
    "after_taskgen": sorted(dag.get_task("taskgen").downstream_task_ids),
    "after_reward": sorted(dag.get_task("reward").downstream_task_ids),
}))
"""


def test_dagbag_imports_without_errors(tmp_path):
    """A fresh interpreter, as Airflow's DAG processor would parse the folder."""
    env = {**_env(tmp_path / ".posttrain"), "AIRFLOW_HOME": str(tmp_path / "airflow"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    proc = subprocess.run([sys.executable, "-c", DAGBAG % str(REPO / "dags")], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shape = json.loads(proc.stdout.strip().splitlines()[-1])
    assert shape["errors"] == {}
    # .airflowignore keeps the helpers out: parsing execution/kubernetes.py imported the
    # Kubernetes provider on every run (0.4 s and four deprecation warnings) in any mode.
    assert shape["parsed"] == ["post_training_iteration.py"]
    assert shape["kubernetes_provider"] is False
    assert shape["tasks"] == sorted([*STAGES, "plan", "rollout_shards", "sandbox_shards", "reward_shards",
                                     "announce_champion"])
    assert shape["max_active_runs"] == 1
    assert shape["max_consecutive_failed_dag_runs"] == 3  # then paused: @continuous cannot fail the same iteration forever
    assert shape["sandbox_pool"] == "posttrain_sandbox"
    assert shape["trainer_retries"] == 3
    assert shape["trainer_outlets"] == ["posttrain-policy-candidate"]
    assert shape["params"] == ["recipe", "run_root"]  # no "holder" in the trigger form: posttrain run's own
    assert shape["after_taskgen"] == ["rollout"]
    assert shape["after_reward"] == ["validation"]


PARSE_TIMED = """
import json, time
started = time.monotonic()
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=%r)
dag = bag.dags["post_training_iteration"]
print(json.dumps({"errors": {k: str(v) for k, v in bag.import_errors.items()}, "seconds": time.monotonic() - started,
                  "trainer_timeout_s": dag.get_task("trainer").execution_timeout.total_seconds()}))
"""


def test_a_recipe_in_a_store_that_never_answers_does_not_stall_parsing(tmp_path):
    """POSTTRAIN_RECIPE on S3 behind an endpoint that accepts connections and never
    answers: reading it at parse time blocked the DAG's import for over 5 minutes (the
    DAG processor's import timeout is 30 s). The parse reads no store: the registry's time
    limits apply, and a warning says so."""
    from tests.fixtures.silent import silent_endpoint

    env = {k: v for k, v in _env(tmp_path / ".posttrain").items() if not k.startswith("AWS_")}
    env.update(AIRFLOW_HOME=str(tmp_path / "airflow"), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               POSTTRAIN_RECIPE="s3://bucket/r.yaml", AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s",
               AWS_DEFAULT_REGION="us-east-1")
    with silent_endpoint() as (held, port):
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
        proc = subprocess.run([sys.executable, "-c", PARSE_TIMED % str(REPO / "dags")], env=env, capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        connected = len(held)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed["errors"] == {}
    assert parsed["trainer_timeout_s"] == 6 * 3600  # the registry's
    assert (proc.stdout + proc.stderr).count("POSTTRAIN_RECIPE=s3://bucket/r.yaml is in a store, which the DAG's "
                                             "parse does not read") == 1
    assert connected == 0  # no connection was made: the parse read nothing from the store


def _manifest(run_root: Path, stage: str, iteration: int = 1, shard: str | None = None) -> Path:
    base = run_root / "tiny" / ("bootstrap" if stage == "bootstrap" else f"iter-{iteration:06d}/{stage}")
    return (base / shard / "_MANIFEST.json") if shard else (base / "_MANIFEST.json")


def test_posttrain_run_executes_the_dag_end_to_end(tmp_path):
    home = tmp_path / ".posttrain"
    proc = subprocess.run(_posttrain("run", "--recipe", str(TINY), "--iterations", "1"), cwd=tmp_path, env=_env(home),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for line in ("| bootstrap |", "| taskgen |", "| rollout[0/2] |", "| rollout[1/2] |", "| sandbox[1/2] |",
                 "| reward[0/2] |", "| validation |", "| trainer |", "| evaluation |"):
        assert line in out, f"missing progress line {line!r}"
    assert "eval pass@1 by domain" in out
    assert "deprecated" not in out + proc.stderr  # no third-party deprecation noise in the user's terminal
    assert f"mlflow ui --backend-store-uri sqlite:///{home / 'mlflow.db'}" in out
    run_root = home / "store"
    report = json.loads((run_root / "tiny/iter-000001/evaluation/report.json").read_text())
    assert report["candidate"] == "2" and report["baseline"] == "1"
    # The DAG run is recorded by Airflow, and every task instance succeeded.
    db = sqlite3.connect(home / "airflow" / "airflow.db")
    states = db.execute("select state from dag_run where dag_id='post_training_iteration'").fetchall()
    assert states == [("success",)]
    tis = dict(db.execute("select task_id || coalesce('#' || nullif(map_index, -1), ''), state from task_instance").fetchall())
    assert tis["trainer"] == "success" and tis["rollout#0"] == "success" and tis["rollout#1"] == "success"
    # plan, three shard lists, announce_champion, and three mapped stages with two shards each
    assert len(tis) == 1 + 3 + 1 + len(STAGES) + 2 * 3 - 3
    assert tis["announce_champion"] == "success"  # the candidate was promoted: the champion asset was emitted


def test_killed_run_resumes_without_redoing_finished_stages(tmp_path):
    """SIGKILL in the middle of the trainer (checkpoint written, manifest not); the rerun
    finishes the iteration, redoes nothing manifested and duplicates nothing."""
    home = tmp_path / ".posttrain"
    run_root = home / "store"
    env = {**_env(home), "POSTTRAIN_FAILPOINT": "before-manifest:trainer"}
    proc = subprocess.Popen(_posttrain("run", "--recipe", str(TINY), "--iterations", "1"), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in proc.stdout:  # wait until the trainer has written its checkpoint but not its manifest
        seen.append(line)
        if "failpoint before-manifest:trainer reached" in line:
            break
    else:
        raise AssertionError("the run ended before the failpoint:\n" + "".join(seen[-40:]))
    assert (run_root / "tiny/iter-000001/trainer/checkpoint/model.safetensors").exists()
    assert not _manifest(run_root, "trainer").exists()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    before = {p: p.read_bytes() for p in run_root.rglob("_MANIFEST.json")}
    assert len(before) == 1 + 1 + 2 * 3 + 1  # bootstrap, taskgen, 3 sharded stages x 2, validation

    rerun = subprocess.run(_posttrain("run", "--recipe", str(TINY), "--iterations", "1"), cwd=tmp_path, env=_env(home),
                           capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    for path, data in before.items():
        assert path.read_bytes() == data, f"{path} was rewritten"
    assert rerun.stdout.count("cache hit") == len(before)
    assert _manifest(run_root, "trainer").exists() and _manifest(run_root, "evaluation").exists()

    import pyarrow.parquet as pq

    rollouts = pq.read_table(run_root / "tiny/iter-000001/rollout/shard-00000-of-00002/rollouts.parquet").to_pylist()
    rollouts += pq.read_table(run_root / "tiny/iter-000001/rollout/shard-00001-of-00002/rollouts.parquet").to_pylist()
    ids = [r["rollout_id"] for r in rollouts]
    assert len(ids) == len(set(ids)) == 8 * 4  # tasks_per_iteration x group_size, no duplicates
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    versions = sorted(int(v.version) for v in client.search_model_versions("name = 'tiny-policy'"))
    assert versions == [1, 2], "a retried trainer must not register a second checkpoint"
    leftovers = [p for p in run_root.rglob("*") if ".tmp-" in p.name]
    assert leftovers == []


def test_the_pause_after_failed_runs_follows_the_deployments_setting(monkeypatch):
    """3 failed runs in a row pause the DAG, unless Airflow's own setting says how many."""
    from dags.wiring import max_failed_runs

    monkeypatch.delenv("AIRFLOW__CORE__MAX_CONSECUTIVE_FAILED_DAG_RUNS_PER_DAG", raising=False)
    assert max_failed_runs() == 3
    monkeypatch.setenv("AIRFLOW__CORE__MAX_CONSECUTIVE_FAILED_DAG_RUNS_PER_DAG", "1")
    assert max_failed_runs() == 1


@pytest.mark.parametrize(("zone", "expected"), [(None, "UTC"), ("Europe/Berlin", "Europe/Berlin")])
def test_a_cron_schedule_runs_on_the_deployments_clock(tmp_path, zone, expected):
    """``0 2 * * *`` ran at 02:00 UTC whatever Airflow's ``default_timezone`` said: the DAG's
    start date was fixed in UTC, and Airflow takes a cron's zone from it."""
    env = {**_env(tmp_path / ".posttrain"), "AIRFLOW_HOME": str(tmp_path / "airflow"),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "POSTTRAIN_SCHEDULE": "0 2 * * *"}
    if zone:
        env["AIRFLOW__CORE__DEFAULT_TIMEZONE"] = zone
    code = ("from dags.post_training_iteration import iteration_dag as d\n"
            "t = d.timetable\nprint(type(t).__name__, t.expression, d.timezone.name)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"CronTriggerTimetable 0 2 * * * {expected}"
